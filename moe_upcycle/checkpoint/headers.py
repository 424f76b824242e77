"""What a checkpoint's files say about their tensors, without reading tensor data.

`TensorInfo` is one tensor's key, shape, dtype, file and byte offset. `read_safetensors_header`
parses a safetensors header at least as strictly as the safetensors library does (UTF-8 JSON
without duplicate names or NaN, tensors tiling the data section exactly), so a file accepted
here never fails later, mid-build, and never builds a model from a file transformers refuses.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import torch

from moe_upcycle.checkpoint.lfs_pointers import lfs_pointer_problem
from moe_upcycle.errors import SourceError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit

def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and sanity-check a safetensors header without reading tensor data.

    The checks are at least as strict as the safetensors library's own (tensors must tile the
    data section exactly), so a file accepted here never fails later, mid-build, on its header.

    Raises:
        SourceError: missing, empty, truncated file or a header that lies (bad offsets, sizes).
    """
    if not file.is_file():
        raise SourceError(f"{file}: shard file is missing")
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise SourceError(f"{file}: empty or truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SourceError(lfs_pointer_problem(file) or f"{file}: safetensors header claims {n} bytes but the "
                                  f"file has {size}; the file is truncated or not safetensors")
            raw = fh.read(n)
    except OSError as exc:  # permissions, I/O error
        raise SourceError(f"{file}: cannot read it ({exc.strerror or exc}); check that it is readable by you") from None
    header = _parse_header(file, raw)
    if not isinstance(header, dict):
        raise SourceError(f"{file}: safetensors header is not a JSON object")
    meta = header.get("__metadata__")
    meta = {} if meta is None else meta  # safetensors reads a null __metadata__ as none
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SourceError(f"{file}: safetensors __metadata__ must map names to strings; the file is corrupt")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        info, start, end = _header_entry(file, key, entry)
        if end < start or end - start != info.nbytes:
            raise SourceError(f"{file}: tensor {key!r} header is inconsistent: shape {list(info.shape)} of "
                              f"{entry['dtype']} needs {info.nbytes} bytes but its offsets {start}..{end} give "
                              f"{end - start}; the file is corrupt")
        spans.append((start, end, key))
        out[key] = replace(info, offset=8 + n + start)
    spans.sort()
    # safetensors requires the tensors to tile the data section: no overlap, no gap, nothing after
    position, previous = 0, None
    for start, end, key in spans:
        if start < position:
            raise SourceError(f"{file}: tensors {previous!r} and {key!r} overlap in the header; the file is corrupt")
        if start > position:
            raise SourceError(f"{file}: the header leaves bytes {position}..{start} before tensor {key!r} "
                              f"unaccounted for; the file is corrupt")
        position, previous = end, key
    if position > data_size:
        raise SourceError(f"{file}: truncated: the header describes {position} data bytes but the file holds "
                          f"{data_size}; re-download it")
    if position < data_size:
        raise SourceError(f"{file}: {data_size - position} bytes after the last tensor are not described by the "
                          f"header; the file is corrupt — re-download it")
    return {key: out[key] for _, _, key in spans}


def _parse_header(file: Path, raw: bytes) -> Any:
    """The header's JSON, parsed as strictly as the safetensors library parses it.

    Python's `json` is laxer: it guesses UTF-16/32 and skips a byte-order mark when given bytes,
    takes ``NaN``, keeps the last of duplicate names and lets ``"\\ud800"`` through. safetensors
    (and so transformers) refuses such a header; a file it cannot load must not build a model.
    """
    def pairs(items: list[tuple[str, Any]]) -> dict:
        names = [k for k, _ in items]
        for k in names:
            if names.count(k) > 1:
                raise ValueError(f"the name {k!r} appears {names.count(k)} times in one object")
            k.encode("utf-8")  # a lone surrogate escape cannot be UTF-8
        for _, v in items:
            if isinstance(v, str):
                v.encode("utf-8")
        return dict(items)

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and Unicode errors are ValueErrors
        raise SourceError(f"{file}: safetensors header is not valid JSON ({exc}); the file is damaged or not "
                          f"safetensors — re-download it") from None


def _header_entry(file: Path, key: str, entry: Any) -> tuple[TensorInfo, int, int]:
    """One tensor's header entry as (info, start, end); strict about types (no floats, no bools)."""
    def ints(values: Any, length: Optional[int] = None) -> Optional[list[int]]:
        if not isinstance(values, list) or (length is not None and len(values) != length):
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return None
        return values

    if not isinstance(entry, dict):
        raise SourceError(f"{file}: tensor {key!r} has a malformed header entry {entry!r}")
    dtype_name = entry.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        quantized = (" — a quantized checkpoint: upcycle the model's unquantized (bf16, fp16 or fp32) release"
                     if isinstance(dtype_name, str) and dtype_name.startswith(("F8", "F6", "F4", "I4", "U4")) else "")
        raise SourceError(f"{file}: tensor {key!r} has dtype {dtype_name!r}, which moe-upcycle does not read "
                          f"(supported: {', '.join(SAFETENSORS_DTYPES)}){quantized}")
    shape, offsets = ints(entry.get("shape")), ints(entry.get("data_offsets"), 2)
    if shape is None or offsets is None:
        raise SourceError(f"{file}: tensor {key!r} has a malformed header entry {entry!r} "
                          f"(shape and data_offsets must be lists of non-negative integers)")
    return TensorInfo(key, tuple(shape), SAFETENSORS_DTYPES[dtype_name], file.name), offsets[0], offsets[1]


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype.

    Example:
        >>> tensor_nbytes((2, 3), torch.bfloat16)
        12
    """
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, without its data."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str  # file name inside the checkpoint folder ("" for meta checkpoints)
    offset: int = -1  # safetensors: the data's byte offset in `file` (-1: not known)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)
