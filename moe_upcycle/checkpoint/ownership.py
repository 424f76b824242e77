"""What the tool may remove or replace: only folders it wrote itself.

Like git and rsync, moe-upcycle never deletes a user's folder, whatever the flags. A folder is
*ours* when it carries our manifest, ``moe_upcycle.json`` with ``"tool": "moe-upcycle"`` (every
build writes one; the demo writes one at the top of its scratch folder). ``--force`` replaces such
a folder only while it holds nothing but what that build wrote: a file the manifest does not list
(``notes.txt``, a ``checkpoint-500/`` folder, a ``.git``) or a listed file changed since the build
(a fine-tuned model saved over it) is the user's, so the folder is refused (`foreign_entries`).
On top of that, a few folders are never replaced even when they are ours: the current folder and
its ancestors, and any folder holding an input of the build (the recipe, a source model, a prompt
or calibration file).

`replace_problem` says why a folder may not be replaced (None when it may; `output_dir` raises
it). `prepare_demo_folder` empties only what a previous demo wrote (and refuses when its
``dense/`` or ``moe/`` also holds something else). This module reads folders; it deletes nothing except the demo's own sub-folders.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import warnings
from pathlib import Path
from typing import Optional, Sequence

from moe_upcycle.checkpoint.names import CHAT_TEMPLATE_DIR
from moe_upcycle.checkpoint.manifest_file import MANIFEST, load_manifest
from moe_upcycle.errors import OutputError, SourceError, UpcycleWarning
from moe_upcycle.inputs.paths import resolve_or_raise, unloadable_name, user_name

INDEX = "model.safetensors.index.json"  # names the shards, which `--no-checksums` leaves out of the manifest
DEMO_PARTS = ("dense", "moe")  # what `demo` writes inside its folder, besides the manifest
# what `tiny.make_dense_model` writes into the demo's dense/ (transformers 4 adds special_tokens_map.json), for a
# demo manifest from before `record_demo_dense` listed them
DEMO_DENSE_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                              "tokenizer_config.json", "special_tokens_map.json"})
_SHOWN = 5  # names listed when a folder is refused


def _manifest(folder: Path) -> Optional[dict]:
    """Our manifest in `folder`, or None: none there, a link (not a file a build wrote), damaged, or another tool's."""
    if (Path(folder) / MANIFEST).is_symlink():
        return None
    try:
        data = load_manifest(folder)
    except SourceError:
        return None
    return data if data is not None and data.get("tool") == "moe-upcycle" else None


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
        item = Path(os.path.expanduser(item)).resolve()
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
        manifest = target / MANIFEST
        why = (f"it has no {MANIFEST}" if not (manifest.exists() or manifest.is_symlink())
               else f"its {MANIFEST} is not a manifest a moe-upcycle build wrote")
        return (f"output folder {target} was not written by moe-upcycle ({why}) and holds "
                f"{describe_contents(target)}; --force only replaces a previous moe-upcycle output. Choose "
                f"another folder, or move these files away yourself")
    foreign = foreign_entries(target)
    if foreign:
        more = len(foreign) - _SHOWN
        shown = ", ".join(foreign[:_SHOWN]) + (f" and {more} more" if more > 0 else "")
        return (f"output folder {target} is a previous moe-upcycle output, but it also holds what that build did not "
                f"write: {shown}; --force replaces only a folder holding nothing but the build's own files. Move "
                f"these away, or choose another output folder")
    return None


def foreign_entries(folder: Path) -> list[str]:
    """What in our `folder` the build that wrote it did not write, or changed since (empty: all ours).

    An entry is foreign when its name is not in the manifest (the shards of a ``--no-checksums``
    build are known from the index), when it is a folder or a link (a build writes plain files
    only), or when it was written or moved since the manifest (its status change time, which no tool
    sets back, is not older) and its sha256 differs from the recorded one (only such files are hashed:
    a build writes the manifest last). Names are given as
    ``name/`` for folders and ``name (changed since the build)`` for edited files.
    """
    folder = Path(folder)
    manifest = _manifest(folder) or {}
    digests = manifest.get("sha256", {})
    written = written_files(folder, digests)
    try:
        since = (folder / MANIFEST).stat().st_mtime_ns
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        return [f"(unreadable: {exc.strerror or exc})"]
    out = []
    for path in entries:
        if path.name == MANIFEST:
            continue
        if path.name == CHAT_TEMPLATE_DIR and path.is_dir() and not path.is_symlink():
            try:  # the one folder a build writes: ours when every entry in it is
                inside = sorted(path.iterdir(), key=lambda p: p.name)
            except OSError as exc:
                out.append(f"{path.name}/ (unreadable: {exc.strerror or exc})")
                continue
            out += _foreign(inside, folder, written, digests, since) if inside else [f"{path.name}/"]
            continue
        out += _foreign([path], folder, written, digests, since)
    return out


