"""scripts/bench_build.py's floor row: ``dd oflag=direct`` writes exactly the bytes it stands for (the dense file,
read again from its start, to the same length as the build's output), and the per-round ratios pair runs of one round.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_build  # noqa: E402  (a script, imported from scripts/)


def _direct_io(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


@pytest.mark.parametrize("nbytes", [3 * 2**20 + 4096, 10 * 2**20 + 123, 2**20 + 7],
                         ids=["one-piece-and-a-block", "three-pieces-and-a-tail", "inside-one-piece"])
def test_dd_floor_writes_the_source_again_and_again(nbytes, tmp_path):
    if shutil.which("dd") is None or not _direct_io(tmp_path):
        pytest.skip("needs dd and a filesystem with direct I/O (tmpfs has none)")
    src = tmp_path / "model.safetensors"
    data = os.urandom(3 * 2**20 + 1000)  # pieces are whole MiB: 3 MiB of it, then from the start again
    src.write_bytes(data)
    dst = tmp_path / "dd.bin"
    cmd = bench_build.dd_cmd(src, dst, nbytes, block="1M")
    assert cmd[:2] == ["sh", "-c"] and cmd[2].count("oflag=direct") == -(-nbytes // (3 * 2**20))
    subprocess.run(cmd, check=True, timeout=60)
    piece = data[:3 * 2**20]
    assert dst.read_bytes() == (piece * (nbytes // len(piece) + 1))[:nbytes]
    assert "conv=notrunc,fsync" in cmd[2].rsplit("&&", 1)[-1]  # the last dd flushes the file to disk


def test_ratios_pair_the_runs_of_each_round():
    runs = [bench_build.Run("moe-upcycle", 4, 0, wall_s=6.0), bench_build.Run(bench_build.DD, 4, 0, wall_s=5.0),
            bench_build.Run(bench_build.DD, 4, 1, wall_s=4.0), bench_build.Run("moe-upcycle", 4, 1, wall_s=6.0),
            bench_build.Run("moe-upcycle", 4, 2, wall_s=9.0, rc=1), bench_build.Run(bench_build.DD, 4, 2, wall_s=3.0),
            bench_build.Run("moe-upcycle", 8, 0, wall_s=20.0)]
    assert bench_build.ratios(runs, "moe-upcycle", bench_build.DD, 4) == [1.2, 1.5]  # a failed build pairs with nothing
    lines = bench_build.verdicts(runs)
    assert any(line.startswith("- 4 experts, default build (checksums on): 1.20× / 1.35×") and "MISSED" in line
               for line in lines), lines
