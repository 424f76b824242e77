#!/usr/bin/env python
"""Benchmark `moe-upcycle verify` on a SmolLM2-135M-shaped 8-expert MoE against the least it must do.

What it does:
1. Writes a SmolLM2-135M-shaped dense Llama (hidden 576, intermediate 1536, 30 layers, 9 heads /
   3 KV heads, vocab 49152, tied embeddings, bf16, about 0.27 GB) with random weights straight
   into one safetensors file under ``--work`` (reused when present; no transformers init), with a
   byte-level BPE tokenizer trained offline on the package's shipped prompt sets and README (its
   vocabulary is smaller than 49152; the table says how many tokens the verify text becomes).
2. Upcycles it with ``python -m moe_upcycle build`` to 8 experts, top-2, ``gate_mode: random``,
   bf16 (about 1.4 GB; reused when present).
3. ``--rounds`` times in turn, each as its own process:
   - the *baseline*: a small script that loads the MoE and the dense base with
     ``AutoModelForCausalLM`` in fp32 (the dtype verify compares in) and runs one forward pass of
     each over the package's verify text (moe_upcycle/data/verify_text.txt), tokenized once by the
     MoE's tokenizer and cut as verify cuts it — the least a comparison of the two models can do;
   - ``python -m moe_upcycle -q verify FOLDER`` with its defaults (sha256 check included).
   Each child's wall time, exact peak RSS (``wait4`` rusage) and peak anonymous memory (RssAnon
   sampled every 20 ms) are measured by `bench_build.measure`.
4. Prints a markdown table: per round the two wall times and the ratio verify/baseline, the
   median ratio against the target (≤ 2×), and verify's peak RSS against the bound: the two
   models' size in fp32 (parameters × 4 bytes, from the safetensors headers) + 1 GB.

What it does not do: it is not a test (nothing here runs in CI), and it does not drop the page
cache (both children read the same cached files). The models are kept for the next run.

Usage:
    python scripts/bench_verify.py [--work /tmp/moe-verify-bench] [--rounds 3] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_build import (  # one way of measuring a child, and of writing a random Llama
    GB,
    Run,
    _median,
    dense_tensor_shapes,
    measure,
    settle,
)

SMOLLM2_135M = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True, "bos_token_id": 1,
    "eos_token_id": 2, "initializer_range": 0.02,
}
EXPERTS = 8
TARGET_RATIO = 2.0

# The baseline: both models in fp32, one forward pass each over the verify text, nothing else.
BASELINE_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from moe_upcycle.check.compare import MAX_TEXT_TOKENS
from moe_upcycle.check.verify import default_text
moe_dir, dense_dir = sys.argv[1], sys.argv[2]
ids = AutoTokenizer.from_pretrained(moe_dir)(default_text(), return_tensors="pt")["input_ids"][:, :MAX_TEXT_TOKENS]
for folder in (moe_dir, dense_dir):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert bool(logits.isfinite().all())
    del model, logits
print(ids.shape[1])
"""


def tokenizer_corpus() -> list[str]:
    """Text the bench tokenizer is trained on: the shipped prompt sets and the README (not the verify text)."""
    import yaml

    texts = []
    for path in sorted((REPO / "moe_upcycle" / "data" / "prompts").glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        texts += [str(p) for p in (data.get("prompts", []) if isinstance(data, dict) else data or [])]
    texts += (REPO / "README.md").read_text(encoding="utf-8").split("\n\n")
    return texts


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE trained offline (same construction as `checkpoint.tiny.make_tokenizer`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))


def ensure_dense_model(folder: Path) -> Path:
    """Write the random SmolLM2-135M-shaped checkpoint once (a `.complete` marker says it is whole)."""
    if (folder / ".complete").is_file():
        return folder
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in dense_tensor_shapes(SMOLLM2_135M).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "attention_bias": False, "mlp_bias": False, **SMOLLM2_135M}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    make_tokenizer(folder, SMOLLM2_135M["vocab_size"])
    (folder / ".complete").write_text("")
    return folder


def ensure_moe(work: Path, dense: Path, env: dict) -> Path:
    """Upcycle `dense` to `EXPERTS` experts with the real CLI, once."""
    import yaml

    out = work / f"moe-{EXPERTS}x"
    if (out / ".complete").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    cfg = {"base_model": str(dense), "gate_mode": "random", "dtype": "bfloat16", "experts_per_token": 2,
           "num_experts": EXPERTS}
    path = work / f"experts{EXPERTS}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    subprocess.run([sys.executable, "-m", "moe_upcycle", "-q", "build", str(path), str(out), "--no-lint"],
                   check=True, cwd=REPO, env=env)
    (out / ".complete").write_text("")  # not listed in moe_upcycle.json: verify ignores it
    return out


