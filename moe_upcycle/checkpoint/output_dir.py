"""Atomic output folders: stage beside the target, rename into place only when complete.

`staged_output(target, force)` yields a temporary folder ``.<name>.partial-<pid>`` next to the
target. On success it is renamed to the target (with `force`, an existing target is swapped out
and removed only after the new one is in place). On any error, Ctrl-C, SIGTERM or SIGHUP the staging
folder is deleted (a second signal meanwhile does not cut that short), so nothing half-written ever carries
the target's name. A lock file
``.<name>.lock`` (an flock, released by the kernel if the process dies) refuses a second
concurrent build to the same target; leftovers of a killed build are cleared by the next one.
A name near the 255-byte limit is shortened in these helper names (`_stem`). POSIX only (fcntl).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shlex
import stat
from pathlib import Path
from typing import Iterator, Optional, Sequence

from moe_upcycle.checkpoint.disk_space import available
from moe_upcycle.checkpoint.manifest_file import MANIFEST as RECIPE_NAME  # noqa: F401 (our manifest's name)
from moe_upcycle.checkpoint.ownership import (cannot_remove, is_ours, protected_reason, remove_ours,
                                              replace_problem, warn_once)
from moe_upcycle.errors import OutputError, reraise_if_out_of_memory
from moe_upcycle.inputs.paths import unloadable_name, user_name
from moe_upcycle.terminal.signals import signals_held, terminations_raise

MAX_STEM_BYTES = 200  # of the target's name in the helper names beside it (filesystems allow 255)


def check_target(target: Path, force: bool, sources: Sequence[Path] = (), inputs: Sequence[Path] = ()) -> None:
    """Refuse targets that would lose data, before any work is done.

    Args:
        inputs: other files the build reads (recipe, prompt files): no folder holding one is replaced.

    A killed build's leftovers beside the target are cleared first (`_recover`), under the lock.

    Raises:
        OutputError: another build is writing the target, or `target_problem` names a problem.
    """
    target = target.resolve()
    overlap = _source_overlap(target, sources)
    if overlap:  # before the lock: nothing is created inside or beside a source folder
        raise OutputError(overlap)
    if target.parent.is_dir():
        # a killed build's leftovers first: a previous output it was swapping out is put back now, so
        # the checks below see it (not the final rename, after all the work); refused while another build runs
        lock, fd = _take_lock(target)
        try:
            restored = _recover(target)
        finally:
            _release_lock(lock, fd)
    else:
        restored = None
    problem = target_problem(target, force, sources, inputs, restored=restored)
    if problem:
        raise OutputError(problem)
    if force and target.is_dir() and any(target.iterdir()):
        _REPLACING.append(target)  # a previous output, replaced only at the very end (`previous_kept`)


def target_problem(target: Path, force: bool, sources: Sequence[Path] = (), inputs: Sequence[Path] = (),
                   restored: Optional[Path] = None, full: bool = True) -> Optional[str]:
    """Why a build would refuse `target`, or ``None``; it only reads, so ``plan`` asks it too.

    Problems: the target is inside / equal to / a parent of a source model folder, is a file, or is
    protected (the current folder, a folder holding an input: `ownership`); with `full`, it is a
    non-empty folder (without `force`), or one that is not a previous moe-upcycle output holding
    only its own, unchanged files (with `force`; this hashes them), or its parent is missing.

    Args:
        restored: a previous output `_recover` put back, named in the message.
        full: ``plan`` asks without it: it has no ``--force`` to judge an existing folder by, and
            the build makes missing parent folders.
    """
    target = target.resolve()
    overlap = _source_overlap(target, sources)
    if overlap:
        return overlap
    unloadable = unloadable_name(target)
    if unloadable:
        return f"output {unloadable}"
    if target.exists() and not target.is_dir():
        return f"output {target} exists and is a file; choose another output path"
    variable = _foreign_path(target)
    if variable:
        return variable
    reason = protected_reason(target, [*sources, *inputs]) if target.exists() else None
    if reason:
        return (f"output: {reason}; it is never replaced, with or without --force. Write the model to "
                f"a new folder, e.g. {target / 'moe-model'}")
    if target.parent.is_dir() and not os.access(target.parent, os.W_OK | os.X_OK):  # plan says it too, not "fits"
        return (f"the output's folder {target.parent} is not writable by you (the build writes beside {target.name} "
                f"and renames it into place); choose another output folder")
    if not full:
        return _file_in_the_way(target)
    if target.is_dir() and any(target.iterdir()):
        if not force:
            put_back = (f" (it is the previous output, put back from {restored.name}, where a build killed while "
                        f"replacing it had left it)" if restored else "")
            return (f"output folder {target} already exists and is not empty{put_back}; "
                    f"choose another folder or pass --force to replace it")
        problem = replace_problem(target, [*sources, *inputs])
        if problem:
            return problem
    if target.is_dir() and os.path.ismount(target):
        return (f"output folder {target} is a mount point; a build is put in place by renaming a finished folder "
                f"beside it, which cannot replace a mount point — write into a folder inside it, e.g. "
                f"{target / 'moe-model'}")
    stuck = cannot_remove(target) if target.is_dir() else None
    if stuck:  # the finished build replaces the folder: said now, not after all the work
        return (f"output folder {target} is replaced by the finished build, but {stuck}; choose another output "
                f"folder, or ask its owner to remove it")
    if not target.parent.is_dir():
        return f"the parent folder of the output, {target.parent}, does not exist; create it first"
    return None


def _file_in_the_way(target: Path) -> Optional[str]:
    parent = Path(os.path.expanduser(target)).resolve().parent
    blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
    if blocking is None:
        return None
    return (f"output {target}: {blocking} is a file, not a folder, so the output cannot go under it; "
            f"choose another output path")


def _source_overlap(target: Path, sources: Sequence[Path]) -> Optional[str]:
    for src in sources:
        src = src.resolve()
        if target == src or src in target.parents or target in src.parents:
            return (f"output {target} overlaps the source model folder {src}; "
                    f"choose an output folder outside every source")
    return None


@contextlib.contextmanager
def made_parent(target: Path) -> Iterator[None]:
    """Create the output's missing parent folders (``out/`` of ``out/my-moe``), like ``mkdir -p``; if the block
    fails (bad input found later, an error, Ctrl-C), remove again those it created that are still empty.

    Raises:
        OutputError: a parent cannot be created (a file is in the way, no permission).
    """
    resolved = Path(os.path.expanduser(target)).resolve()
    parent = resolved.parent
    blocking = _foreign_path(resolved) or _file_in_the_way(target)
    if blocking:  # mkdir would only say "File exists" or "Not a directory"
        raise OutputError(blocking)
    missing = [p for p in (parent, *parent.parents) if not p.exists()][::-1]  # outermost first
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_empty(missing)
        raise OutputError(f"cannot create the parent folder of the output, {parent}: {exc.strerror or exc}; "
                          f"create it or choose another output path") from None
    try:
        yield
    except BaseException:
        _remove_empty(missing)
        raise


def name_too_long(target: Path, what: str = "output") -> Optional[str]:
    """Why the file system cannot hold `target` (resolved) at all: a name longer than its NAME_MAX (255 bytes on
    most), or a path longer than its PATH_MAX; None when it can. Every later call on such a path would fail with
    "File name too long"."""
    existing = next((p for p in [target, *target.parents] if _exists(p)), Path("/"))
    limits = []
    for key, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            limits.append(os.pathconf(existing if existing.is_dir() else existing.parent, key))
        except (OSError, ValueError):
            limits.append(default)
    name_max, path_max = limits
    long = next((part for part in target.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        shown = long if len(long) <= 60 else long[:57] + "..."
        return (f"{what}: the name {shown!r} is {len(os.fsencode(long))} bytes, and this file system allows "
                f"{name_max} per name; choose a shorter name")
    if len(os.fsencode(str(target))) >= path_max:
        return (f"{what}: the path is {len(os.fsencode(str(target)))} bytes, and this file system allows {path_max}; "
                f"choose a shorter path")
    return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long to even look up
        return False


def _foreign_path(target: Path) -> Optional[str]:
    """Why `target` (resolved) was written for another shell or system, or None: a folder it would make is named
    after an environment variable (``output: $HOME/moe``: a folder named ``$HOME`` here) or is part of a Windows
    path (``D:\\models\\moe``, ``C:/Users/me/moe``: a folder named ``D:\\models\\moe`` or ``C:``). A folder of such
    a name that exists already is the user's."""
    from moe_upcycle.terminal.hints import odd_new_folder, variable_hint, windows_path_hint

    to_make = [part for part in [target, *target.parents] if not _exists(part)]
    written = os.path.relpath(target)
    odd = odd_new_folder(target)  # pasted characters, spaces at an end, the ~ of no user
    if odd:
        return f"output {written!r}: {odd}; nothing is made (a folder that exists already is used as it is)"
    odd = next((part for part in to_make if variable_hint(part.name)), None)
    hint = variable_hint(written) if odd is not None else ""
    if odd is None:
        odd = next((part for part in to_make if re.fullmatch(r"[A-Za-z]:", part.name) or "\\" in part.name), None)
        hint = windows_path_hint(written) if odd is not None else ""
    if odd is None:
        return None
    return (f"output {written}: {hint}; here it would make a folder named {odd.name} in the current folder, so "
            f"nothing is made")


