"""Disk space: bytes needed vs available, checked before writing and named in write errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from moe_upcycle.errors import OutputError


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(folder: Path) -> int:
    """Bytes available to this user on the filesystem that holds `folder` as an entry: its parent's (or the nearest
    existing folder above), where a build stages its output — a folder that is a mount point is another disk."""
    return shutil.disk_usage(_holder(folder)).free


def available(folder: Path) -> str:
    """``N bytes available`` where `folder` is (or would be) an entry, and when the file system has no inode left
    ("No space left on device" with bytes to spare), that it can hold no more files."""
    text = f"{free_bytes(folder)} bytes available"
    try:
        st = os.statvfs(_holder(folder))
    except OSError:
        return text
    return text + (", but no free inodes: the file system can hold no more files"
                   if st.f_files > 0 and st.f_favail == 0 else "")


def _holder(folder: Path) -> Path:
    """The folder holding `folder` (or the nearest existing one above it)."""
    probe = Path(folder).resolve().parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def check_free_space(target: Path, needed: int) -> None:
    """Refuse a build whose output cannot fit, before anything is written.

    The staging folder sits beside the target and an old target (``--force``) is removed only
    after the new one is in place, so the whole output must fit next to what is there now.

    Raises:
        OutputError: with bytes needed vs available.
    """
    free = free_bytes(target)
    if free < needed:
        raise OutputError(f"not enough disk space for the output in {Path(target).parent}: needs {needed} bytes "
                          f"({human_bytes(needed)}), {free} bytes ({human_bytes(free)}) available; "
                          f"free {human_bytes(needed - free)} or choose an output folder on another disk")


def disk_hint(folder: Path, needed: int, written: int) -> str:
    """`` (needs N bytes in all, W written, F available)`` for a write error message."""
    try:
        free = available(folder)
    except OSError:
        free = "free space unknown"
    return f" (the output needs {needed} bytes in all; {written} were written, {free})"
