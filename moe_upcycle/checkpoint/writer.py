"""Stream tensors into sharded safetensors files, one tensor at a time.

Because the plan knows every output shape and dtype up front, each shard's safetensors header is
written first and tensor bytes are appended as they arrive: memory stays near one tensor plus the
OS write buffer, never a whole shard. Every tensor is written as its own bytes, so tensors that
share memory (or are non-contiguous views) can never trip safetensors' "share memory" error.

The bytes of each shard go through `shard_file.ShardFile`: staging buffers written with direct
I/O (no page cache) and hashed on their own threads. Each finished shard is flushed to disk
(``fsync``) on a background thread while the next shard is written, and `close` waits for every
flush: when the folder is renamed into place its shards are on disk.

It does not decide where the folder goes or how it is made atomic: see `output_dir`.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterable, Optional, Sequence, Union

import torch

from moe_upcycle.errors import OutputError, reraise_if_out_of_memory
from moe_upcycle.checkpoint.disk_space import disk_hint
from moe_upcycle.checkpoint.shard_file import ShardFile
from moe_upcycle.checkpoint.headers import DTYPE_NAMES, tensor_nbytes

INDEX_NAME = "model.safetensors.index.json"


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
                 metadata: Optional[dict] = None, only: Optional[Collection[int]] = None):
        """Args:
            only: the shards (0-based indices) this writer writes, default all: a rank of a distributed build
                writes its own (`distributed.shard_split`), with the names, headers and bytes of the whole layout.
        """
        self.folder = Path(folder)
        self.shards = assign_shards(specs, max_shard_bytes)
        mine = range(len(self.shards)) if only is None else sorted(only)
        self._order = [(k, spec) for k in mine for spec in self.shards[k]]
        self._pos = 0
        self._file: Optional[ShardFile] = None
        self._shard = -1
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self._flushes: list[Future] = []
        self._finished_bytes = 0  # bytes of the shards already finished (headers included)
        self.checksums = checksums  # sha256 of each shard while writing (costs more CPU than the write)
        self.sha256: dict[str, str] = {}  # file name -> hex digest, computed while writing
        self.metadata = metadata  # each shard's safetensors __metadata__ (default {"format": "pt"})

    @property
    def files(self) -> list[str]:
        """Every shard's file name (also those another rank writes)."""
        return [shard_name(k + 1, len(self.shards)) for k in range(len(self.shards))]

    @property
    def names(self) -> list[str]:
        """The tensors this writer writes, in order."""
        return [spec.name for _, spec in self._order]

    def file_size(self, k: int) -> int:
        """The length of shard `k`'s file: its header and its tensors' bytes."""
        return len(_header(self.shards[k], self.metadata)) + sum(spec.nbytes for spec in self.shards[k])

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
            data = part.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
            if written + data.numel() > spec.nbytes:
                raise RuntimeError(f"parts of {spec.name} exceed its {spec.nbytes} bytes")
            self._write(data)
            written += data.numel()
        if written != spec.nbytes:
            raise RuntimeError(f"parts of {spec.name} gave {written} of its {spec.nbytes} bytes")
        self._pos += 1

    def _open(self, k: int) -> None:
        self._finish_file()
        self._shard = k
        path = self.folder / self.files[k]
        try:
            self._file = ShardFile(path, self.checksums)
        except OSError as exc:
            reraise_if_out_of_memory(exc)  # the machine's memory, not the output
            raise OutputError(f"creating {path} failed: {exc.strerror or exc}") from None
        header = _header(self.shards[k], self.metadata)
        self._write(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    def _write(self, data: torch.Tensor) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            reraise_if_out_of_memory(exc)  # the machine's memory, not the output
            raise self._write_failed(self._file, exc) from None

    def _finish_file(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                digest = file.finish()
            except OSError as exc:
                file.abort()
                reraise_if_out_of_memory(exc)  # the machine's memory, not the output
                raise self._write_failed(file, exc) from None
            self._finished_bytes += file.size
            self._flushes.append(self._flusher.submit(_sync_and_close, file))
            if digest is not None:
                self.sha256[self.files[self._shard]] = digest

    def _write_failed(self, file: ShardFile, exc: OSError) -> OutputError:
        """The error for a failed write: which file, why, and the bytes needed, on disk and free."""
        return OutputError(f"writing {file.path} failed: {exc.strerror or exc}"
                           + disk_hint(self.folder, self.total_bytes, self._finished_bytes + file.on_disk))

    @property
    def total_bytes(self) -> int:
        """The tensor bytes of the whole output (every shard's, also those another rank writes)."""
        return sum(spec.nbytes for shard in self.shards for spec in shard)

    def close(self, index: bool = True) -> dict:
        """Finish the last shard and wait until every shard is on disk; write the index unless `index` is False
        (a distributed build writes it once every rank is done: `write_index`). Returns the index dict."""
        if self._pos != len(self._order):
            missing = self._order[self._pos][1].name
            raise RuntimeError(f"writer closed with {len(self._order) - self._pos} tensors unwritten (next: {missing})")
        self._finish_file()
        self._wait_for_flushes()
        return self.write_index() if index else self.index()

    def index(self) -> dict:
        """The index of the whole output: total tensor bytes and which file holds each tensor."""
        return {"metadata": {"total_size": self.total_bytes},
                "weight_map": {spec.name: self.files[k] for k, shard in enumerate(self.shards) for spec in shard}}

    def write_index(self) -> dict:
        """Write ``model.safetensors.index.json`` into the folder; returns it."""
        index = self.index()
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
        if self._file is not None:
            self._file.abort()
            self._file = None
        try:
            self._wait_for_flushes()
        except Exception:  # noqa: BLE001 - the folder is discarded; the error that stopped the build is the one to report
            pass


def _sync_and_close(file: ShardFile) -> None:
    """Flush a written shard to disk and close it (runs on the writer's fsync thread)."""
    try:
        file.sync_and_close()
    except OSError as exc:
        reraise_if_out_of_memory(exc)  # the machine's memory, not the output
        raise OutputError(f"flushing {file.path} to disk failed: {exc.strerror or exc}") from None
