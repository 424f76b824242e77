"""Which weight files of a model folder are read: exactly those transformers would load.

transformers' ``from_pretrained`` on a local folder (``modeling_utils._get_resolved_checkpoint_files``)
takes the file config.json's ``transformers_weights`` names if it has one, else the first of these
that is a file: ``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
``pytorch_model.bin.index.json`` (transformers 5 first loads distributed-checkpoint shards,
``shard-00000-model-00001-of-00002.safetensors``, which are refused). So a single ``model.safetensors`` wins
over an index beside it — even a stale index that names other shards. We read the same bytes
(and say which file was ignored), so the MoE is built from the model that `verify` and every
user of the base compare it with.

A tensor stored in two shards is ambiguous: the index names one, but transformers reads every
shard in sorted order and keeps the last copy. Rather than guess, the folder is refused, naming
the tensor and both files. It reads file names and the index's weight_map (`index_files`); headers
are read by `headers`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Optional

from moe_upcycle.errors import SourceError, UpcycleWarning, reraise_if_out_of_memory

# transformers' order of preference for a local folder (use_safetensors left at its default)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# transformers 5 loads a folder holding any such file as a distributed (DCP) checkpoint, before the above
DCP_SHARD = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")


def choose_weights(path: Path, config: Optional[dict] = None, field_name: str = "model") -> Optional[str]:
    """The weight file transformers would load from `path` (None when there is none).

    ``transformers_weights`` in config.json names the file outright (transformers 4.57 and 5 both
    obey it). Warns (`UpcycleWarning`) when a single-file checkpoint shadows an index of the same
    format, since the index and its shards are then ignored.

    Raises:
        SourceError: ``transformers_weights`` is not a safetensors file or index in the folder, or the
            folder holds distributed-checkpoint shards (transformers 5 loads those instead).
    """
    dcp = sorted(p.name for p in path.iterdir() if DCP_SHARD.match(p.name))
    if dcp:
        raise SourceError(f"{field_name}: {path} holds distributed-checkpoint shards ({dcp[0]}"
                          + (f" and {len(dcp) - 1} more" if len(dcp) > 1 else "") + "), which transformers 5 loads "
                          "instead of the usual weight files; moe-upcycle does not read them. Save the model with "
                          "save_pretrained into a new folder and use that")
    explicit = (config or {}).get("transformers_weights")
    if explicit is not None:
        return _explicit_weights(path, explicit, field_name)
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        return None
    chosen = present[0]
    shadowed = f"{chosen}.index.json"
    if shadowed in present:
        warnings.warn(UpcycleWarning(
            f"{path}: both {chosen} and {shadowed} are present; reading {chosen} and ignoring the index and its "
            f"shards, as transformers does. If the shards are the model you mean, remove {chosen}"), stacklevel=2)
    return chosen


def _explicit_weights(path: Path, name: object, field_name: str) -> str:
    """The file config.json's ``transformers_weights`` names, checked as transformers checks it."""
    where = f"{path / 'config.json'}: transformers_weights"
    if not isinstance(name, str) or not name.endswith((".safetensors", ".safetensors.index.json")):
        raise SourceError(f"{where} is {name!r}; transformers loads only a *.safetensors file or a "
                          f"*.safetensors.index.json named there — fix or remove the field")
    if Path(name).name != name or name in (".", ".."):
        raise SourceError(f"{where} is {name!r}, which is not a file name in {path}; moe-upcycle reads only "
                          f"weights in the model folder itself — fix the field")
    if not (path / name).is_file():
        raise SourceError(f"{where} names {name}, which is missing from {path} (transformers loads that file and "
                          f"nothing else); re-download the model or fix the field")
    return name


def duplicate_problems(folder: Path, found_in: dict[str, list[str]],
                       index: Optional[dict[str, Optional[set[str]]]], index_name: str) -> list[str]:
    """One problem per tensor stored in more than one shard file.

    Args:
        folder: the model folder (for messages).
        found_in: tensor key -> the shard files whose header holds it, in reading order.
        index: shard file -> keys the index assigns to it (None entries: no index).
        index_name: the index file's name, for messages.
    """
    named = {key: file for file, keys in (index or {}).items() for key in (keys or ())}
    problems = []
    for key, files in found_in.items():
        if len(files) < 2:
            continue
        said = f"; the index {index_name} names {named[key]}" if key in named else ""
        problems.append(f"{folder}: tensor {key!r} is stored in {len(files)} shards ({', '.join(files)}){said}. "
                        f"Which copy is the model is ambiguous (transformers keeps the copy in the last shard by "
                        f"name, {sorted(files)[-1]}), so nothing is built; remove the stale copy or re-download "
                        f"the model")
    return problems


def index_files(index: Path) -> dict[str, Optional[set[str]]]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):  # not an assert: `python -O` would skip it
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except OSError:
        raise  # unreadable: `open_checkpoint` says so
    except Exception as exc:
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        raise SourceError(f"{index}: not a valid index (needs a weight_map object): {exc}") from None
    if not weight_map:
        raise SourceError(f"{index}: its weight_map lists no tensors; the index is damaged — re-download it")
    files: dict[str, Optional[set[str]]] = {}
    safetensors = index.name.endswith(".safetensors.index.json")
    for key, file in weight_map.items():
        # a hostile index must not make us read files outside the model folder
        if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
            raise SourceError(f"{index}: tensor {key!r} is mapped to {file!r}, which is not a file name in the "
                              f"model folder; fix or re-download the index")
        if file.endswith(".safetensors") != safetensors:  # each index is read by one loader only
            raise SourceError(f"{index}: tensor {key!r} is mapped to {file!r}, but a "
                              f"{'safetensors' if safetensors else 'pytorch_model.bin'} index names only "
                              f"{'*.safetensors files' if safetensors else 'PyTorch files (not *.safetensors)'}; "
                              f"fix or re-download the index")
        files.setdefault(file, set()).add(key)
    for file in files:
        if not (index.parent / file).is_file():
            raise SourceError(f"{index.parent / file}: shard file is missing (the index {index.name} lists "
                              f"{len(files[file])} tensor(s) in it); re-download the model")
    return files


def check_index(path: Path, file: str, expected: Optional[set[str]], found: dict, index: Path) -> None:
    if expected is None:
        return
    missing = sorted(expected - set(found))
    if missing:
        raise SourceError(f"{index}: lists {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + f" in {file}, but {path / file} does not contain it")
