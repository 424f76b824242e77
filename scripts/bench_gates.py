"""Benchmark hidden-state gate computation against a plain batched forward pass.

Generates a dense Llama (default hidden 256, 6 layers), takes 8 experts × 32 prompts from the
shipped prompt sets and times, in the same run and on the same batches of the same tokens:

- ``plain``: the decoder alone (``model.model``), no hooks — the same layers gate capture runs;
- ``plain+lm_head``: the whole ``LlamaForCausalLM`` forward, as a user would call it;
- ``gates``: `capture.capture_router_inputs` (hooks, masked running sums).

Prints tokens/s of each, the ratio gates/plain (target ≥ 0.85) and peak memory (process RSS on
CPU, ``torch.cuda.max_memory_allocated`` on GPU). Runs on GPU too when one is present.

Usage: python scripts/bench_gates.py [--hidden 256 --layers 6 --batch-size 16 --repeats 3 --threads N --json]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from moe_upcycle.gates import capture as cap
from moe_upcycle.recipe.prompt_sets import load_prompts, set_names
from moe_upcycle.checkpoint.tiny import make_dense_model

EXPERTS, PROMPTS_PER_EXPERT = 8, 32


def expert_prompts() -> list[list[str]]:
    """8 groups of 32 prompts, cycling through the shipped sets (deterministic)."""
    pool = [p for name in set_names() for p in load_prompts(name, "bench")]
    return [[pool[(e * PROMPTS_PER_EXPERT + i) % len(pool)] for i in range(PROMPTS_PER_EXPERT)] for e in range(EXPERTS)]


def plain_pass(loaded: cap.LoadedModel, encoded: list[cap.Encoded], batch_size: int, full: bool) -> None:
    """The same batches as `run_batches` (length-sorted, same padding), without hooks, sent to the device as
    capture sends them (one copy per batch, from pinned memory on a GPU): the ratio is the cost of the hooks and
    sums alone. (A pageable ``.to(device)`` per tensor would make the host wait for the GPU at every batch and
    flatter the capture at small batches.)"""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    module = loaded.model if full else loaded.model.base_model
    pad = cap.padding_id(loaded.tokenizer, loaded.model.get_input_embeddings().num_embeddings)
    dev = torch.device(loaded.input_device)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            ids, attn, real = cap.pad_batch([encoded[i] for i in rows], pad, "right")
            on = cap.on_device(rows, ids, attn, real, None, dev)
            module(input_ids=on.ids, attention_mask=on.attn, position_ids=on.positions, use_cache=False)


def timed(fns: dict, device: str, repeats: int) -> dict:
    """Best wall time of each function over `repeats` rounds (after one warm-up each).

    The functions run interleaved (a, b, c, a, b, c, ...), so a busy machine slows all alike.
    """
    best = {name: float("inf") for name in fns}
    for name, fn in fns.items():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device != "cpu":
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench(folder: Path, device: str, batch_size: int, repeats: int) -> dict:
    loaded = cap.load_base(folder, device=device)
    groups, texts = [], []
    for e, prompts in enumerate(expert_prompts()):
        texts += prompts
        groups += [e] * len(prompts)
    encoded = cap.encode(loaded.tokenizer, texts, loaded.max_length)
    tokens = sum(len(x.ids) for x in encoded)
    captured = {}

    def gates():
        captured["inputs"] = cap.capture_router_inputs(loaded, encoded, groups, EXPERTS, "mean", batch_size)

    peaks = {}
    if device != "cpu":  # peak memory of one pass of each, measured apart from the timing
        for name, fn in (("plain", lambda: plain_pass(loaded, encoded, batch_size, full=False)), ("gates", gates)):
            torch.cuda.reset_peak_memory_stats()
            fn()
            peaks[name] = torch.cuda.max_memory_allocated()
    times = timed({"plain": lambda: plain_pass(loaded, encoded, batch_size, full=False),
                   "full": lambda: plain_pass(loaded, encoded, batch_size, full=True), "gates": gates},
                  device, repeats)
    t_plain, t_full, t_gates = times["plain"], times["full"], times["gates"]
    peak_plain, peak_gates = peaks.get("plain"), peaks.get("gates")
    sums = captured["inputs"].sums
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "prompts": len(texts), "tokens": tokens, "batch_size": batch_size,
        "plain_tokens_per_s": round(tokens / t_plain), "plain_lm_head_tokens_per_s": round(tokens / t_full),
        "gates_tokens_per_s": round(tokens / t_gates),
        "ratio_vs_plain": round(t_plain / t_gates, 3), "ratio_vs_plain_lm_head": round(t_full / t_gates, 3),
        "running_sums_bytes": sums.numel() * sums.element_size(),
        "model_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes_plain": peak_plain, "peak_gpu_bytes_gates": peak_gates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_dense_model(Path(tmp) / "dense", family="llama", seed=0, hidden_size=args.hidden,
                                  intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers,
                                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024)
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        results = [bench(folder, d, args.batch_size, args.repeats) for d in devices]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        print(f"[{r['device']}, {r['dtype']}] {r['prompts']} prompts, {r['tokens']} tokens, batch {r['batch_size']}")
        print(f"  plain decoder forward : {r['plain_tokens_per_s']:>9} tokens/s")
        print(f"  plain + lm_head       : {r['plain_lm_head_tokens_per_s']:>9} tokens/s")
        print(f"  gate capture          : {r['gates_tokens_per_s']:>9} tokens/s  -> {r['ratio_vs_plain']:.3f} of plain "
              f"(target >= 0.85), {r['ratio_vs_plain_lm_head']:.3f} of plain + lm_head")
        print(f"  model {r['model_bytes'] / 1e6:.1f} MB, running sums {r['running_sums_bytes'] / 1e3:.1f} kB, "
              f"peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB"
              + (f", peak GPU {r['peak_gpu_bytes_plain'] / 1e6:.0f} MB plain / {r['peak_gpu_bytes_gates'] / 1e6:.0f} MB "
                 f"gates" if r["peak_gpu_bytes_gates"] else ""))


if __name__ == "__main__":
    main()
