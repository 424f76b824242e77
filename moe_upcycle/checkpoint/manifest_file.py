"""Read our manifest, ``moe_upcycle.json``, as a file anyone may have edited.

A build writes it last (`publish.manifest.write_recipe`): a JSON object with the tool's name and
version, the resolved recipe under ``config``, the seed, and under ``sha256`` the digest of every
file the build wrote, by plain file name (and ``additional_chat_templates/NAME.jinja`` for named chat templates). `verify`, `route` and the ownership checks of ``--force``
read it back; `load_manifest` is the one reader, so a damaged or hand-edited manifest (a list, a
``sha256`` that is not a mapping, a name such as ``../../etc/passwd`` or ``/dev/zero``) is a
message naming the file and the field, never a traceback and never a read outside the folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from moe_upcycle.checkpoint.names import is_tokenizer_file
from moe_upcycle.errors import SourceError

MANIFEST = "moe_upcycle.json"
MAX_BYTES = 64 * 2**20  # a manifest is a few KB; a bigger file is not one
_HEX64 = re.compile(r"[0-9a-f]{64}")


def load_manifest(folder: Path) -> Optional[dict]:
    """The manifest of `folder` as a dict, or None when the folder has none.

    Raises:
        SourceError: the file is there but cannot be read, is not JSON, or is not a manifest's shape
            (see `shape_problem`); the message says to rebuild or delete it.
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > MAX_BYTES:
            raise SourceError(f"{path}: {path.stat().st_size} bytes, far more than a manifest holds; "
                              f"rebuild the model or delete the file")
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SourceError(f"{path}: cannot read it ({exc.strerror or exc}); check that it is readable by you") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SourceError(f"{path}: not valid JSON ({exc}); rebuild the model or delete the file") from None
    problem = shape_problem(data)
    if problem:
        raise SourceError(f"{path}: {problem}, so it is not a moe-upcycle manifest (a build writes a JSON object "
                          f"with config and sha256); rebuild the model or delete the file")
    return data


def shape_problem(data: object) -> Optional[str]:
    """What makes parsed JSON `data` unlike a manifest a build writes, or None.

    Example:
        >>> shape_problem([1, 2]), shape_problem({"sha256": {"../x": "0" * 64}})
        ('it is a JSON list, not an object', "sha256 names '../x', which is not a file name in the folder")
    """
    if not isinstance(data, dict):
        return f"it is a JSON {_kind(data)}, not an object"
    if "config" in data and not isinstance(data["config"], dict):
        return f"config is a JSON {_kind(data['config'])}, not an object"
    digests = data.get("sha256", {})
    if not isinstance(digests, dict):
        return f"sha256 is a JSON {_kind(digests)}, not an object of file names and digests"
    for name, digest in digests.items():
        if not isinstance(name, str) or not (name and Path(name).name == name and name not in (".", "..")
                                             or is_tokenizer_file(name)):
            return f"sha256 names {name!r}, which is not a file name in the folder"
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            return f"sha256 of {name!r} is {digest!r}, not a sha256 hex digest"
    return None


def _kind(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")
