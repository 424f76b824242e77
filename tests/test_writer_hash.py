"""The streaming writer's chunked writes and background sha256: same bytes, same digests."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open

from moe_upcycle.checkpoint import writer as writer_mod
from moe_upcycle.checkpoint.writer import BackgroundHash, ShardedWriter, TensorSpec


def test_background_hash_matches_hashlib():
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(20)] + [b"", b"tail"]
    h = BackgroundHash()
    for chunk in chunks:
        h.update(chunk)
    assert h.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()


def test_background_hash_reports_a_failed_update():
    h = BackgroundHash()
    h.update(b"ok")
    h.update(object())  # not a buffer: the worker's TypeError must reach the caller
    with pytest.raises(TypeError):
        h.hexdigest()


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_chunked_shards_have_exact_bytes_and_digests(tmp_path, monkeypatch, chunk_bytes):
    monkeypatch.setattr(writer_mod, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 30, generator=g)
    tensors = {
        "a": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "b.transposed": base.t(),  # non-contiguous view
        "c.shared": base,  # same storage as b
        "d.scalar": torch.tensor(3.5),
        "e.empty": torch.empty(0, 4),
    }
    specs = [TensorSpec(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    w = ShardedWriter(tmp_path, specs, max_shard_bytes=3000)
    for k, t in tensors.items():
        w.write(k, t)
    index = w.close()
    assert len(w.files) > 1
    for name in w.files:
        assert w.sha256[name] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    for k, t in tensors.items():
        with safe_open(str(tmp_path / index["weight_map"][k]), "pt") as f:
            assert torch.equal(f.get_tensor(k), t), k