def _remove_empty(folders: list[Path]) -> None:
    """rmdir `folders` innermost first, each only while empty (anything put there since is not ours to remove)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `signals.Terminated` (a KeyboardInterrupt), so cleanup runs."""
    with terminations_raise():
        yield


@contextlib.contextmanager
def staged_output(target: Path, force: bool = False) -> Iterator[Path]:
    """Yield a staging folder that becomes `target` when the block finishes without error.

    An `OSError` inside the block (disk full, permission denied...) becomes an `OutputError`
    naming the file; the staging folder is removed whatever happened.

    Raises:
        OutputError: another build holds the lock for this target, or a file operation failed.
    """
    target = Path(target).resolve()
    lock, fd = _take_lock(target)
    stage = target.parent / f".{_stem(target)}.partial-{os.getpid()}"
    failed = True
    try:
        _recover(target)
        stage.mkdir()
        with _sigterm_raises():
            yield stage
            _publish(stage, target, force)
        failed = False
    except OSError as exc:
        reraise_if_out_of_memory(exc)  # the machine's memory, not the output: the command says so (cli.out_of_memory)
        raise OutputError(f"{exc.filename or stage}: {exc.strerror or exc}; nothing was written under "
                          f"{target}" + _space_hint(exc, target)) from None
    finally:
        # a second signal must not cut the clean-up short (under torchrun a Ctrl-C arrives twice: from the terminal,
        # then forwarded by torchrun); after a failure it is dropped, the build is stopping already
        with signals_held(drop=failed):
            remove_ours(stage)
            _release_lock(lock, fd)


