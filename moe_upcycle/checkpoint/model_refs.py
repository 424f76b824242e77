"""Model references: a folder, or a hub id in the local Hugging Face cache (nothing is downloaded).

A hub id is ``org/name`` in any case (as on the hub) or mergekit's ``org/name@revision``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Optional

from moe_upcycle.checkpoint.quantized import file_given_hint
from moe_upcycle.errors import SourceError, UpcycleWarning
from moe_upcycle.inputs.paths import resolve_or_raise


def resolve_model(ref: str, field_name: str) -> Path:
    """Resolve a model reference to a local folder.

    Args:
        ref: a folder path, or a hub id (``org/name``, or mergekit's ``org/name@revision``) present
            in the local Hugging Face cache.
        field_name: the YAML field that named it, for messages.

    Raises:
        SourceError: neither a folder nor a cached hub id; says where it looked.
    """
    path = Path(os.path.expanduser(ref))
    if path.is_dir():
        return path.resolve()
    if path.is_file():  # e.g. the model.safetensors itself, a GGUF, an adapter's file: not a hub id either
        hint = file_given_hint(path)
        if hint:
            raise SourceError(f"{field_name}: model {ref!r} {hint}")
        raise SourceError(f"{field_name}: model {ref!r} is a file, not a model folder; give the folder that holds "
                          f"its config.json and weights ({resolve_or_raise(path, SourceError, field_name).parent})")
    looked = [str(resolve_or_raise(path, SourceError, f"{field_name}: model {ref!r}"))]
    folder, _, revision = ref.rpartition("@")
    local = Path(os.path.expanduser(folder))
    if folder and "@" not in folder and local.is_dir():
        # mergekit reads `path@revision` (and {path:, revision:}) from an existing folder as it is, revision ignored
        warnings.warn(f"{field_name}: {ref!r} is the folder {folder}; a folder has no revisions, so "
                      f"@{revision} is ignored (as mergekit does)", UpcycleWarning, stacklevel=2)
        return local.resolve()
    # mergekit's `org/model@revision` (a branch, tag or commit) is looked up in the cache at that revision
    repo, _, revision = ref.partition("@") if ref.count("@") == 1 else (ref, "", "")
    repo = repo[:-1] if repo.endswith("/") and repo.count("/") == 2 else repo  # org/name/ (a folder's spelling)
    if "/" in repo and not repo.startswith((".", "/", "~")) and repo.count("/") == 1:
        from huggingface_hub import constants, snapshot_download

        # hub ids are case-insensitive (`Mistralai/...` is mistralai's repo), cache folders are not
        for name in [repo] + _cached_spellings(Path(constants.HF_HUB_CACHE), repo):
            try:
                return Path(snapshot_download(name, revision=revision or None, local_files_only=True))
            except Exception:
                pass
        at = f" at revision {revision!r}" if revision else ""
        closed = _cache_denied(Path(constants.HF_HUB_CACHE), repo)
        if closed:  # there, perhaps, but this user may not look: not "download it"
            raise SourceError(f"{field_name}: model {ref!r}: the Hugging Face cache's {closed} cannot be read by you "
                              f"(permission denied), so the model cannot be looked up there; fix its permissions "
                              f"(ls -ld {closed}), or point HF_HUB_CACHE at a cache you may read")
        looked.append(f"the Hugging Face cache {constants.HF_HUB_CACHE}{at}")
        held = _cached_snapshots(Path(constants.HF_HUB_CACHE), repo)
        if held and not revision:  # downloaded at a commit (hf download --revision <commit>): no refs/main to follow
            shown = ", ".join(f"{repo}@{h}" for h in held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise SourceError(f"{field_name}: model {ref!r} not found at its main revision (looked in "
                              f"{' and '.join(looked)}): the cache holds it only at other revisions, downloaded by "
                              f"commit; name one, as transformers would need: {shown}")
    from moe_upcycle.terminal.hints import missing_model_hint, show_ref

    raise SourceError(f"{field_name}: model {show_ref(ref)} not found (looked in {' and '.join(looked)}); "
                      f"{missing_model_hint(ref)}")


def _cache_denied(cache: Path, repo: str) -> Optional[Path]:
    """The first of the cache's folders and files on the way to `repo`'s snapshots that this user may not read (or
    enter), or None."""
    entry = cache / f"models--{repo.replace('/', '--')}"
    for path in (cache, entry, entry / "refs", entry / "refs" / "main", entry / "snapshots"):
        if not os.path.lexists(path):
            continue
        need = os.R_OK | os.X_OK if os.path.isdir(path) else os.R_OK
        if not os.access(path, need):
            return path
    return None


def _cached_snapshots(cache: Path, repo: str) -> list[str]:
    """The commits of `repo` (any case) whose snapshot in the cache holds a config.json, newest first."""
    want = f"models--{repo.replace('/', '--')}".lower()
    try:
        folders = [d for d in cache.iterdir() if d.name.lower() == want]
        snaps = [s for d in folders for s in (d / "snapshots").iterdir() if (s / "config.json").is_file()]
    except OSError:
        return []
    return [s.name for s in sorted(snaps, key=lambda s: s.stat().st_mtime, reverse=True)]


def _cached_spellings(cache: Path, repo: str) -> list[str]:
    """Hub ids in the cache that differ from `repo` only in case (the hub treats them as one repo)."""
    want = f"models--{repo.replace('/', '--')}".lower()
    try:
        return [d.name[len("models--"):].replace("--", "/", 1) for d in cache.iterdir()
                if d.name.lower() == want and d.name != f"models--{repo.replace('/', '--')}"]
    except OSError:
        return []


def repo_and_revision(ref: str) -> tuple[str, ...]:
    """``org/name@rev`` as the arguments of a download command: ("org/name", "--revision", "rev")."""
    repo, _, revision = ref.partition("@") if ref.count("@") == 1 else (ref, "", "")
    return (repo, "--revision", revision) if revision else (repo,)
