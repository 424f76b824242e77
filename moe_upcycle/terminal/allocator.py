"""Make glibc give large freed blocks straight back to the OS, so a command's memory is what it holds.

glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which blocks
below it come from the heap, which it keeps and fragments: a build making one transformed 23 MB
slot after another held twice the memory it used (7 instead of 3.5 fp32 copies of a TinyLlama
MLP matrix, measured). A fixed threshold turns that adjustment off: blocks of `MMAP_THRESHOLD_BYTES`
or more are mapped and unmapped on their own, and `planning.memory`'s figures hold. The CLI calls
`return_large_frees` once (a library caller's process is its own business). Elsewhere than glibc
(macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 4 * 2**20


def return_large_frees(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; True when it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