def _stem(target: Path) -> str:
    """The target's name as used in the names of its lock, staging and swap folders beside it.

    Those add up to 20 bytes to the name (``.<name>.partial-<pid>``), so a name near the
    filesystem's 255-byte limit is shortened: its start and a digest of the whole, still unique.
    """
    name = target.name
    if len(name.encode("utf-8", "surrogateescape")) <= MAX_STEM_BYTES:
        return name
    head = name.encode("utf-8", "surrogateescape")[:MAX_STEM_BYTES - 17].decode("utf-8", "ignore")
    return f"{head}~{hashlib.sha256(name.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}"


def _take_lock(target: Path) -> tuple[Path, int]:
    """Hold an exclusive ``flock`` on ``.<name>.lock`` (which records our pid).

    The kernel drops the lock when its process dies, so a lock file left by a killed build
    never blocks the next one.

    Returns:
        The lock path and the open descriptor that holds the lock.
    """
    lock = _lock_path(target)
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as exc:
            raise OutputError(_lock_problem(lock, exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OutputError(f"another build{_lock_owner(lock)} is writing {target} (it holds {lock}); "
                              f"wait for it to finish or stop it") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file as we opened it: lock the new one
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return lock, fd


def _lock_problem(lock: Path, exc: OSError) -> str:
    """Why the lock file could not be opened: another user's left in the way, or a folder this user may not write
    into or enter."""
    try:
        st = os.lstat(lock)
    except OSError:
        st = None
    if st is not None and st.st_uid != os.geteuid():
        return (f"the lock file {lock} belongs to {user_name(st.st_uid)} (their build of the same output, or its "
                f"leftover); ask them to remove it, or choose another output folder")
    return (f"cannot create the lock file {lock} ({exc.strerror or exc}); the folder {lock.parent} must be writable "
            f"and searchable by you (ls -ld {shlex.quote(str(lock.parent))}), or choose another output folder")


def _release_lock(lock: Path, fd: int) -> None:
    lock.unlink(missing_ok=True)  # unlink before unlocking, so no one locks a file that is going away
    os.close(fd)


def build_running(target: Path) -> Optional[str]:
    """Say so when a live process holds the build lock of `target` (its ``.<name>.lock`` records the pid), else None.

    For readers of an output (``verify``): a ``build --force`` into it swaps the folder when it finishes. Reads the
    lock file only, never locks it, so a build starting at that moment is not refused because of the reader.
    """
    lock = _lock_path(Path(target))
    pid = _lock_pid(lock)
    if pid is None or pid == os.getpid():
        return None
    held = _flock_held(lock)
    if held is None:  # no /proc/locks: a live pid is the best sign (a reused pid may say so wrongly)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # a killed build's lock file: no one is writing
            return None
        except PermissionError:  # alive, another user's
            pass
    elif not held:  # a killed build's lock file: the kernel dropped its lock, whatever process has its pid now
        return None
    return f"a build into {target} is running (pid {pid}, it holds {lock})"


def _flock_held(lock: Path) -> Optional[bool]:
    """Whether some process holds a flock on `lock`, from Linux's /proc/locks (no lock is taken to find out, so a
    build starting now is never refused for it); None where /proc/locks cannot be read."""
    try:
        inode = os.stat(lock).st_ino
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234567 0 EOF": the file is major:minor:inode
    return any(len(f) > 5 and f[1] == "FLOCK" and f[5].rsplit(":", 1)[-1] == str(inode)
               for f in (line.split() for line in table.splitlines()))


def folder_identity(folder: Path) -> Optional[tuple[int, int]]:
    """(device, inode) of `folder`, or None when it is gone: a build --force puts a new folder in its place."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _lock_path(target: Path) -> Path:
    return target.parent / f".{_stem(target)}.lock"


def _lock_pid(lock: Path) -> Optional[int]:
    """The pid a build wrote into its lock file, or None (no file, or not a number)."""
    try:
        return int(lock.read_text().strip())
    except (OSError, ValueError):
        return None


def _lock_owner(lock: Path) -> str:
    pid = _lock_pid(lock)
    return f" (pid {pid})" if pid is not None else ""


def _recover(target: Path) -> Optional[Path]:
    """With the lock held, clear what a killed build left beside the target.

    Partial folders are deleted. A build killed in the middle of a --force swap (SIGKILL; other
    signals are held off during it) leaves the previous target as ``.<name>.old-<pid>``: it is
    moved back if the target is missing, else deleted. Only folders named exactly so (a pid, digits)
    are touched, and an ``.old-`` one only when it holds a build's manifest (what --force replaces)
    or nothing: a user's ``.<name>.old-backup`` is never ours. What cannot be moved or deleted (a folder
    of another user's killed build) is left and named in a warning, once.

    Returns:
        The swap folder that was moved back to the target, if one was.
    """
    restored = None
    for leftover in _leftovers(target, "partial"):
        remove_ours(leftover)
    for old in _leftovers(target, "old"):
        if not _build_or_empty(old):
            continue  # not a build: not ours to move or delete
        if not target.exists():
            try:
                os.rename(old, target)
                restored = old
            except OSError as exc:
                warn_once(old, f"{old}: a killed build's previous output, which could not be moved back to "
                                f"{target} ({exc.strerror or exc}); move it yourself")
        else:
            remove_ours(old)
    return restored


def _leftovers(target: Path, kind: str) -> list[Path]:
    """Folders ``.<name>.<kind>-<pid>`` beside the target (not links, not files)."""
    pattern = re.compile(rf"\.{re.escape(_stem(target))}\.{kind}-[0-9]+")
    try:
        names = sorted(os.listdir(target.parent))
    except OSError:
        return []
    return [target.parent / n for n in names if pattern.fullmatch(n) and (target.parent / n).is_dir()
            and not (target.parent / n).is_symlink()]


def _build_or_empty(folder: Path) -> bool:
    try:
        return is_ours(folder) or not any(folder.iterdir())
    except OSError:  # cannot be looked into: not known to be ours
        return False


def _space_hint(exc: OSError, target: Path) -> str:
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ""
    try:
        return f" ({available(target)} in {target.parent})"
    except OSError:
        return ""


def published() -> Optional[Path]:
    """The output this process last put in place (None before any): a signal held off during `_publish` is raised
    after it, and the interrupt message must not then say nothing was written."""
    return _PUBLISHED[-1] if _PUBLISHED else None


def previous_kept() -> Optional[Path]:
    """The previous output a ``--force`` build of this process was to replace and has not (None when there was
    none, or it was replaced): after an interrupt or an error it is exactly as it was, since it is only swapped out,
    signals held, in the final rename."""
    if _REPLACING and _REPLACING[-1] not in _PUBLISHED and _REPLACING[-1].is_dir():
        return _REPLACING[-1]
    return None


def forget_published() -> None:
    """Start a command with no output put in place yet (commands run in one process under tests)."""
    _PUBLISHED.clear()
    _REPLACING.clear()


_PUBLISHED: list[Path] = []
_REPLACING: list[Path] = []


def _publish(stage: Path, target: Path, force: bool) -> None:
    with signals_held():
        if not target.exists():
            os.rename(stage, target)
            _PUBLISHED.append(target)
            return
        if not force and any(target.iterdir()):
            raise OutputError(f"output folder {target} appeared during the build; nothing was replaced")
        problem = replace_problem(target) if any(target.iterdir()) else None
        if problem:  # checked again here: the folder may have changed since the build started
            raise OutputError(problem + "; nothing was replaced")
        if not any(target.iterdir()):  # a folder the user made for it: its permissions stay (group-shared, private)
            with contextlib.suppress(OSError):
                os.chmod(stage, stat.S_IMODE(os.stat(target).st_mode))
        old = target.parent / f".{_stem(target)}.old-{os.getpid()}"
        os.rename(target, old)
        try:
            os.rename(stage, target)
        except OSError:
            os.rename(old, target)  # put the previous contents back
            raise
        _PUBLISHED.append(target)
        remove_ours(old)
