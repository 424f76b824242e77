"""GPU figures for the research path (issue 16): gate capture vs a plain forward, upcycle_model on the GPU, and
the upcycle -> train -> save -> reload -> generate round trip for every init.

Three parts, each printed as a table (``--json`` for machine-readable output):

1. ``capture``: for each model shape (hidden x layers, random Llama weights made directly on the
   device in bf16, saved to a temporary folder) and batch size, tokens/s of the plain decoder forward of the model
   in memory and of the gates as a build computes them, `capture.capture_router_inputs` on the streamed base
   (`stream.open_streamed`: each layer read from the saved checkpoint), on the same batches (8 experts x 32 prompts,
   ``--prompts-per-expert``, from the shipped prompt sets, tokenized with stories260K's tokenizer), and their
   ratio.
   Timings are the best of ``--repeats`` interleaved rounds, with ``torch.cuda.synchronize``; the median of
   the rounds' own ratios is printed beside (at small batches the forward is bound by the host, whose speed drifts).
2. ``upcycle``: seconds for `upcycle_model` of the first shape's dense model (on the device, bf16) into
   8 experts, per init; and whether all parameters stayed on the device and in bf16.
3. ``round trip``: stories260K in bf16 on the device, per init: upcycle to 4 experts, ``--steps``
   AdamW steps with fp32 master weights + bf16 autocast (lr 1e-3), ``save_pretrained`` and
   ``from_pretrained(dtype="auto")`` in fp32 (the largest logit difference between the in-memory
   and the reloaded model, relative to max |logit|), then cast to bf16, saved, reloaded with
   dtype "auto" and ``generate`` run (the tokens it made and the experts_implementation it used).

``--device cpu`` with small ``--shapes``, ``--steps`` and ``--windows`` runs the same code on the CPU (a smoke
test, run by tests/test_bench_gpu_smoke.py).

Usage: python scripts/bench_gpu.py [--shapes 2048x16,4096x32 --batch-sizes 8,32,256 --repeats 3 --steps 50 --json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from bench_gates import plain_pass  # the same hook-free batches as the CPU benchmark
from moe_upcycle.checkpoint.source import open_checkpoint
from moe_upcycle.gates import batches, capture as cap
from moe_upcycle.gates.stream import open_streamed
from moe_upcycle import upcycle_model
from moe_upcycle.recipe.prompt_sets import load_prompts, set_names

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO / "tests" / "data" / "stories260K"
EXPERTS, PROMPTS_PER_EXPERT = 8, 32
INITS = {
    "copy": "copy",
    "noise": {"method": "noise", "scale": 0.01},
    "drop": {"method": "drop", "ratio": 0.5},
    "split": {"method": "split", "granularity": 2, "shuffle": True},
}


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def random_llama(hidden: int, layers: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Llama with random weights made on `device` (no files: a 7B shape takes seconds, not minutes)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 16 * 16, num_hidden_layers=layers,
                         num_attention_heads=max(hidden // 128, 1), num_key_value_heads=max(hidden // 128, 1),
                         vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def best_times(fns: dict, device: str, repeats: int) -> tuple[dict, list[dict]]:
    """Best wall time of each function, run interleaved (a, b, a, b...) after one warm-up each; and every round's
    times (a round's ratios are the least disturbed by a host that slows down for a while)."""
    best = {name: float("inf") for name in fns}
    rounds = []
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        rounds.append({})
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            rounds[-1][name] = time.perf_counter() - start
            best[name] = min(best[name], rounds[-1][name])
    return best, rounds


def median_ratio(rounds: list[dict], base: str, other: str) -> float:
    ratios = sorted(r[base] / r[other] for r in rounds)
    return round((ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2, 3)


def bench_capture(shapes, batch_sizes, device, repeats, tokenizer, per_expert: int = PROMPTS_PER_EXPERT,
                  show: Callable[[dict], None] = lambda row: None) -> list[dict]:
    pool = [p for name in set_names() for p in load_prompts(name, "bench")]
    texts = [pool[i % len(pool)] for i in range(EXPERTS * per_expert)]
    groups = [i // per_expert for i in range(len(texts))]
    encoded = batches.encode(tokenizer, texts, 2048)
    tokens = sum(len(e.ids) for e in encoded)
    rows = []
    for hidden, layers in shapes:
        dtype = torch.bfloat16 if device != "cpu" else torch.float32
        model = random_llama(hidden, layers, device, dtype)
        folder = tempfile.TemporaryDirectory()
        model.save_pretrained(folder.name)
        tokenizer.save_pretrained(folder.name)
        streamed = open_streamed(open_checkpoint(folder.name, "base_model"), device,
                                 str(dtype).removeprefix("torch."), tokenizer)
        for bs in batch_sizes:
            fns = {"plain": lambda b=bs: plain_pass(model, tokenizer, encoded, b, full=False),
                   "gates": lambda b=bs: cap.capture_router_inputs(streamed, encoded, groups, EXPERTS, "mean", b)}
            times, rounds = best_times(fns, device, repeats)
            rows.append({"hidden": hidden, "layers": layers, "batch_size": bs, "tokens": tokens,
                         "plain_tokens_per_s": round(tokens / times["plain"]),
                         "gates_tokens_per_s": round(tokens / times["gates"]),
                         "ratio": round(times["plain"] / times["gates"], 3),
                         "ratio_median_round": median_ratio(rounds, "plain", "gates")})
            show(rows[-1])
        folder.cleanup()
        del model, streamed
        if device != "cpu":
            torch.cuda.empty_cache()
    return rows


def bench_upcycle(shape, device) -> list[dict]:
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    dense = random_llama(*shape, device, dtype)
    rows = []
    for name, init in INITS.items():
        sync(device)
        start = time.perf_counter()
        moe = upcycle_model(dense, num_experts=EXPERTS, experts_per_token=2, expert_init=init, seed=0)
        sync(device)
        seconds = time.perf_counter() - start
        kept = {(p.device.type, p.dtype) for p in moe.parameters()} == {(torch.device(device).type, dtype)}
        rows.append({"hidden": shape[0], "layers": shape[1], "init": name, "seconds": round(seconds, 2),
                     "device_and_dtype_kept": kept,
                     "params_b": round(sum(p.numel() for p in moe.parameters()) / 1e9, 2)})
        del moe
        if device != "cpu":
            torch.cuda.empty_cache()
    return rows


def lm_loss(model, ids: torch.Tensor) -> float:
    with torch.inference_mode(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits.float()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def bench_round_trip(device, steps, tokenizer, windows: int = 32) -> list[dict]:
    from transformers import AutoModelForCausalLM

    text = " ".join(p for name in set_names() for p in load_prompts(name, "round trip"))
    ids = torch.tensor(tokenizer(text)["input_ids"][: 64 * windows]).view(windows, 64).to(device)
    dense = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.bfloat16).to(device)
    rows = []
    for name, init in INITS.items():
        start = time.perf_counter()
        # fp32 master weights (the dense model stays bf16), bf16 autocast for the matmuls
        moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=init, seed=0, dtype="float32",
                            router_aux_loss_coef=0.01, output_router_logits=True)
        before = lm_loss(moe.eval(), ids)
        opt = torch.optim.AdamW(moe.parameters(), lr=1e-3, weight_decay=0.0)
        gen = torch.Generator().manual_seed(0)
        moe.train()
        for _ in range(steps):
            batch = ids[torch.randint(len(ids), (min(16, windows),), generator=gen).to(device)]
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                moe(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        after = lm_loss(moe.eval(), ids)
        with tempfile.TemporaryDirectory() as tmp:
            moe.save_pretrained(f"{tmp}/fp32")  # the trained master weights: reload must give the same logits
            reloaded = AutoModelForCausalLM.from_pretrained(f"{tmp}/fp32", dtype="auto").to(device).eval()
            with torch.inference_mode():
                a, b = moe(input_ids=ids[:2]).logits.float(), reloaded(input_ids=ids[:2]).logits.float()
            # ship in bf16 (buffers are not saved, so casting the module in place is harmless for the file)
            moe.to(torch.bfloat16).save_pretrained(f"{tmp}/bf16")
            shipped = AutoModelForCausalLM.from_pretrained(f"{tmp}/bf16", dtype="auto").to(device).eval()
            with torch.inference_mode():
                out = shipped.generate(input_ids=ids[:1, :16], max_new_tokens=16, do_sample=False,
                                       pad_token_id=tokenizer.eos_token_id)
        sync(device)
        rows.append({"init": name, "loss_before": round(before, 4), "loss_after": round(after, 4),
                     "max_logit_diff_rel_fp32": float((a - b).abs().max() / a.abs().max()),
                     "shipped_dtype": str(next(shipped.parameters()).dtype).removeprefix("torch."),
                     "experts_implementation": shipped.config._experts_implementation,
                     "generated_tokens": int(out.shape[1] - 16), "seconds": round(time.perf_counter() - start, 2)})
    return rows


def show_capture(r: dict) -> None:
    print(f"capture {r['hidden']}x{r['layers']} batch {r['batch_size']:>3}: "
          f"plain {r['plain_tokens_per_s']:>9} tok/s, gates {r['gates_tokens_per_s']:>9} tok/s, "
          f"ratio {r['ratio']:.3f}, median round {r['ratio_median_round']:.3f} ", flush=True)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="2048x16,4096x32", help="hidden x layers, comma separated")
    parser.add_argument("--batch-sizes", default="8,32,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts-per-expert", type=int, default=PROMPTS_PER_EXPERT,
                        help="capture: prompts per expert (8 experts); more make each timed pass longer and steadier")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--windows", type=int, default=32, help="round trip: 64-token windows of text (batches of 16)")
    parser.add_argument("--skip", default="",
                        help="parts to skip: capture,upcycle,roundtrip")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device; pass --device cpu with small --shapes for a smoke test")
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(STORIES))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    shapes, skip = parse_shapes(args.shapes), set(args.skip.split(","))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    out = {"device": device_name, "torch": torch.__version__}
    if not args.json:
        print(f"[{device_name}, torch {torch.__version__}]", flush=True)
    if "capture" not in skip:  # each row is printed as it is measured: a run cut off at a limit keeps its rows
        out["capture"] = bench_capture(shapes, batch_sizes, args.device, args.repeats, tokenizer,
                                       args.prompts_per_expert,
                                       show=show_capture if not args.json else lambda row: None)
    if "upcycle" not in skip:
        out["upcycle"] = bench_upcycle(shapes[0], args.device)
    if "roundtrip" not in skip:
        out["round_trip"] = bench_round_trip(args.device, args.steps, tokenizer, args.windows)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for r in out.get("upcycle", []):
        print(f"upcycle_model {r['hidden']}x{r['layers']} -> {EXPERTS} experts ({r['params_b']} B params), "
              f"{r['init']:<5}: {r['seconds']:6.2f} s, device and dtype kept: {r['device_and_dtype_kept']}")
    for r in out.get("round_trip", []):
        print(f"round trip {r['init']:<5}: loss {r['loss_before']:.3f} -> {r['loss_after']:.3f} ({args.steps} steps), "
              f"fp32 reload logits rel diff {r['max_logit_diff_rel_fp32']:.1e}, shipped {r['shipped_dtype']} / "
              f"{r['experts_implementation']} generated {r['generated_tokens']} tokens, {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