def fp32_bytes(folder: Path) -> int:
    """Parameters × 4 bytes, from the safetensors headers (tied embeddings stored once)."""
    from moe_upcycle.check.verify import check_files
    from moe_upcycle.check.verify_report import VerifyResult

    numel = 0
    for info in check_files(folder, VerifyResult(folder=str(folder))).values():
        n = 1
        for d in info.shape:
            n *= d
        numel += n
    return 4 * numel


def bench(work: Path, rounds: int, verify_args: list[str], threads: int | None = None) -> tuple[list[Run], dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    dense = ensure_dense_model(work / "dense-smollm2-135m")
    moe = ensure_moe(work, dense, env)
    facts = {"moe_fp32": fp32_bytes(moe), "dense_fp32": fp32_bytes(dense),
             "moe_disk": sum(p.stat().st_size for p in moe.glob("*.safetensors"))}
    runs: list[Run] = []
    for round_ in range(rounds):
        settle()
        log = work / "baseline.log"
        runs.append(measure([sys.executable, "-c", BASELINE_SCRIPT, str(moe), str(dense)],
                            Run("baseline", EXPERTS, round_), log, env))
        facts["text_tokens"] = log.read_text().strip().splitlines()[-1] if runs[-1].rc == 0 else "?"
        settle()
        runs.append(measure([sys.executable, "-m", "moe_upcycle", "-q", "verify", str(moe), *verify_args],
                            Run("verify", EXPERTS, round_), work / "verify.log", env))
    return runs, facts


def report(runs: list[Run], facts: dict) -> str:
    bound = facts["moe_fp32"] + facts["dense_fp32"] + GB
    rows = [("| round | baseline wall (s) | verify wall (s) | verify / baseline | baseline CPU (s) | verify CPU (s) | "
             "baseline peak RSS (GB) | verify peak RSS (GB) | verify peak anon (GB) |"),
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios, peaks = [], []
    for round_ in sorted({r.round for r in runs}):
        b = next(r for r in runs if r.round == round_ and r.label == "baseline")
        v = next(r for r in runs if r.round == round_ and r.label == "verify")
        ok = b.rc == 0 and v.rc == 0
        ratio = v.wall_s / b.wall_s if ok else float("nan")
        if ok:
            ratios.append(ratio)
            peaks.append(v.peak_rss)
        rows.append(f"| {round_} | {b.wall_s:.1f} | {v.wall_s:.1f}{'' if v.rc == 0 else f' (exit {v.rc})'} | "
                    f"{ratio:.2f}× | {b.cpu_s:.1f} | {v.cpu_s:.1f} | {b.peak_rss / GB:.2f} | {v.peak_rss / GB:.2f} | "
                    f"{v.peak_anon / GB:.2f} |")
    lines = rows + [""]
    if ratios:
        med = _median(ratios)
        peak = max(peaks)
        lines.append(f"- median verify / baseline: {med:.2f}× (target ≤ {TARGET_RATIO:g}×): "
                     f"{'met' if med <= TARGET_RATIO else 'MISSED'}")
        lines.append(f"- verify's peak RSS, largest round: {peak / GB:.2f} GB; bound = MoE fp32 "
                     f"{facts['moe_fp32'] / GB:.2f} GB + dense fp32 {facts['dense_fp32'] / GB:.2f} GB + 1 GB = "
                     f"{bound / GB:.2f} GB: {'met' if peak <= bound else 'MISSED'}")
    else:
        lines.append("- no round where both commands succeeded (see the logs in the work folder)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, help="work folder (default: a new temporary folder; ~2 GB)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both commands, run in turn")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both children (default: torch's own)")
    parser.add_argument("--verify-args", default="", help="extra verify options, e.g. '--max-new-tokens 16'")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="moe-verify-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs, facts = bench(work, args.rounds, args.verify_args.split(), args.threads)
    import torch

    text = "\n".join([
        (f"SmolLM2-135M-shaped dense Llama (30 layers, hidden 576, intermediate 1536, vocab 49152, tied, bf16) "
        f"upcycled to {EXPERTS} experts, top-2, random gates (MoE {facts['moe_disk'] / GB:.2f} GB on disk); "
        f"verify text {facts['text_tokens']} tokens; verify options: {args.verify_args or 'defaults'}; OMP_NUM_THREADS {args.threads or 'unset'}; {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"load average {os.getloadavg()[0]:.1f}; work folder {work}; {time.perf_counter() - t0:.0f}s in all."),
        "",
        report(runs, facts),
    ])
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
