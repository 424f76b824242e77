"""Stream tensors into sharded safetensors files, one tensor at a time.

Because the plan knows every output shape and dtype up front, each shard's safetensors header is
written first and tensor bytes are appended as they arrive: memory stays near one tensor plus the
OS write buffer, never a whole shard. Every tensor is written as its own bytes, so tensors that
share memory (or are non-contiguous views) can never trip safetensors' "share memory" error.

Each finished shard is flushed to disk (``fsync``) on a background thread while the next shard
is written, and `close` waits for every flush: when the folder is renamed into place its shards
are on disk, not only in the page cache, and the disk is kept busy instead of throttling the
writer once the page cache fills up.

It does not decide where the folder goes or how it is made atomic: see `output_dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Optional, Sequence, Union

import torch

from moe_upcycle.errors import OutputError
from moe_upcycle.checkpoint.disk_space import disk_hint
from moe_upcycle.checkpoint.source import DTYPE_NAMES, tensor_nbytes

INDEX_NAME = "model.safetensors.index.json"
# Tensors are written and hashed in slices of this size, so hashing a slice overlaps writing the next.
CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of a tensor to be written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


@dataclass
class TensorParts:
    """A tensor given as parts whose bytes, one after the other, are its row-major bytes.

    The writer streams the parts as they come, so a stacked tensor such as fused experts
    (E, 2I, H) is written while only one part is in memory.

    Example:
        >>> t = TensorParts((2, 3), torch.float32, iter([torch.zeros(3), torch.ones(3)]))
        >>> t.materialize()[1].tolist()
        [1.0, 1.0, 1.0]
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: Iterable[torch.Tensor]

    def materialize(self) -> torch.Tensor:
        """The whole tensor (holds all of it: for tests and small tensors)."""
        return torch.cat([p.reshape(-1) for p in self.parts]).view(self.shape)


