"""Write one file's bytes through aligned staging buffers, with direct I/O where the filesystem allows.

A build writes gigabytes it will not read back, so the page cache only costs it: with buffered
writes the kernel copies every byte into newly allocated cache pages and then throttles the
writer while they are flushed. On the 2-core CI box (a VM, ext4) ``dd`` writes 4 GB at
0.26-0.58 GB/s buffered + fsync and 0.77-1.2 GB/s with ``O_DIRECT``. So a `ShardFile` copies the
incoming bytes into page-aligned staging buffers (one memcpy, the same count as a buffered
write's copy into the cache) and hands each full buffer to

- an I/O thread, which writes it with ``O_DIRECT`` (the disk reads the buffer itself), and
- a hash thread, which feeds it to sha256 (while the buffer is still warm in the CPU caches).

A buffer is reused once both are done; `depth` buffers bound the memory (4 × 16 MiB). The last
buffer is written padded to the block size and the file is truncated to its real length.

Where direct I/O is refused (tmpfs, some network and FUSE filesystems, no ``O_DIRECT`` on
macOS), when opening or at the first write, the same buffers are written through the page cache:
the bytes and digests are the same either way. The file is fsync'd by the caller (`sync_and_close`).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

BUFFER_BYTES = 16 * 2**20  # a multiple of every block size direct I/O asks for (512 B, 4 KiB)
DEPTH = 4  # staging buffers per file: one being filled, the others written and hashed
BLOCK = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


class ShardFile:
    """One output file, written in order through staging buffers (see the module doc).

    Example:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> f = ShardFile(Path(folder.name) / "x.bin", checksum=True)
        >>> f.write(torch.arange(5, dtype=torch.uint8)); f.finish()[:12]
        '08bb5e5d6eaa'
        >>> f.sync_and_close(); folder.cleanup()
    """

    def __init__(self, path: Path, checksum: bool, buffer_bytes: Optional[int] = None, depth: Optional[int] = None):
        buffer_bytes = buffer_bytes or BUFFER_BYTES
        if buffer_bytes % BLOCK:  # direct I/O writes whole blocks; only the last buffer is padded
            raise ValueError(f"staging buffers must be a multiple of {BLOCK} bytes, not {buffer_bytes}")
        self.path = Path(path)
        self.fd = _open_output(self.path)
        self.size = 0  # bytes accepted so far: the file's length once finished
        self.on_disk = 0  # bytes the I/O thread has written so far
        self._hash = hashlib.sha256() if checksum else None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="shard-write")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256") if checksum else None
        self._free = [_Staging(buffer_bytes) for _ in range(depth or DEPTH)]
        self._busy: deque[tuple[_Staging, list[Future]]] = deque()
        self._current: Optional[_Staging] = None
        self._filled = 0

    def write(self, data: torch.Tensor) -> None:
        """Append the bytes of a contiguous 1-D uint8 tensor (it may be a view of a mapped file)."""
        pos, n = 0, data.numel()
        while pos < n:
            if self._current is None:
                self._current = self._take()
            room = self._current.nbytes - self._filled
            k = min(room, n - pos)
            self._current.tensor[self._filled:self._filled + k].copy_(data[pos:pos + k])
            self._filled += k
            pos += k
            if self._filled == self._current.nbytes:
                self._submit()
        self.size += n

    def finish(self) -> Optional[str]:
        """Write what is left, wait for every write and hash; the sha256 hex digest (None without checksum).

        The file stays open for `sync_and_close`. Raises the `OSError` of a failed write.
        """
        if self._filled:
            self._submit()
        try:
            while self._busy:
                _wait(self._busy.popleft()[1])
            if self.size % BLOCK:  # the last buffer was padded (buffers are whole blocks)
                os.ftruncate(self.fd, self.size)
        finally:
            self._shutdown()
            self._free = []  # the buffers go now, not when the fsync thread is done with this file
        return self._hash.hexdigest() if self._hash is not None else None

    def sync_and_close(self) -> None:
        """fsync the finished file and close it (the writer runs this on its flush thread)."""
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def abort(self) -> None:
        """Stop without finishing: pending work is dropped or waited for, the file closed."""
        for _, futures in self._busy:
            for future in futures:
                future.cancel()
        self._busy.clear()
        self._shutdown()
        self._free, self._current = [], None
        try:
            os.close(self.fd)
        except OSError:
            pass

    def _take(self) -> "_Staging":
        if self._free:
            return self._free.pop()
        staging, futures = self._busy.popleft()
        _wait(futures)
        return staging

    def _submit(self) -> None:
        staging, n = self._current, self._filled
        self._current, self._filled = None, 0
        length = n
        if n % BLOCK:  # only the last buffer: pad to the block size, truncated in `finish`
            length = n + (-n % BLOCK)
            staging.tensor[n:length].zero_()
        futures = [self._io.submit(self._write_buffer, staging.view[:length], n)]
        if self._hasher is not None:
            futures.append(self._hasher.submit(self._hash.update, staging.view[:n]))
        self._busy.append((staging, futures))

    def _write_buffer(self, view: memoryview, n: int) -> None:
        _write_all(self.fd, view)
        self.on_disk += n  # only this thread writes it

    def _shutdown(self) -> None:
        self._io.shutdown(wait=True, cancel_futures=True)
        if self._hasher is not None:
            self._hasher.shutdown(wait=True, cancel_futures=True)


def _open_output(path: Path) -> int:
    """Create (or truncate) `path` for writing, with O_DIRECT unless the filesystem refuses it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o666)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: no direct I/O on this filesystem
                raise
    return os.open(path, flags, 0o666)


def _write_all(fd: int, view: memoryview) -> None:
    """Write all of `view` at the file's position; a filesystem that refuses direct I/O on the first
    write (EINVAL) gets the same bytes through the page cache."""
    done = 0
    while done < len(view):
        try:
            done += os.write(fd, view[done:])
        except OSError as exc:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if exc.errno != errno.EINVAL or not flags & O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)


def _wait(futures: list[Future]) -> None:
    for future in futures:
        future.result()


class _Staging:
    """A page-aligned anonymous buffer (what direct I/O needs), as a memoryview and a uint8 tensor."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        # private anonymous memory (counted as the process's own, RssAnon), page-aligned
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))
        self.view = memoryview(self._map)
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
