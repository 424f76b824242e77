"""Break the product on purpose and see the tests catch it: semantic mutations of the core, one at a time.

Each mutation replaces one snippet of one product file (it must occur exactly once) with a wrong version —
a wrong scale, a lost clone, a test of ownership that always says yes — in a scratch copy of the repository,
then runs the tests that should catch it there. A mutation is *caught* when those tests fail; a *survivor*
is a hole in the suite (or an equivalent mutation, which the table's `why` then says). A snippet that is no
longer in the file is reported *stale*: the table needs updating, not the product.

Not part of the suite (it runs the chosen tests once per mutation: 15–40 minutes on 2 cores).

    python scripts/mutation_check.py                 # every mutation, summary at the end
    python scripts/mutation_check.py --only gates     # mutations whose id contains "gates"
    python scripts/mutation_check.py --check          # only check that every snippet is still there
    python scripts/mutation_check.py --json out.json  # the results as JSON too

The tests run with ``-x -q`` in the scratch copy (``PYTHONPATH`` set to it), so the installed package is
never touched; the scratch copy is removed at the end.
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the mutations whose id contains this text")
    parser.add_argument("--check", action="store_true", help="only check that every snippet is still in its file")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one mutation's tests")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.only in m.id]
    stale = [m for m in chosen if (REPO / m.file).read_text().count(m.old) != 1]
    for m in stale:
        print(f"STALE {m.id}: the snippet is not in {m.file} exactly once", flush=True)
    if args.check:
        print(f"{len(chosen) - len(stale)} of {len(chosen)} mutations apply")
        return 1 if stale else 0
    results = []
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        scratch = Path(tmp) / "repo"
        shutil.copytree(REPO, scratch, ignore=shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info",
                                                                      "bench_out", "demo_out", "gpu_logs"))
        tf4 = REPO / ".venv-tf4"
        if tf4.exists():
            (scratch / ".venv-tf4").symlink_to(tf4)
        for m in chosen:
            if m in stale:
                results.append({"id": m.id, "result": "stale"})
                continue
            results.append(run_one(m, scratch, args.timeout))
            r = results[-1]
            print(f"{r['result'].upper():9} {m.id} ({r['seconds']:.0f} s){'' if r['result'] == 'caught' else ': ' + m.what}",
                  flush=True)
    caught = sum(r["result"] == "caught" for r in results)
    ran = sum(r["result"] in ("caught", "survived") for r in results)
    print(f"\n{caught} of {ran} mutations caught", end="")
    print(f"; {len(stale)} stale" if stale else "")
    for r in results:
        if r["result"] == "survived":
            m = next(x for x in MUTATIONS if x.id == r["id"])
            print(f"  survived: {m.id} — {m.what}" + (f" (equivalent: {m.why})" if m.why else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if caught == ran and not stale else 1


def run_one(m: "Mutation", scratch: Path, timeout: int) -> dict:
    """Apply `m` in the scratch copy, run its tests there, restore the file."""
    path = scratch / m.file
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new))
    env = {**os.environ, "PYTHONPATH": str(scratch), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        rc = done.returncode
        tail = done.stdout[-600:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, "timed out"
    finally:
        path.write_text(original)
    # 1: a test failed; 2/3/4: collection or usage broke (a mutation must stay importable, so that is a bug in
    # the table); 5: no test ran
    result = "caught" if rc == 1 else "survived" if rc == 0 else f"error (pytest exit {rc})"
    return {"id": m.id, "result": result, "seconds": time.monotonic() - start, "tail": tail if rc != 1 else ""}


@dataclass(frozen=True)
class Mutation:
    """One wrong version of one snippet of a product file, and the tests that must catch it."""

    id: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str
    why: str = ""  # set for a mutation known to be equivalent (no observable change), saying why


MUTATIONS: list[Mutation] = [
    # -- the writer and the plan's shards
    Mutation("writer-shard-size", "moe_upcycle/checkpoint/writer.py",
             "        size += spec.nbytes\n", "        size += spec.nbytes // 2\n",
             ("tests/test_docstring_examples.py", "tests/test_build.py"),
             "shards grow past max_shard_size"),
    Mutation("writer-header-dtype", "moe_upcycle/checkpoint/writer.py",
             '"dtype": DTYPE_NAMES[spec.dtype]', '"dtype": "F32" if spec.dtype == torch.bfloat16 else DTYPE_NAMES[spec.dtype]',
             ("tests/test_build.py", "tests/test_writer_hash.py"),
             "a bf16 tensor's header says F32"),
    # -- the executor: transforms and storage policy
    Mutation("execute-scale", "moe_upcycle/planning/execute.py",
             "            out *= value\n", "            out *= value * 1.01\n",
             ("tests/test_inits.py", "tests/test_mergekit_configs.py"),
             "residual_scale / split's down_proj scale off by 1 %"),
    Mutation("execute-abs-noise", "moe_upcycle/planning/execute.py",
             "device=dev).mul_(value)", "device=dev).mul_(value * 2)",
             ("tests/test_inits.py", "tests/test_mergekit_parity.py"),
             "mergekit's absolute noise_scale doubled"),
    Mutation("execute-clone-ignored", "moe_upcycle/planning/execute.py",
             "        if policy == \"clone\" and step.kind in (\"expert\", \"shared\"):\n            return base.clone()\n",
             "        if policy == \"clone\" and step.kind in (\"expert\", \"shared\"):\n            return base\n",
             ("tests/test_init_statistics.py", "tests/test_build.py"),
             "tensor_policy: clone shares storage anyway"),
    # -- expert inits
    Mutation("inits-rel-noise-std", "moe_upcycle/planning/inits.py",
             ".mul_(value * out.std()))", ".mul_(value * out.abs().mean()))",
             ("tests/test_init_statistics.py", "tests/test_inits.py"),
             "relative noise scaled by mean |W| instead of std(W)"),
    Mutation("inits-drop-mean", "moe_upcycle/planning/inits.py",
             ".mul_(out.std()).add_(out.mean())", ".mul_(out.std())",
             ("tests/test_init_statistics.py", "tests/test_inits.py"),
             "Drop-Upcycling's fresh neurons lose the matrix's mean"),
    Mutation("inits-drop-count", "moe_upcycle/planning/inits.py",
             "return int(ratio * intermediate + 0.5)", "return int(ratio * intermediate)",
             ("tests/test_inits.py", "tests/test_docstring_examples.py"),
             "drop count rounded down, not half up"),
    Mutation("inits-drop-shared-set", "moe_upcycle/planning/inits.py",
             "idx = drop_indices(n_neurons, value.ratio, seed, layer, expert, device=out.device)",
             "idx = drop_indices(n_neurons, value.ratio, seed, layer, expert + value.axis, device=out.device)",
             ("tests/test_init_statistics.py", "tests/test_inits.py"),
             "down_proj drops another neuron set than gate/up"),
    Mutation("inits-split-same-slice", "moe_upcycle/planning/inits.py",
             "keep = order[value.index * width:(value.index + 1) * width]", "keep = order[:width]",
             ("tests/test_inits.py",),
             "every split expert takes the first slice"),
    Mutation("inits-split-scale", "moe_upcycle/planning/inits.py",
             "            out.append((\"scale\", float(g)))", "            out.append((\"scale\", float(g) + 1))",
             ("tests/test_inits.py",),
             "split's down_proj scaled by G+1"),
    # -- the distributed split of the work
    Mutation("ranks-deal-balance", "moe_upcycle/distributed/shard_split.py",
             "while k < len(shard_bytes) and done + shard_bytes[k] / 2 < goal:",
             "while k < len(shard_bytes) and done + shard_bytes[k] < goal:",
             ("tests/test_docstring_examples.py", "tests/test_distributed_build.py"),
             "shards dealt by whole size, not by middle byte"),
    Mutation("ranks-rank-plan-all", "moe_upcycle/distributed/shard_split.py",
             "steps=tuple(s for s in plan.steps if s.name in wanted)", "steps=tuple(plan.steps)",
             ("tests/test_distributed_build.py",),
             "every rank writes every tensor"),
    # -- gates
    Mutation("gates-scale-x7", "moe_upcycle/gates/router.py",
             "return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12) * scale",
             "return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12) * scale * 7",
             ("tests/test_streamed_gates.py", "tests/test_hidden_gates.py", "tests/test_gates_basic.py"),
             "router rows 7x their scale"),
    Mutation("gates-default-scale", "moe_upcycle/gates/router.py",
             "return 16.0 / math.sqrt(hidden_size)", "return 8.0 / math.sqrt(hidden_size)",
             ("tests/test_gates_basic.py", "tests/test_hidden_gates.py", "tests/test_streamed_gates.py"),
             "the measured default router scale halved"),
    # -- recipe checks
    Mutation("recipe-topk-bound", "moe_upcycle/recipe/schema.py",
             "        if n and self.experts_per_token > n:", "        if n and self.experts_per_token > n + 1:",
             ("tests/test_bad_inputs.py", "tests/test_trust_recipe.py", "tests/test_hostile_args.py"),
             "experts_per_token = num_experts + 1 accepted"),
    # -- ownership: the tool removes only what it wrote
    Mutation("ownership-always-ours", "moe_upcycle/checkpoint/ownership.py",
             "def is_ours(folder: Path) -> bool:\n", "def is_ours(folder: Path) -> bool:\n    return True\n",
             ("tests/test_permissions.py", "tests/test_cli_build.py", "tests/test_trust_output.py"),
             "any folder is taken for one of ours (and replaced by --force)"),
    # -- LoRA merge
    Mutation("lora-scaling", "moe_upcycle/checkpoint/lora.py",
             "delta = (b @ a).mul_(pair.scaling)", "delta = (b @ a).mul_(pair.scaling * 2)",
             ("tests/test_lora.py",),
             "LoRA delta scaled twice"),
    # -- the name table: Mixtral's w1 is gate, w3 is up
    Mutation("names-mixtral-w1-w3", "moe_upcycle/checkpoint/names.py",
             '"gate_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight"',
             '"gate_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight"',
             ("tests/test_docstring_examples.py", "tests/test_build.py"),
             "gate_proj written under w3"),
    # -- output config
    Mutation("config-top-k", "moe_upcycle/planning/model_config.py",
             "num_experts_per_tok=plan.experts_per_token,", "num_experts_per_tok=max(1, plan.experts_per_token - 1),",
             ("tests/test_build.py", "tests/test_architectures.py"),
             "config.json's top-k one less than the recipe's"),
    # -- route: accuracy counting
    Mutation("route-overall-first-layer", "moe_upcycle/check/route_eval.py",
             "conf.index_put_((idx, routing.sum(1).argmax(-1))", "conf.index_put_((idx, routing[:, 0].argmax(-1))",
             ("tests/test_route_eval.py", "tests/test_route.py"),
             "the overall confusion matrix counts layer 0 only, not the majority over layers"),
]


if __name__ == "__main__":
    sys.exit(main())
