#!/usr/bin/env python
"""Hidden-state gates on a model with Llama-3-70B layer shapes: peak memory is one layer plus activations.

What it does:
1. Writes, under ``--work`` (reused when complete), a dense Llama with Llama-3-70B's shapes — hidden 8192,
   intermediate 28672, 64 heads / 8 KV heads, vocab 128256, untied head — but only ``--layers`` (default 3)
   decoder layers, in bf16: ~1.71 GB per layer, ~2.1 GB each for the embedding and the head, one shard file per
   layer (values: a seeded random block tiled, so writing takes seconds).
2. Measures, each as its own process sampled every 5 ms from ``/proc/<pid>/status`` (RssAnon, RssFile):
   - ``runtime``: the CLI's imports, the recipe planned (``build.prepare``), no gates — the baseline;
   - ``gates fp32``: the same, then `gates.router.compute_gate_rows` with ``gate_mode: hidden`` on the CPU (fp32, the
     default: each bf16 layer is cast to fp32, 3.4 GB);
   - ``gates bf16``: the same with ``gate_dtype: bfloat16`` (a layer stored in the compute dtype runs on the mapped
     file: no private copy of it).
   And the plan's estimate (``plan --json``: ``gate_private_bytes``) of each.
3. Prints per case: peak private (anonymous) memory, what the gates add over the runtime, that as a multiple of one
   layer in the compute dtype, peak file-backed (page cache) memory, seconds per layer; and, from
   `planning.memory` on config-only checkpoints, what a real Llama-3-70B (80 layers) and Llama-3.1-405B (hidden
   16384, intermediate 53248, 126 layers, 128 heads / 8 KV) need for gates on the CPU and on one GPU.

Not a test (nothing here runs in CI). It needs ~9.5 GB of disk and ~4 GB of free memory; the machine it ran on
was shared, so only the memory figures (and ratios within one run) mean much, not the seconds.

Usage:
    python scripts/bench_stream_70b.py [--work /tmp/moe-70b-bench] [--layers 3] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_plan_memory import measure  # noqa: E402  (scripts/ is on sys.path)

LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)
LLAMA31_405B = {**LLAMA3_70B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                "num_attention_heads": 128}
PROMPT_SETS = ("code", "math", "chat", "creative")
PROMPTS_PER_EXPERT = 8
GB, MB = 1e9, 1e6

GATES = """
import json, sys, time
import moe_upcycle.cli.commands  # the CLI's imports, so the runtime is the build's
from moe_upcycle.terminal.allocator import return_large_frees
return_large_frees()  # as the CLI does
from moe_upcycle.build import prepare
from moe_upcycle.gates.router import compute_gate_rows
from moe_upcycle.recipe.resolve import gate_params
config, sources, plan = prepare(sys.argv[1])
if sys.argv[2] == "gates":
    start = time.perf_counter()
    gates = compute_gate_rows(gate_params(config), plan, sources[config.base_model]).routers
    print(json.dumps({"seconds": time.perf_counter() - start, "layers": len(gates),
                      "finite": all(bool(g.isfinite().all()) for g in gates.values())}))
