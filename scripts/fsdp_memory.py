"""Per-rank memory of `upcycle_model` on an FSDP2-sharded dense model, 1 rank vs 2 (figures in docs/fsdp.md).

Writes a dense Llama (hidden 512, intermediate 1536, 8 layers, 8 heads; 103 MB fp32), then, in fresh torchrun jobs
(gloo, CPU) of 1 and 2 ranks, each rank loads it, shards it with ``fully_shard`` (each layer, then the root) and
upcycles it to 8 experts (copy init). Each rank reports the bytes of its local MoE shards, the whole MoE's bytes,
and its RSS sampled every 2 ms: the rise during ``upcycle_model`` above the RSS just before it, and the
process's peak RSS (ru_maxrss: the dense model's load included).
The one-process path (no FSDP: the whole MoE in one process) is measured too, as the reference.

    python scripts/fsdp_memory.py [--layers 8 --hidden 512 --experts 8 --json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, resource, sys, threading, time
import psutil, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from moe_upcycle import upcycle_model
fsdp = sys.argv[3] == "fsdp"
if fsdp:
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo")
proc = psutil.Process()
peak = proc.memory_info().rss
done = False
def sample():
    global peak
    while not done:
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True); t.start()
dense = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
if fsdp:
    for layer in dense.model.layers:
        fully_shard(layer)
    fully_shard(dense)
before = proc.memory_info().rss
peak = before
start = time.perf_counter()
moe = upcycle_model(dense, num_experts=int(sys.argv[2]), experts_per_token=2)
seconds = time.perf_counter() - start
rise = peak - before
local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in moe.parameters())
total = sum(p.numel() * p.element_size() for p in moe.parameters())
done = True; t.join()
rank = dist.get_rank() if fsdp else 0
print(json.dumps({"mode": sys.argv[3], "world_size": dist.get_world_size() if fsdp else 1, "rank": rank,
                  "local_param_bytes": local, "moe_bytes": total, "rss_rise_bytes": rise,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "seconds": seconds}))
if fsdp:
    dist.destroy_process_group()
"""


def run(folder: Path, experts: int, mode: str, ranks: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if mode == "fsdp"
           else [sys.executable]) + [f.name, str(folder), str(experts), mode]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    os.unlink(f.name)
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from moe_upcycle.checkpoint.tiny import make_dense_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_dense_model(Path(tmp) / "dense", hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                  num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                  head_dim=args.hidden // 8)
        rows = run(folder, args.experts, "plain", 1) + run(folder, args.experts, "fsdp", 1) \
            + run(folder, args.experts, "fsdp", 2)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    mib = 2 ** 20
    total = rows[0]["moe_bytes"]
    print(f"MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts, {total / mib:.0f} MiB fp32")
    print(f"{'path':<14}{'rank':>5}{'local params MiB':>18}{'share of MoE':>14}{'RSS rise MiB':>14}{'peak RSS MiB':>14}"
          f"{'seconds':>9}")
    for r in rows:
        path = "one process" if r["mode"] == "plain" else f"FSDP {r['world_size']} rank(s)"
        print(f"{path:<14}{r['rank']:>5}{r['local_param_bytes'] / mib:>18.1f}{r['local_param_bytes'] / total:>14.3f}"
              f"{r['rss_rise_bytes'] / mib:>14.1f}{r['peak_rss_bytes'] / mib:>14.1f}{r['seconds']:>9.2f}")


if __name__ == "__main__":
    main()
