"""The streaming writer's staged writes (direct I/O or not) and background sha256: same bytes, same digests."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest
import torch
from safetensors import safe_open

from moe_upcycle.checkpoint import shard_file
from moe_upcycle.checkpoint.shard_file import ShardFile
from moe_upcycle.checkpoint.writer import ShardedWriter, TensorSpec


def _pieces() -> list[bytes]:
    return [bytes([i % 251]) * (1000 + 997 * i) for i in range(30)] + [b"", b"tail"]


@pytest.mark.parametrize("buffer_bytes, depth", [(4096, 1), (8192, 2), (1 << 20, 4)])
@pytest.mark.parametrize("checksum", [True, False])
def test_shard_file_writes_exact_bytes_and_digest(tmp_path, buffer_bytes, depth, checksum):
    pieces = _pieces()
    f = ShardFile(tmp_path / "x.bin", checksum, buffer_bytes, depth)
    for piece in pieces:
        f.write(torch.frombuffer(bytearray(piece), dtype=torch.uint8) if piece else torch.empty(0, dtype=torch.uint8))
    digest = f.finish()
    f.sync_and_close()
    expected = b"".join(pieces)
    assert len(expected) % 4096 != 0  # the padded last block is truncated away
    assert (tmp_path / "x.bin").read_bytes() == expected
    assert digest == (hashlib.sha256(expected).hexdigest() if checksum else None)


def _refuse_direct_open(monkeypatch):
    real_open = os.open

    def fake_open(path, flags, mode=0o777):
        if flags & shard_file.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(shard_file.os, "open", fake_open)


def _refuse_direct_writes(monkeypatch):
    real_write = os.write
    calls = []

    def fake_write(fd, data):
        calls.append(bool(shard_file.fcntl.fcntl(fd, shard_file.fcntl.F_GETFL) & shard_file.O_DIRECT))
        if calls[-1]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(shard_file.os, "write", fake_write)
    return calls


@pytest.mark.skipif(not shard_file.O_DIRECT, reason="no O_DIRECT on this OS: the buffered path is the only one")
@pytest.mark.parametrize("refuse", [_refuse_direct_open, _refuse_direct_writes], ids=["at-open", "at-first-write"])
def test_filesystem_without_direct_io_gets_the_same_bytes(tmp_path, monkeypatch, refuse):
    calls = refuse(monkeypatch)
    pieces = _pieces()
    f = ShardFile(tmp_path / "x.bin", True, 8192, 2)
    for piece in pieces[:-2]:
        f.write(torch.frombuffer(bytearray(piece), dtype=torch.uint8))
    digest = f.finish()
    f.sync_and_close()
    expected = b"".join(pieces[:-2])
    assert (tmp_path / "x.bin").read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    if calls is not None:  # one refused direct write, then every write through the page cache
        assert calls[0] is True and not any(calls[1:]) and len(calls) > 2


def test_failed_write_reaches_the_caller_and_closes_the_file(tmp_path, monkeypatch):
    real_write = os.write
    written = [0]

    def full_disk(fd, data):
        if written[0] >= 3 * 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        written[0] += len(data)
        return real_write(fd, data)

    monkeypatch.setattr(shard_file.os, "write", full_disk)
    f = ShardFile(tmp_path / "x.bin", True, 4096, 2)
    with pytest.raises(OSError, match="No space left"):
        for _ in range(10):
            f.write(torch.zeros(4096, dtype=torch.uint8))
        f.finish()
    f.abort()
    with pytest.raises(OSError):
        os.fstat(f.fd)  # closed


@pytest.mark.parametrize("buffer_bytes", [4096, 1 << 20])
def test_sharded_files_have_exact_bytes_and_digests(tmp_path, monkeypatch, buffer_bytes):
    monkeypatch.setattr(shard_file, "BUFFER_BYTES", buffer_bytes)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 30, generator=g)
    tensors = {
        "a": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "b.transposed": base.t(),  # non-contiguous view
        "c.shared": base,  # same storage as b
        "d.scalar": torch.tensor(3.5),
        "e.empty": torch.empty(0, 4),
        "f.big": torch.randn(300, 50, generator=g),  # spans several 4 KiB buffers
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


def test_shard_file_opened_in_inference_mode_finishes_outside_it(tmp_path):
    """The executor yields tensors inside torch.inference_mode; the last shard is finished after it."""
    with torch.inference_mode():
        f = ShardFile(tmp_path / "x.bin", True, 4096, 2)
        f.write(torch.arange(100, dtype=torch.uint8))
    f.write(torch.arange(50, dtype=torch.uint8))
    digest = f.finish()
    f.sync_and_close()
    expected = bytes(range(100)) + bytes(range(50))
    assert (tmp_path / "x.bin").read_bytes() == expected and digest == hashlib.sha256(expected).hexdigest()


def test_staging_buffers_must_be_whole_blocks(tmp_path):
    with pytest.raises(ValueError, match="multiple of 4096 bytes, not 5000"):
        ShardFile(tmp_path / "x.bin", True, 5000, 2)
    assert not (tmp_path / "x.bin").exists()  # refused before the file is created
