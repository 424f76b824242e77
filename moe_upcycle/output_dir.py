"""Atomic output folders: stage beside the target, rename into place only when complete.

`staged_output(target, force)` yields a temporary folder ``.<name>.partial-<pid>`` next to the
target. On success it is renamed to the target (with `force`, an existing target is swapped out
and removed only after the new one is in place). On any error, Ctrl-C or SIGTERM the staging
folder is deleted, so nothing half-written ever carries the target's name. A lock file
``.<name>.lock`` refuses a second concurrent build to the same target.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Iterator, Sequence

from .errors import OutputError


def check_target(target: Path, force: bool, sources: Sequence[Path] = ()) -> None:
    """Refuse targets that would lose data, before any work is done.

    Raises:
        OutputError: the target exists and is not empty (without `force`), is a file, or is
            inside / equal to / a parent of a source model folder.
    """
    target = target.resolve()
    for src in sources:
        src = src.resolve()
        if target == src or src in target.parents or target in src.parents:
            raise OutputError(f"output {target} overlaps the source model folder {src}; "
                              f"choose an output folder outside every source")
    if target.exists() and not target.is_dir():
        raise OutputError(f"output {target} exists and is a file; choose another output path")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise OutputError(f"output folder {target} already exists and is not empty; "
                          f"choose another folder or pass --force to replace it")
    if not target.parent.is_dir():
        raise OutputError(f"the parent folder of the output, {target.parent}, does not exist; create it first")


class _Terminated(BaseException):
    """SIGTERM turned into an exception so cleanup runs (like KeyboardInterrupt for SIGINT)."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    def handler(signum, frame):  # noqa: ARG001
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged_output(target: Path, force: bool = False) -> Iterator[Path]:
    """Yield a staging folder that becomes `target` when the block finishes without error.

    Raises:
        OutputError: another build holds the lock for this target.
    """
    target = Path(target).resolve()
    lock = target.parent / f".{target.name}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        raise OutputError(f"another build is writing {target} (lock file {lock} exists); wait for it, "
                          f"or delete the lock file if no build is running") from None
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    stage = target.parent / f".{target.name}.partial-{os.getpid()}"
    try:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
        with _sigterm_raises():
            try:
                yield stage
            except _Terminated:
                raise KeyboardInterrupt("terminated (SIGTERM)") from None
            _publish(stage, target, force)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        lock.unlink(missing_ok=True)


def _publish(stage: Path, target: Path, force: bool) -> None:
    if not target.exists():
        os.rename(stage, target)
        return
    if not force and any(target.iterdir()):
        raise OutputError(f"output folder {target} appeared during the build; nothing was replaced")
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    os.rename(target, old)
    try:
        os.rename(stage, target)
    except OSError:
        os.rename(old, target)  # put the previous contents back
        raise
    shutil.rmtree(old, ignore_errors=True)