def _foreign(paths: list[Path], folder: Path, written: set, digests: dict, since: int) -> list[str]:
    out = []
    for path in paths:
        name = path.relative_to(folder).as_posix()
        if path.is_symlink() or not path.is_file():
            out.append(name + ("/" if path.is_dir() and not path.is_symlink() else ""))
        elif name not in written:
            out.append(name)
        elif name in digests and _touched_since(path, since) and (digest := _sha256(path)) != digests[name]:
            out.append(f"{name} ({'changed since the build' if digest else 'unreadable: cannot be checked'})")
    return out


def _touched_since(path: Path, since: int) -> bool:
    """Whether `path` may have been written or replaced since the manifest (time `since`): its status change
    time is not older. Tools set a file's modification time at will (``cp -p``, ``rsync -a``, ``tar x``,
    ``touch -d``), never its status change time, which writing, replacing or moving the file sets to the
    present; and a timestamp may be coarser than the time between a build's last file and its manifest."""
    st = path.stat()
    return st.st_ctime_ns >= since or st.st_mtime_ns >= since


def written_files(folder: Path, digests: dict, links: bool = False) -> set[str]:
    """The files a build wrote into `folder`: those its manifest hashed (`digests`), and the shards its own index
    lists (a build with ``checksums: false`` hashes no shard).

    Args:
        links: read an index that is a link (a Hub download's snapshot links every file to its blob) when its
            bytes are the build's; for reading only (``verify``), never for what ``--force`` may replace.
    """
    return set(digests) | _index_shards(folder, digests, links)


def _index_shards(folder: Path, digests: dict, links: bool = False) -> set[str]:
    """The shard names of our index, when the index itself is as the build wrote it."""
    index = folder / INDEX
    if (INDEX not in digests or not index.is_file() or (index.is_symlink() and not links)
            or _sha256(index) != digests[INDEX]):
        return set()
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    except (OSError, ValueError, RecursionError, AttributeError):
        return set()
    return {f for f in weight_map.values() if isinstance(f, str)} if isinstance(weight_map, dict) else set()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(2**24), b""):
                h.update(chunk)
    except OSError:
        return ""
    return h.hexdigest()


def remove_ours(folder: Path) -> None:
    """Delete a folder this tool wrote (its staging folder, a killed build's leftovers, the previous
    build a --force swap replaced), also where folders in it were made read-only since: as ``rm -rf``
    does, write permission is given back to each folder inside first (it is ours to delete, and
    unlinking a file needs its folder's write permission). Symbolic links are removed, never
    followed. Whatever still cannot be removed is named in a warning, never left behind silently.
    """
    if not os.path.lexists(folder):
        return
    if folder.is_dir() and not folder.is_symlink():
        _owner_writable(str(folder))
        for root, dirs, _ in os.walk(folder):  # top-down: each folder is opened up before it is listed
            for name in dirs:
                if not os.path.islink(os.path.join(root, name)):
                    _owner_writable(os.path.join(root, name))
    shutil.rmtree(folder, ignore_errors=True)
    if os.path.lexists(folder):
        warn_once(folder, f"{folder}: could not delete this folder, which moe-upcycle wrote (a staging folder or "
                           f"the build --force replaced); delete it yourself")


def _owner_writable(path: str) -> None:
    try:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if mode & stat.S_IRWXU != stat.S_IRWXU:
            os.chmod(path, mode | stat.S_IRWXU)
    except OSError:
        pass


_WARNED: set = set()  # leftovers already named in this process (check_target and staged_output both recover)


def warn_once(path: Path, message: str) -> None:
    """An `UpcycleWarning` about `path`, the first time only."""
    if path not in _WARNED:
        _WARNED.add(path)
        warnings.warn(message, UpcycleWarning, stacklevel=3)


def cannot_remove(folder: Path) -> Optional[str]:
    """Why this process could not delete `folder` and everything in it (None: it can), for a message said before
    any work, so that a --force build or a demo re-run never stops half way with a user's folder gone or hidden.

    A folder of ours (the same user) can always be opened up (`remove_ours` does); another user's must be
    writable; and in a folder with the sticky bit (/tmp) only a file's owner may move or delete it.
    """
    me = os.geteuid()
    if me == 0:
        return None
    folder = Path(folder)
    try:
        parent, top = os.stat(folder.parent), os.lstat(folder)
    except OSError as exc:
        return f"{exc.filename} cannot be looked up ({exc.strerror or exc})"
    if not os.access(folder.parent, os.W_OK | os.X_OK):
        return f"its folder {folder.parent} is not writable by you"
    if parent.st_mode & stat.S_ISVTX and me not in (top.st_uid, parent.st_uid):
        return (f"it belongs to {user_name(top.st_uid)}, and {folder.parent} lets only an entry's owner move or delete it "
                f"(the sticky bit, as in /tmp)")
    pending = [str(folder)] if stat.S_ISDIR(top.st_mode) else []
    while pending:
        path = pending.pop()
        try:
            st = os.lstat(path)
        except OSError:  # gone meanwhile
            continue
        if st.st_uid != me and not os.access(path, os.W_OK | os.X_OK):
            return f"{path} belongs to {user_name(st.st_uid)} and is not writable by you"
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue  # ours, closed: remove_ours opens it up first (another user's was refused above)
        pending += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    return None


