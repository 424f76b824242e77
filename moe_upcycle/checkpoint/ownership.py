"""What the tool may remove or replace: only folders it wrote itself.

Like git and rsync, moe-upcycle never deletes a user's folder, whatever the flags. A folder is
*ours* when it carries our manifest, ``moe_upcycle.json`` with ``"tool": "moe-upcycle"`` (every
build writes one; the demo writes one at the top of its scratch folder). On top of that, a few
folders are never replaced even when they are ours: the current folder and its ancestors, and
any folder holding an input of the build (the recipe, a source model, a prompt or calibration
file).

`replace_problem` says why a folder may not be replaced (None when it may); `check_replaceable`
raises it. `prepare_demo_folder` empties only what a previous demo wrote. This module reads
folders; it deletes nothing except the demo's own sub-folders.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

from moe_upcycle.errors import OutputError

MANIFEST = "moe_upcycle.json"
DEMO_PARTS = ("dense", "moe")  # what `demo` writes inside its folder, besides the manifest
_SHOWN = 5  # names listed when a folder is refused


def _manifest(folder: Path) -> Optional[dict]:
    manifest = Path(folder) / MANIFEST
    try:
        if manifest.is_symlink() or not manifest.is_file() or manifest.stat().st_size > 64 * 2**20:
            return None
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == "moe-upcycle" else None


def is_ours(folder: Path) -> bool:
    """Whether `folder` carries our manifest (a JSON object with ``"tool": "moe-upcycle"``)."""
    return _manifest(folder) is not None


def is_demo(folder: Path) -> bool:
    """Whether `folder` is a previous demo's (our manifest with ``"kind": "demo"``), not a build's."""
    data = _manifest(folder)
    return data is not None and data.get("kind") == "demo"


def describe_contents(folder: Path) -> str:
    """A short listing such as ``notes.txt, src/ and 3 more`` for messages."""
    try:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        return f"(unreadable: {exc.strerror or exc})"
    names = [p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in entries[:_SHOWN]]
    more = len(entries) - _SHOWN
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def protected_reason(target: Path, inputs: Sequence[Path] = ()) -> Optional[str]:
    """Why `target` must never be removed or replaced (None when nothing forbids it).

    Args:
        target: the folder the tool would replace.
        inputs: files and folders the command reads (recipe, source models, prompt files).
    """
    target = Path(target).resolve()
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current folder was deleted under us
        cwd = None
    if cwd is not None and (target == cwd or target in cwd.parents):
        what = "the current folder" if target == cwd else f"an ancestor of the current folder {cwd}"
        return f"{target} is {what}"
    if target == Path(target.anchor) or target == Path.home().resolve():
        return f"{target} is {'the filesystem root' if target == Path(target.anchor) else 'your home folder'}"
    for item in inputs:
        item = Path(item).expanduser().resolve()
        if target == item or target in item.parents:
            return f"{target} holds {item}, an input of this command"
    return None


def replace_problem(target: Path, inputs: Sequence[Path] = ()) -> Optional[str]:
    """Why ``--force`` may not replace the existing, non-empty folder `target` (None: it may).

    Raises nothing: the caller words the error.
    """
    target = Path(target).resolve()
    reason = protected_reason(target, inputs)
    if reason:
        return (f"--force never replaces {reason}; write the model to a new folder, e.g. "
                f"{target / 'moe-model'}")
    if not is_ours(target):
        return (f"output folder {target} was not written by moe-upcycle (it has no {MANIFEST}) and holds "
                f"{describe_contents(target)}; --force only replaces a previous moe-upcycle output. Choose "
                f"another folder, or move these files away yourself")
    return None


def check_replaceable(target: Path, inputs: Sequence[Path] = ()) -> None:
    """Raise `OutputError` unless `target` is missing, empty, or a folder we may replace.

    Raises:
        OutputError: see `replace_problem`.
    """
    target = Path(target)
    if not target.is_dir() or not any(target.iterdir()):
        return
    problem = replace_problem(target, inputs)
    if problem:
        raise OutputError(problem)


def prepare_demo_folder(folder: Path) -> Path:
    """Make `folder` ready for the demo without removing anything the demo did not write.

    A missing or empty folder is used as it is. A folder holding our manifest (a previous demo's)
    has only the demo's own parts (``dense/``, ``moe/``) removed. Anything else is refused.

    Returns:
        The folder, resolved.

    Raises:
        OutputError: the folder is a file, or holds files the demo did not write.
    """
    folder = Path(folder).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"demo folder {folder} is a file; give a new or empty folder")
    if folder.is_dir() and any(folder.iterdir()):
        if not is_demo(folder):  # a build's folder is ours too, but not the demo's to rewrite
            raise OutputError(f"demo folder {folder} is not empty (it holds {describe_contents(folder)}) and was not "
                              f"made by moe-upcycle demo; the demo only writes into a new or empty folder, e.g. "
                              f"moe-upcycle demo demo_out")
        for part in DEMO_PARTS:
            path = folder / part
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"tool": "moe-upcycle", "kind": "demo",
                                               "parts": list(DEMO_PARTS)}, indent=2) + "\n", encoding="utf-8")
    return folder


def input_paths(config_source: object, config: object, sources: Sequence[Path]) -> list[Path]:
    """The local files and folders a build reads: the recipe file, sources, prompt and calibration files."""
    paths: list[Path] = [Path(p) for p in sources]
    if isinstance(config_source, (str, os.PathLike)):
        paths.append(Path(config_source))
    for value in [getattr(config, "calibration_text", None)] + [
            getattr(e, f"{kind}_prompts_from", None)
            for e in list(getattr(config, "experts", [])) + list(getattr(config, "shared_experts", []))
            for kind in ("positive", "negative")]:
        if isinstance(value, str) and Path(value).expanduser().exists():
            paths.append(Path(value))
    return paths
