"""Benchmark hidden-state gate computation against a plain batched forward pass and one read of the weights.

Generates a dense Llama (default hidden 256, 6 layers; ``--folder`` benchmarks an existing one, e.g. the
TinyLlama-shaped model of scripts/bench_build.py), takes 8 experts × 32 prompts from the shipped prompt sets and
times, in the same run and on the same batches of the same tokens:

- ``plain``: the decoder alone (``model.model``) of the model loaded whole with transformers, no hooks — the same
  layers gates run; ``load`` is what loading it whole costs (``from_pretrained``);
- ``plain+lm_head``: the whole ``LlamaForCausalLM`` forward, as a user would call it;
- ``streamed``: the gates as a build runs them, `capture.capture_router_inputs` on `stream.StreamedModel` (each
  layer read from the checkpoint, cast, run, dropped; the next layer read by a thread meanwhile; hooks and masked
  running sums), and ``streamed, no prefetch`` without the thread;
- ``read``: one read of the weights the stream reads (every layer's tensors cast to the compute dtype, nothing run).

Prints tokens/s of each and the ratios: streamed / (read + plain) (target ≈ 1: gates cost one read of the weights
plus the prompts' forward), streamed / plain, streamed / (load + plain). Timings are the best of ``--repeats``
rounds run interleaved (a busy machine slows all alike); the page cache is warm (the model was just written or
read), so ``read`` is memory speed, not the disk's. Peak memory is the business of scripts/bench_build.py
(``--hidden-gates``) and scripts/bench_stream_70b.py. Runs on GPU too when one is present (not run on this
project's CPU-only machines).

Measured (2026-11-28, a 2-core x86-64 machine shared with other jobs, torch 2.13 CPU, transformers 5.24; page
cache warm): the default model with ``--threads 1 --repeats 7``: streamed 2.45 s, plain 2.50 s, whole capture
2.49 s (+0.09 s load): 0.98× (read + plain); the TinyLlama-shaped 1.1B (``--folder``, 8 prompts, 394 tokens,
``--repeats 2``): read 1.97 s, plain 13.97 s, streamed 15.99 s = 1.00× (read + plain), 0.90× (load 6.26 s + whole
capture 11.49 s); the reader thread saved 23 % there (19.63 s without it). Sums equal the whole model's in both.
(Those runs also timed the whole-model capture that gates used before they streamed; it is gone since.)

Usage: python scripts/bench_gates.py [--hidden 256 --layers 6 | --folder DENSE] [--batch-size 16 --repeats 3
       --prompts-per-expert 32 --threads N --json]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from moe_upcycle.checkpoint.source import open_checkpoint
from moe_upcycle.gates import batches, capture as cap
from moe_upcycle.gates.device import resolve_device
from moe_upcycle.gates.skeleton import layer_keys
from moe_upcycle.gates.stream import open_streamed
from moe_upcycle.recipe.prompt_sets import load_prompts, set_names
from moe_upcycle.checkpoint.tiny import make_dense_model

EXPERTS, PROMPTS_PER_EXPERT = 8, 32


def expert_prompts(per_expert: int = PROMPTS_PER_EXPERT) -> list[list[str]]:
    """8 groups of `per_expert` prompts, cycling through the shipped sets (deterministic)."""
    pool = [p for name in set_names() for p in load_prompts(name, "bench")]
    return [[pool[(e * per_expert + i) % len(pool)] for i in range(per_expert)] for e in range(EXPERTS)]


def read_all(streamed) -> None:
    """One read of what the stream reads: every layer's tensors (the last without its MLP) cast to the compute dtype,
    one layer at a time, nothing run."""
    sk = streamed.skeleton
    n = len(sk.layers)
    for layer in range(n):
        tensors = {k: streamed.checkpoint.read(k).to(sk.dtype) for k in
                   layer_keys(sk, layer, router_input_only=layer == n - 1).values()}
        del tensors


def plain_pass(model: torch.nn.Module, tokenizer, encoded: list[batches.Encoded], batch_size: int,
               full: bool) -> None:
    """The batches the stream runs (length-sorted, same padding) through `model` loaded whole, without hooks, sent to
    the device as the stream sends them (one copy per batch, from pinned memory on a GPU). (A pageable
    ``.to(device)`` per tensor would make the host wait for the GPU at every batch and flatter the stream at small
    batches.)"""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    module = model if full else model.base_model
    pad = batches.padding_id(tokenizer, model.get_input_embeddings().num_embeddings)
    dev = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            ids, attn, real = batches.pad_batch([encoded[i] for i in rows], pad, "right")
            on = batches.on_device(rows, ids, attn, real, None, dev)
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


def bench(folder: Path, device: str, batch_size: int, repeats: int, per_expert: int) -> dict:
    from transformers import AutoModelForCausalLM

    load_start = time.perf_counter()
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16 if dev != "cpu" else torch.float32)
    model = model.eval().to(dev)
    if device != "cpu":
        torch.cuda.synchronize()
    t_load = time.perf_counter() - load_start
    streamed = open_streamed(open_checkpoint(str(folder), "base_model"), device=device)
    unprefetched = open_streamed(open_checkpoint(str(folder), "base_model"), device=device, prefetch=False)
    groups, texts = [], []
    for e, prompts in enumerate(expert_prompts(per_expert)):
        texts += prompts
        groups += [e] * len(prompts)
    encoded = batches.encode(streamed.tokenizer, texts, streamed.max_length)
    tokens = sum(len(x.ids) for x in encoded)
    captured = {}

    def gates(model, key):
        return lambda: captured.__setitem__(key, cap.capture_router_inputs(model, encoded, groups, EXPERTS, "mean",
                                                                           batch_size))

    peaks = {}
    if device != "cpu":  # peak memory of one pass of each, measured apart from the timing
        for name, fn in (("plain", lambda: plain_pass(model, streamed.tokenizer, encoded, batch_size, full=False)),
                         ("streamed", gates(streamed, "streamed"))):
            torch.cuda.reset_peak_memory_stats()
            fn()
            peaks[name] = torch.cuda.max_memory_allocated()
    times = timed({"plain": lambda: plain_pass(model, streamed.tokenizer, encoded, batch_size, full=False),
                   "full": lambda: plain_pass(model, streamed.tokenizer, encoded, batch_size, full=True),
                   "streamed": gates(streamed, "streamed"),
                   "unprefetched": gates(unprefetched, "unprefetched"), "read": lambda: read_all(streamed)},
                  device, repeats)
    sums = captured["streamed"].sums
    same = torch.equal(captured["unprefetched"].sums, sums)
    t = times
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "dtype": str(streamed.skeleton.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompts": len(texts), "tokens": tokens, "batch_size": batch_size,
        "plain_tokens_per_s": round(tokens / t["plain"]), "plain_lm_head_tokens_per_s": round(tokens / t["full"]),
        "streamed_tokens_per_s": round(tokens / t["streamed"]),
        "seconds": {k: round(v, 3) for k, v in t.items()} | {"load": round(t_load, 3)},
        "streamed_vs_read_plus_plain": round(t["streamed"] / (t["read"] + t["plain"]), 3),
        "streamed_vs_plain": round(t["streamed"] / t["plain"], 3),
        "streamed_vs_load_plus_plain": round(t["streamed"] / (t_load + t["plain"]), 3),
        "prefetch_gain": round(t["unprefetched"] / t["streamed"], 3),
        "prefetch_changes_nothing": same,
        "running_sums_bytes": sums.numel() * sums.element_size(),
        "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": peaks or None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--folder", type=Path, default=None, help="benchmark this dense model instead of a new one")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts-per-expert", type=int, default=PROMPTS_PER_EXPERT)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or make_dense_model(
            Path(tmp) / "dense", family="llama", seed=0, hidden_size=args.hidden,
            intermediate_size=int(args.hidden * 2.75), num_hidden_layers=args.layers, num_attention_heads=8,
            num_key_value_heads=8, max_position_embeddings=1024)
        results = [bench(folder, d, args.batch_size, args.repeats, args.prompts_per_expert) for d in devices]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        s = r["seconds"]
        print(f"[{r['device']}, {r['dtype']}, {r['threads']} threads] {r['prompts']} prompts, {r['tokens']} tokens, "
              f"batch {r['batch_size']}, model {r['model_bytes'] / 1e6:.1f} MB")
        print(f"  plain decoder forward   : {s['plain']:8.2f} s  {r['plain_tokens_per_s']:>9} tokens/s")
        print(f"  plain + lm_head         : {s['full']:8.2f} s  {r['plain_lm_head_tokens_per_s']:>9} tokens/s")
        print(f"  one read of the weights : {s['read']:8.2f} s  (cast to {r['dtype']}, page cache warm)")
        print(f"  streamed gates          : {s['streamed']:8.2f} s  {r['streamed_tokens_per_s']:>9} tokens/s -> "
              f"{r['streamed_vs_read_plus_plain']:.3f}x (read + plain), {r['streamed_vs_plain']:.3f}x plain, "
              f"{r['streamed_vs_load_plus_plain']:.3f}x (load {s['load']:.2f} s + plain)")
        print(f"  streamed, no prefetch   : {s['unprefetched']:8.2f} s  -> the reader thread saves "
              f"{(r['prefetch_gain'] - 1) * 100:+.1f}%")
        print(f"  the same sums without prefetch: {r['prefetch_changes_nothing']}; running sums "
              f"{r['running_sums_bytes'] / 1e3:.1f} kB; process peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB"
              + (f"; peak GPU {r['peak_gpu_bytes']}" if r["peak_gpu_bytes"] else ""))


if __name__ == "__main__":
    main()