def prepare_demo_folder(folder: Path) -> Path:
    """Make `folder` ready for the demo without removing anything the demo did not write.

    A missing or empty folder is used as it is. A folder holding our manifest (a previous demo's)
    has only the demo's own parts (``dense/``, ``moe/``) removed. Anything else is refused.

    Returns:
        The folder, resolved.

    Raises:
        OutputError: the folder is a file, or holds files the demo did not write.
    """
    folder = resolve_or_raise(Path(os.path.expanduser(folder)), OutputError, "demo folder")
    unloadable = unloadable_name(folder)
    if unloadable:  # the demo loads what it writes
        raise OutputError(f"demo folder {unloadable}; nothing is made")
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"demo folder {folder} is a file; give a new or empty folder")
    from moe_upcycle.terminal.hints import odd_new_folder

    odd = odd_new_folder(folder)
    if odd:
        raise OutputError(f"demo folder {str(folder)!r}: {odd}; nothing is made")
    if folder.is_dir() and any(folder.iterdir()):
        if not is_demo(folder):  # a build's folder is ours too, but not the demo's to rewrite
            raise OutputError(f"demo folder {folder} is not empty (it holds {describe_contents(folder)}) and was not "
                              f"made by moe-upcycle demo; the demo only writes into a new or empty folder, e.g. "
                              f"moe-upcycle demo demo_out")
        kept = _demo_part_problems(folder)
        if kept:
            raise OutputError(f"demo folder {folder} is a previous demo's, but {'; '.join(kept)}; the demo rewrites "
                              f"its {' and '.join(p + '/' for p in DEMO_PARTS)} — move these away first")
        stuck = [f"{part}/: {why}" for part in DEMO_PARTS if (folder / part).is_dir()
                 and not (folder / part).is_symlink() and (why := cannot_remove(folder / part))]
        if stuck:  # checked before anything is removed: never half a previous demo
            raise OutputError(f"demo folder {folder} is a previous demo's, but the demo cannot remove its "
                              f"{'; '.join(stuck)}; delete it as its owner, or give a new folder, e.g. moe-upcycle "
                              f"demo demo_out")
        for part in DEMO_PARTS:
            path = folder / part
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                remove_ours(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).write_text(json.dumps({"tool": "moe-upcycle", "kind": "demo",
                                                   "parts": list(DEMO_PARTS)}, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise
        raise OutputError(f"demo folder {folder}: cannot write there ({exc.strerror or exc}); give a folder you may "
                          f"write to, e.g. moe-upcycle demo demo_out") from None
    return folder


def record_demo_dense(folder: Path) -> None:
    """Add the names of the files the demo wrote into ``dense/`` to its manifest (what a re-run may remove)."""
    manifest = _manifest(folder)
    if manifest is None or manifest.get("kind") != "demo":
        return
    manifest["dense_files"] = sorted(p.name for p in (Path(folder) / "dense").iterdir() if p.is_file())
    (Path(folder) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _demo_part_problems(folder: Path) -> list[str]:
    """What inside a previous demo's ``dense/`` and ``moe/`` the demo did not write."""
    out = []
    dense, moe = folder / "dense", folder / "moe"
    if dense.is_dir() and not dense.is_symlink():
        recorded = (_manifest(folder) or {}).get("dense_files")
        written = (set(recorded) if isinstance(recorded, list) and all(isinstance(n, str) for n in recorded)
                   else DEMO_DENSE_FILES)
        extra = sorted(p.name + ("/" if p.is_dir() else "") for p in dense.iterdir()
                       if p.name not in written or p.is_symlink() or not p.is_file())
        if extra:
            out.append(f"dense/ also holds {', '.join(extra[:_SHOWN])}")
    if moe.is_dir() and not moe.is_symlink() and any(moe.iterdir()):
        extra = foreign_entries(moe) if is_ours(moe) else [describe_contents(moe)]
        if extra:
            out.append(f"moe/ also holds {', '.join(extra[:_SHOWN])}")
    return out


def input_paths(config_source: object, config: object, sources: Sequence[Path]) -> list[Path]:
    """The local files and folders a build reads: the recipe file, sources, prompt and calibration files."""
    paths: list[Path] = [Path(p) for p in sources]
    if isinstance(config_source, (str, os.PathLike)):
        paths.append(Path(config_source))
    for value in [getattr(config, "calibration_text", None)] + [
            getattr(e, f"{kind}_prompts_from", None)
            for e in list(getattr(config, "experts", [])) + list(getattr(config, "shared_experts", []))
            for kind in ("positive", "negative")]:
        if isinstance(value, str) and Path(os.path.expanduser(value)).exists():
            paths.append(Path(value))
    return paths
