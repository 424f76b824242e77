#!/usr/bin/env python
"""Check `moe-upcycle plan`'s memory figures against what a build and a gate computation really use.

For each case (a dense model, a recipe) it runs, each as its own process:

1. ``python -m moe_upcycle plan CONFIG --json``: the predicted figures (`planning.memory`);
2. ``python -m moe_upcycle -q build CONFIG OUT --no-lint``: the real build (the prompt lint's
   embedder, ``lint_bytes`` of the prediction, is left out of the comparison, except in the case
   marked "with lint", built without ``--no-lint``);
3. the gate computation alone (`gates.router.compute_gate_rows` after the same imports as the CLI).

Each child is sampled every 5 ms from ``/proc/<pid>/status``: RssAnon (private memory), RssFile and
VmHWM, the kernel's high-water mark of RSS (``wait4``'s ru_maxrss is not used: Linux carries it
over from the forking parent across exec, so a large parent inflates it). It prints, per case and figure, predicted vs measured and
their ratio, and exits 1 if any ratio is outside 1 ± `TOLERANCE`. Figures compared:

- build private: peak RssAnon of the build vs ``build_private_bytes`` (the larger of gates and writing);
- build RSS: peak RSS (VmHWM) of the build vs ``build_rss_bytes`` (private + runtime files + mapped input);
- gates private: peak RssAnon of the gate computation vs ``gate_private_bytes``.

Cases: stories260K (vendored) → 4 experts, random and hidden gates; a SmolLM2-135M-shaped random bf16
model → 8 experts, random and hidden gates (``--quick`` stops here); a TinyLlama-shaped 1.1B bf16
model → 4 and 8 copies, noise and drop inits, a float16 output (a dtype change) and hidden-state gates (streamed
one layer at a time). The dense models
are written under ``--work`` once and reused (the TinyLlama one with ``scripts/bench_build.py``'s
writer, or pass ``--tinyllama FOLDER``). Outputs are deleted after each build.

Not a test (nothing here runs in CI); it does not drop the page cache.

Usage:
    python scripts/bench_plan_memory.py [--quick] [--work /tmp/moe-plan-bench] [--tinyllama /tmp/moe-bench/dense]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SAMPLE_SECONDS = 0.005
TOLERANCE = 0.25
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048)
PROMPTS_PER_EXPERT = 4
PROMPT_SETS = ("code", "math", "chat", "creative", "multilingual", "reasoning", "science")
GATES_ONLY = """
import sys
import moe_upcycle.cli.commands  # the CLI's imports, so the runtime is the build's
from moe_upcycle.terminal.allocator import return_large_frees
return_large_frees()  # as the CLI does
from moe_upcycle.build import prepare
from moe_upcycle.gates.router import compute_gate_rows
from moe_upcycle.recipe.resolve import gate_params
config, sources, plan = prepare(sys.argv[1])
compute_gate_rows(gate_params(config), plan, sources[config.base_model]).routers
"""


@dataclass
class Peak:
    """What one measured process used, in bytes."""

    anon: int = 0  # max sampled RssAnon
    rss: int = 0  # VmHWM (the kernel's own high-water mark of RSS), last sample before exit
    file: int = 0  # max sampled RssFile
    seconds: float = 0.0
    rc: int = 0


@dataclass
class Case:
    """One recipe to plan, build and measure."""

    name: str
    recipe: dict
    quick: bool = True
    lint: bool = False  # build with the prompt lint (the default build), else --no-lint
    predicted: dict = field(default_factory=dict)
    build: Optional[Peak] = None
    gates: Optional[Peak] = None


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def measure(cmd: list[str], log: Path, env: dict) -> Peak:
    """Run `cmd`, sampling its RssAnon/RssFile until it exits; peak RSS from wait4."""
    peak = Peak()
    stop = threading.Event()
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)

        def sample() -> None:
            while not stop.is_set():
                s = _status(proc.pid)
                peak.anon = max(peak.anon, s.get("RssAnon", 0))
                peak.file = max(peak.file, s.get("RssFile", 0))
                peak.rss = max(peak.rss, s.get("VmHWM", 0), s.get("RssAnon", 0) + s.get("RssFile", 0))
                time.sleep(SAMPLE_SECONDS)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, _ = os.wait4(proc.pid, 0)
        peak.seconds = time.perf_counter() - t0
        proc.returncode = peak.rc = os.waitstatus_to_exitcode(status)
        stop.set()
        sampler.join()
    if peak.rc != 0:
        print(f"--- {' '.join(cmd[:6])} failed (exit {peak.rc}):\n{log.read_text(errors='replace')[-3000:]}",
              file=sys.stderr)
    return peak


def ensure_smollm2(folder: Path) -> Path:
    """A SmolLM2-135M-shaped Llama (tied embeddings), random bf16 weights, written once."""
    if (folder / ".complete").is_file():
        return folder
    import torch

    from moe_upcycle.checkpoint.tiny import make_dense_model

    shutil.rmtree(folder, ignore_errors=True)
    make_dense_model(folder, family="llama", seed=0, tie_word_embeddings=True, dtype=torch.bfloat16,
                     initializer_range=0.02, **SMOLLM2_135M)
    (folder / ".complete").write_text("")
    return folder


def ensure_tinyllama(folder: Path) -> Path:
    from bench_build import (
        ensure_dense_model,  # scripts/ is on sys.path when run as a script
    )

    return ensure_dense_model(folder)


def prompt_experts(dense: Path, n: int) -> list[dict]:
    """`n` experts with the first `PROMPTS_PER_EXPERT` prompts of the shipped sets (a few full batches, not
    all ~200 prompts: memory depends on the batch, not on how many batches run)."""
    from moe_upcycle.recipe.prompt_sets import load_prompts

    return [{"source_model": str(dense), "positive_prompts":
             load_prompts(PROMPT_SETS[e % len(PROMPT_SETS)], "bench")[:PROMPTS_PER_EXPERT]} for e in range(n)]


TINYLLAMA_CASES = ("TinyLlama x4 copy", "TinyLlama x8 copy", "TinyLlama x4 noise", "TinyLlama x4 drop",
                   "TinyLlama x4 float16", "TinyLlama x4 hidden")


def cases(work: Path, quick: bool, tinyllama: Optional[Path], only: str = "") -> list[Case]:
    stories = REPO / "tests" / "data" / "stories260K"
    smol = ensure_smollm2(work / "smollm2-135m")
    out = [
        Case("stories260K x4 random", {"base_model": str(stories), "num_experts": 4, "gate_mode": "random"}),
        Case("stories260K x4 hidden", {"base_model": str(stories), "gate_mode": "hidden",
                                       "experts": prompt_experts(stories, 4)}),
        Case("stories260K x4 hidden, with lint", {"base_model": str(stories), "gate_mode": "hidden",
                                                  "experts": prompt_experts(stories, 4)}, lint=True),
        Case("SmolLM2-135M x8 random", {"base_model": str(smol), "num_experts": 8, "gate_mode": "random"}),
        Case("SmolLM2-135M x8 hidden", {"base_model": str(smol), "gate_mode": "hidden",
                                        "experts": prompt_experts(smol, 8)}),
        Case("SmolLM2-135M x8 cheap_embed", {"base_model": str(smol), "gate_mode": "cheap_embed",
                                             "experts": prompt_experts(smol, 8)}),
        Case("SmolLM2-135M x4 noise + init drift", {"base_model": str(smol), "num_experts": 4, "gate_mode": "random",
                                                    "expert_init": {"method": "noise", "scale": 0.01}}),
    ]
    if quick or not any(only in name for name in TINYLLAMA_CASES):
        return out
    big = ensure_tinyllama(tinyllama or work / "dense-tinyllama")
    base = {"base_model": str(big), "gate_mode": "random", "experts_per_token": 2}
    out += [
        Case("TinyLlama x4 copy", {**base, "num_experts": 4}, quick=False),
        Case("TinyLlama x8 copy", {**base, "num_experts": 8}, quick=False),
        Case("TinyLlama x4 noise", {**base, "num_experts": 4, "expert_init": {"method": "noise", "scale": 0.01}},
             quick=False),
        Case("TinyLlama x4 drop", {**base, "num_experts": 4, "expert_init": {"method": "drop", "ratio": 0.5}},
             quick=False),
        Case("TinyLlama x4 float16", {**base, "num_experts": 4, "dtype": "float16"}, quick=False),
        Case("TinyLlama x4 hidden", {**base, "gate_mode": "hidden", "experts": prompt_experts(big, 4)}, quick=False),
    ]
    return out


def run_case(case: Case, work: Path, env: dict) -> None:
    import yaml

    slug = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in case.name)
    cfg = work / f"{slug}.yaml"
    cfg.write_text(yaml.safe_dump(case.recipe, sort_keys=False))
    plan = subprocess.run([sys.executable, "-m", "moe_upcycle", "-q", "plan", str(cfg), "--json"], env=env,
                          cwd=REPO, capture_output=True, text=True)
    if plan.returncode != 0:
        raise SystemExit(f"plan failed for {case.name}:\n{plan.stderr}")
    case.predicted = json.loads(plan.stdout)["memory"]
    out = work / f"out-{slug}"
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    lint = [] if case.lint else ["--no-lint"]
    case.build = measure([sys.executable, "-m", "moe_upcycle", "-q", "build", str(cfg), str(out), *lint],
                         work / f"{slug}.build.log", env)
    shutil.rmtree(out, ignore_errors=True)
    case.gates = measure([sys.executable, "-c", GATES_ONLY, str(cfg)], work / f"{slug}.gates.log", env)


def rows(case: Case) -> list[tuple[str, int, int]]:
    """(figure, predicted, measured) of one measured case."""
    p = case.predicted
    lint = 0 if case.lint else p["lint_bytes"]
    return [("build private", p["build_private_bytes"] - lint, case.build.anon),
            ("build RSS", p["build_rss_bytes"] - lint, case.build.rss),
            ("gates private", p["gate_private_bytes"], case.gates.anon)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the small cases (stories260K, SmolLM2-135M)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-plan-bench"))
    parser.add_argument("--tinyllama", type=Path, default=None,
                        help="an existing TinyLlama-shaped dense folder (default: write one under --work)")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    todo = [c for c in cases(args.work, args.quick, args.tinyllama, args.only) if args.only in c.name]
    bad = 0
    results = []
    print("| case | figure | predicted (MB) | measured (MB) | ratio |\n|---|---|---:|---:|---:|")
    for case in todo:
        run_case(case, args.work, env)
        if case.build.rc or case.gates.rc:
            bad += 1
            continue
        for figure, predicted, measured in rows(case):
            ratio = predicted / measured if measured else float("inf")
            flag = "" if abs(ratio - 1) <= TOLERANCE else "  <-- outside ±25%"
            bad += bool(flag)
            print(f"| {case.name} | {figure} | {predicted / 1e6:.0f} | {measured / 1e6:.0f} | {ratio:.2f}{flag} |",
                  flush=True)
            results.append({"case": case.name, "figure": figure, "predicted": predicted, "measured": measured,
                            "ratio": round(ratio, 3)})
        results.append({"case": case.name, "build_seconds": round(case.build.seconds, 1),
                        "build_rss_file_peak": case.build.file, "gates_rss": case.gates.rss})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{bad} figure(s) outside ±{TOLERANCE:.0%}" if bad else f"all figures within ±{TOLERANCE:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