def assign_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets its own).

    Example:
        >>> s = [TensorSpec(f"t{i}", (10,), torch.float32) for i in range(5)]
        >>> [len(x) for x in assign_shards(s, 80)]
        [2, 2, 1]
    """
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


class BackgroundHash:
    """sha256 computed on a worker thread, up to `depth` chunks behind the writes.

    sha256 costs about as much CPU as the write itself (1.2-1.5 GB/s per core with SHA
    instructions), so it runs beside the write syscalls: `update` hands a chunk over and only
    waits when `depth` chunks are still pending (two, so a hash that is briefly slower than the
    disk, e.g. while a shard is flushed, does not stall the writer). hashlib releases the GIL for
    large buffers, so the two really run in parallel. The pending chunks are views of tensors,
    kept alive until hashed; the single worker hashes them in order.

    Example:
        >>> h = BackgroundHash()
        >>> h.update(b"abc"); h.hexdigest()[:12]
        'ba7816bf8f01'
    """

    def __init__(self, depth: int = 2) -> None:
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sha256")
        self._pending: deque[Future] = deque()
        self._depth = depth

    def update(self, data) -> None:
        while len(self._pending) >= self._depth:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._hash.update, data))

    def _wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        """The digest of everything passed to `update` (waits for the last chunk)."""
        self._wait()
        self.close()
        return self._hash.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _header(specs: Sequence[TensorSpec], metadata: Optional[dict] = None) -> bytes:
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align tensor data to 8 bytes, as safetensors does
    return struct.pack("<Q", len(raw)) + raw


class ShardedWriter:
    """Write planned tensors into ``model-0000k-of-0000N.safetensors`` plus the index.

    Tensors must arrive in exactly the order of `specs`. Example::

        w = ShardedWriter(folder, specs, max_shard_bytes=5 * 10**9)
        for spec, tensor in zip(specs, tensors):
            w.write(spec.name, tensor)
        w.close()
    """

    def __init__(self, folder: Path, specs: Sequence[TensorSpec], max_shard_bytes: int, checksums: bool = True,
                 metadata: Optional[dict] = None):
        self.folder = Path(folder)
        self.shards = assign_shards(specs, max_shard_bytes)
        self._order = [(k, spec) for k, shard in enumerate(self.shards) for spec in shard]
        self._pos = 0
        self._fh: Optional[BinaryIO] = None
        self._shard = -1
        self._hash = None
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self._flushes: list[Future] = []
        self.bytes_written = 0
        self.checksums = checksums  # sha256 of each shard while writing (costs more CPU than the write)
        self.sha256: dict[str, str] = {}  # file name -> hex digest, computed while writing
        self.metadata = metadata  # each shard's safetensors __metadata__ (default {"format": "pt"})

    @property
    def files(self) -> list[str]:
        return [shard_name(k + 1, len(self.shards)) for k in range(len(self.shards))]

    def write(self, name: str, tensor: Union[torch.Tensor, TensorParts]) -> None:
        """Append one tensor (any layout: made contiguous here), or stream its parts, to its shard."""
        if self._pos >= len(self._order):
            raise RuntimeError(f"unexpected tensor {name!r}: every planned tensor was already written")
        k, spec = self._order[self._pos]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise RuntimeError(f"writer expected {spec.name} {list(spec.shape)} {spec.dtype}, "
                               f"got {name} {list(tensor.shape)} {tensor.dtype}")
        if k != self._shard:
            self._open(k)
        written = 0
        for part in tensor.parts if isinstance(tensor, TensorParts) else (tensor,):
            if part.dtype != spec.dtype:
                raise RuntimeError(f"writer got a {part.dtype} part for {spec.name} ({spec.dtype})")
            data = part.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
            if written + data.size > spec.nbytes:
                raise RuntimeError(f"parts of {spec.name} exceed its {spec.nbytes} bytes")
            for start in range(0, len(data), CHUNK_BYTES):
                self._write(data[start:start + CHUNK_BYTES])
            written += data.size
        if written != spec.nbytes:
            raise RuntimeError(f"parts of {spec.name} gave {written} of its {spec.nbytes} bytes")
        self.bytes_written += spec.nbytes
        self._pos += 1

    def _open(self, k: int) -> None:
        self._finish_file()
        self._shard = k
        self._fh = open(self.folder / self.files[k], "wb")
        self._hash = BackgroundHash() if self.checksums else None
        self._write(_header(self.shards[k], self.metadata))

    def _write(self, data) -> None:
        try:
            self._fh.write(data)
            if self._hash is not None:
                self._hash.update(data)
        except OSError as exc:
            raise OutputError(f"writing {self._fh.name} failed: {exc.strerror or exc}"
                              + disk_hint(self.folder, self.total_bytes, self.bytes_written)) from None

    def _finish_file(self) -> None:
        if self._fh is not None:
            try:
                self._fh.flush()
            except OSError as exc:
                raise OutputError(f"closing {self._fh.name} failed: {exc.strerror or exc}") from None
            self._flushes.append(self._flusher.submit(_sync_and_close, self._fh))
            if self._hash is not None:
                self.sha256[self.files[self._shard]] = self._hash.hexdigest()
            self._fh = None
            self._hash = None

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for _, spec in self._order)

    def close(self) -> dict:
        """Finish the last shard and write the index. Returns the index dict."""
        if self._pos != len(self._order):
            missing = self._order[self._pos][1].name
            raise RuntimeError(f"writer closed with {len(self._order) - self._pos} tensors unwritten (next: {missing})")
        self._finish_file()
        self._wait_for_flushes()
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {spec.name: self.files[k] for k, spec in self._order}}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return index

    def _wait_for_flushes(self) -> None:
        flushes, self._flushes = self._flushes, []
        try:
            for flush in flushes:
                flush.result()
        finally:
            self._flusher.shutdown(wait=True)

    def abort(self) -> None:
        """Close any open file without finishing (the caller discards the folder)."""
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None
        try:
            self._wait_for_flushes()
        except Exception:  # noqa: BLE001 - the folder is discarded; the error that stopped the build is the one to report
            pass
        if self._hash is not None:
            self._hash.close()
            self._hash = None


def _sync_and_close(fh: BinaryIO) -> None:
    """Flush a written shard to disk and close it (runs on the writer's fsync thread)."""
    try:
        os.fsync(fh.fileno())
        fh.close()
    except OSError as exc:
        try:
            fh.close()
        except OSError:
            pass
        raise OutputError(f"flushing {fh.name} to disk failed: {exc.strerror or exc}") from None
