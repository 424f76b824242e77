"""Peak memory of a build, per-expert vs fused layout (prints the numbers quoted in moe_upcycle/fused.py).

Builds a dense Llama (hidden 1024, intermediate 4096, 2 layers; one FFN matrix = 16 MiB fp32) and
upcycles it to 8 experts with `tensor_policy: clone` (every slot its own copy, the worst case), in
a fresh subprocess per layout, and reports each process's peak RSS (sampled every 2 ms) above its
baseline after the imports. A fused gate_up_proj is (8, 8192, 1024) fp32 = 256 MiB; holding it would show up here.

    python scripts/fused_memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, threading, time
os.environ["HF_HUB_OFFLINE"] = "1"
import psutil, torch, transformers  # import first, so the baseline includes the libraries
from moe_upcycle import upcycle
proc = psutil.Process()
base = peak = proc.memory_info().rss
done = False
def sample():
    global peak
    while not done:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
r = upcycle({"base_model": sys.argv[1], "num_experts": 8, "gate_mode": "random", "layout": sys.argv[3],
             "tensor_policy": "clone"}, sys.argv[2])
done = True; t.join()
print(json.dumps({"layout": sys.argv[3], "peak_rss_above_baseline_mib": round((peak - base) / 2**20, 1),
                  "output_mib": round(r.plan.total_bytes / 2**20, 1)}))
"""


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from moe_upcycle.checkpoint.tiny import make_dense_model

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        dense = make_dense_model(Path(tmp) / "dense", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=8, seed=0)
        for layout in ("per_expert", "fused"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(dense), str(Path(tmp) / layout), layout],
                                 capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
            print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-2000:])
    print(json.dumps({"fused_gate_up_proj_mib": 8 * 8192 * 1024 * 4 / 2**20, "one_ffn_matrix_mib": 4096 * 1024 * 4 / 2**20}))


if __name__ == "__main__":
    main()
