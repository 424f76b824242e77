"""scripts/bench_gpu.py (issue 16's GPU figures) stays runnable: its ``--device cpu`` smoke mode runs every part
(capture vs plain forward, upcycle_model per init, train -> save -> reload -> generate per init) on a tiny shape, and
every row says what the GPU run must show: device and dtype kept, a loss that falls, an fp32 reload that gives the
in-memory model's logits, a bf16 ship that reloads as bf16 and generates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_gpu_runs_every_part_on_the_cpu():
    # one torch thread: on a shared machine two threads wait on each other in every tiny bf16 product (2 min -> 20 s)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--device", "cpu", "--shapes", "64x2",
           "--batch-sizes", "8", "--repeats", "1", "--steps", "2", "--windows", "4", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["device"] == "cpu"
    [capture] = out["capture"]
    assert (capture["hidden"], capture["layers"], capture["batch_size"]) == (64, 2, 8)
    assert capture["tokens"] > 0 and capture["ratio"] > 0
    assert capture["ratio_median_round"] > 0
    inits = ["copy", "noise", "drop", "split"]
    assert [r["init"] for r in out["upcycle"]] == inits
    assert all(r["device_and_dtype_kept"] for r in out["upcycle"])
    assert [r["init"] for r in out["round_trip"]] == inits
    for row in out["round_trip"]:
        assert row["loss_after"] < row["loss_before"], row  # 2 AdamW steps at lr 1e-3 on 4 windows
        assert row["max_logit_diff_rel_fp32"] <= 1e-6, row  # the saved fp32 weights are the trained ones
        assert row["shipped_dtype"] == "bfloat16" and row["generated_tokens"] == 16, row
        assert row["experts_implementation"] == "eager", row  # stories260K's 172 x 2-byte rows