"""


def shapes(dims: dict, layers: int) -> dict[str, tuple[int, ...]]:
    """Llama tensor names and shapes, `layers` decoder layers."""
    h, i, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    kv = dims["num_key_value_heads"] * (h // dims["num_attention_heads"])
    out = {"model.embed_tokens.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def ensure_model(folder: Path, layers: int) -> Path:
    """Write the 70B-shaped checkpoint once, a shard per layer (a `.complete` marker says it is whole)."""
    if (folder / ".complete").is_file():
        return folder
    import torch
    from safetensors.torch import save_file

    from moe_upcycle.checkpoint.tiny import make_tokenizer

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    block = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    groups: dict[str, list[str]] = {}
    for name in shapes(LLAMA3_70B, layers):
        part = name.split(".")[2] if name.startswith("model.layers.") else name.split(".")[-2]
        groups.setdefault(part, []).append(name)
    weight_map = {}
    for k, (part, names) in enumerate(groups.items()):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes(LLAMA3_70B, layers)[name]
            n = math.prod(shape)
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = block.repeat(-(-n // block.numel()))[:n].view(shape).clone()
            weight_map[name] = file
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "attention_bias": False, "mlp_bias": False, **LLAMA3_70B, "num_hidden_layers": layers}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    make_tokenizer(folder)
    (folder / ".complete").write_text("")
    return folder


def recipe(work: Path, dense: Path, name: str, **extra) -> Path:
    import yaml

    from moe_upcycle.recipe.prompt_sets import load_prompts

    cfg = {"base_model": str(dense), "gate_mode": "hidden", "device": "cpu", "experts_per_token": 2,
           "experts": [{"source_model": str(dense), "positive_prompts": load_prompts(s, "bench")[:PROMPTS_PER_EXPERT]}
                       for s in PROMPT_SETS], **extra}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def predicted(cfg: Path, env: dict) -> dict:
    run = subprocess.run([sys.executable, "-m", "moe_upcycle", "-q", "plan", str(cfg), "--json"], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout)["memory"]


def real_model_needs() -> list[str]:
    """What gates need for a real Llama-3-70B and Llama-3.1-405B, from `planning.memory` on config-only sources."""
    from moe_upcycle import load_config
    from moe_upcycle.checkpoint.meta_model import describe_dense
    from moe_upcycle.checkpoint.source import meta_checkpoint
    from moe_upcycle.planning.memory import estimate_memory, layer_bytes
    from moe_upcycle.planning.plan import make_plan
    from moe_upcycle.recipe.prompt_sets import load_prompts
    from moe_upcycle.recipe.resolve import check_params, gate_params, write_params

    import torch

    lines = []
    for name, dims in (("Llama-3-70B", LLAMA3_70B), ("Llama-3.1-405B", LLAMA31_405B)):
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", **dims}
        ref = f"meta/{name}"
        sources = {ref: meta_checkpoint(ref, config, describe_dense(config))}
        weights = sum(t.nbytes for t in sources[ref].tensors.values())
        for device in ("cpu", "cuda"):
            cfg = load_config({"base_model": ref, "gate_mode": "hidden", "device": device, "experts": [
                {"source_model": ref, "positive_prompts": load_prompts(s, "bench")[:PROMPTS_PER_EXPERT]}
                for s in PROMPT_SETS]})
            plan = make_plan(cfg, sources)
            m = estimate_memory(plan, gate_params(cfg), write_params(cfg), check_params(cfg), sources, ref)
            stored, _ = layer_bytes(sources[ref], torch.bfloat16, copied=True)
            where = (f"CPU: {m.gate_private_bytes / GB:.1f} GB private (one layer in fp32 "
                     f"{2 * stored / GB:.1f} GB)" if device == "cpu" else
                     f"one GPU: {m.gpu_bytes / GB:.1f} GB of GPU memory (two bf16 layers of {stored / GB:.2f} GB), "
                     f"{m.gate_private_bytes / GB:.1f} GB host")
            lines.append(f"- {name} ({dims['num_hidden_layers']} layers, {weights / GB:.0f} GB bf16; loading it whole "
                         f"took {2 * weights / GB:.0f} GB fp32 on the CPU): gates on the {where}; every byte read "
                         f"once ({weights / GB:.0f} GB from disk, less the head)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-70b-bench"))
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the model (default: delete it at the end)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    dense = ensure_model(args.work / "llama3-70b-shaped", args.layers)
    h, i = LLAMA3_70B["hidden_size"], LLAMA3_70B["intermediate_size"]
    kv = LLAMA3_70B["num_key_value_heads"] * h // LLAMA3_70B["num_attention_heads"]
    layer_params = 2 * h * h + 2 * kv * h + 3 * i * h + 2 * h
    print(f"model: {dense} ({args.layers} layers; one layer {layer_params * 2 / GB:.2f} GB in bf16, "
          f"{layer_params * 4 / GB:.2f} GB in fp32)")
    cases = {"runtime": (recipe(args.work, dense, "fp32"), "runtime", 4),
             "gates fp32": (recipe(args.work, dense, "fp32"), "gates", 4),
             "gates bf16": (recipe(args.work, dense, "bf16", gate_dtype="bfloat16"), "gates", 2)}
    peaks = {}
    print("| case | peak private (GB) | over runtime (GB) | × one layer | peak page cache (GB) | s / layer | "
          "plan estimate (GB) | estimate / measured |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (cfg, what, itemsize) in cases.items():
        log = args.work / f"{name.replace(' ', '-')}.log"
        peak = measure([sys.executable, "-c", GATES, str(cfg), what], log, env)
        if peak.rc:
            return 1
        peaks[name] = peak
        out = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        per_layer = f"{out[0]['seconds'] / args.layers:.1f}" if out else "–"
        if out and not out[0]["finite"]:
            print(f"{name}: NaN/Inf in the routers", file=sys.stderr)
            return 1
        over = peak.anon - peaks["runtime"].anon
        layer = layer_params * itemsize
        estimate = predicted(cfg, env)["gate_private_bytes"] if what == "gates" else None
        print(f"| {name} | {peak.anon / GB:.2f} | {over / GB:.2f} | {over / layer:.2f} (of {layer / GB:.2f} GB) | "
              f"{peak.file / GB:.2f} | {per_layer} | " + (f"{estimate / GB:.2f} | {estimate / peak.anon:.2f} |"
                                                          if estimate else "– | – |"), flush=True)
    print("\nWhat real models need for hidden-state gates (planning.memory, 4 experts x 8 prompts):")
    print("\n".join(real_model_needs()))
    if not args.keep:
        shutil.rmtree(dense, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
