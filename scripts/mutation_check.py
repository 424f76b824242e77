"""Break the product on purpose and see the tests catch it: semantic mutations of the core, one at a time.

Each mutation replaces one snippet of one product file (it must occur exactly once) with a wrong version —
a wrong scale, a lost clone, a test of ownership that always says yes — in a scratch copy of the repository,
then runs the tests that should catch it there. A mutation is *caught* when those tests fail; a *survivor*
is a hole in the suite (or an equivalent mutation, which the table's `why` then says). A snippet that is no
longer in the file is reported *stale*: the table needs updating, not the product.

Not part of the suite (it runs the chosen tests once per mutation: 25–50 minutes on 2 cores for all of them).

    python scripts/mutation_check.py                 # every mutation, summary at the end
    python scripts/mutation_check.py --only gates     # mutations whose id contains "gates"
    python scripts/mutation_check.py --only agree,grow  # ... "agree" or "grow"
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
    parser.add_argument("--only", default="", help="run the mutations whose id contains this text "
                        "(several, comma-separated: any of them)")
    parser.add_argument("--check", action="store_true", help="only check that every snippet is still in its file")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for one mutation's tests")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if any(part in m.id for part in args.only.split(","))]
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


def run_one(m: Mutation, scratch: Path, timeout: int) -> dict:
    """Apply `m` in the scratch copy, run its tests there, restore the file."""
    path = scratch / m.file
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new))
    env = {**os.environ, "PYTHONPATH": str(scratch), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                              check=False, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
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
             ("tests/test_mutation_survivors.py::test_cheap_embed_rows_have_the_documented_length", "tests/test_gates_basic.py", "tests/test_hidden_gates.py", "tests/test_streamed_gates.py"),
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
    Mutation("route-overall-first-layer", "moe_upcycle/gates/self_check.py",
             "return counts.sum(dim=1).argmax(dim=-1)", "return counts[:, 0].argmax(dim=-1)",
             ("tests/test_route_eval.py", "tests/test_self_check.py"),
             "route --labeled and the self-check count layer 0 only, not the majority over layers"),
    # -- ranks agree before they write (distributed.agreement)
    Mutation("agree-seed-left-out", "moe_upcycle/distributed/agreement.py",
             '("recipe", "seed", f"seed {config.seed}")]', ']',
             ("tests/test_rank_agreement.py::test_the_first_difference_is_named_with_every_disagreeing_rank",),
             "the seed is not among the facts ranks compare (two seeds build one mixed model)"),
    Mutation("agree-plan-tensors-left-out", "moe_upcycle/distributed/agreement.py",
             "(sha256 {_digest([steps, shard_names])[:12]})", "(sha256 {_digest([shard_names])[:12]})",
             ("tests/test_rank_agreement.py::test_the_first_difference_is_named_with_every_disagreeing_rank",
              "tests/test_mutation_survivors.py::test_plans_that_write_other_bytes_are_other_facts"),
             "the plan's digest covers the shard layout only, not its tensors (shape, dtype, source, transforms)"),
    Mutation("agree-third-rank-unchecked", "moe_upcycle/distributed/agreement.py",
             'if len({r["digest"] for r in ranks}) == 1:', 'if len({r["digest"] for r in ranks[:2]}) == 1:',
             ("tests/test_mutation_survivors.py::test_a_third_rank_that_differs_is_refused",),
             "ranks after rank 1 are never compared"),
    # -- one rank's failure is everyone's (distributed.rank_failures, failure_record)
    Mutation("failures-only-rank0-said", "moe_upcycle/distributed/rank_failures.py",
             "failed = next((s for s in said if s), None)", "failed = next((s for s in said[:1] if s), None)",
             ("tests/test_rank_agreement.py::test_all_or_none_raises_a_ranks_failure_on_every_rank_without_pickles",),
             "a failure on rank 1 is not raised on rank 0"),
    Mutation("failures-gone-rank-unnamed", "moe_upcycle/distributed/failure_record.py",
             'exc = RankError(f"{self.where} left the job without a word', 'exc = RankError(f"a rank left the job without a word',
             ("tests/test_rank_agreement.py::test_a_rank_is_gone_when_its_process_ended_or_its_heartbeat_stood_still",),
             "a dead rank is not named"),
    # -- the name <-> parameter table (checkpoint.param_table)
    Mutation("table-ties-by-name", "moe_upcycle/checkpoint/param_table.py",
             "grouped.setdefault(id(param), []).append(name)\n        params[id(param)] = param",
             "grouped.setdefault(name, []).append(name)\n        params[name] = param",
             ("tests/test_param_table.py",),
             "parameters grouped by name, not by object: a tied head becomes a second entry"),
    Mutation("table-gate-up-swapped", "moe_upcycle/checkpoint/param_table.py",
             "index = (e, slice(i * rows, (i + 1) * rows))",
             "index = (e, slice((len(projs) - 1 - i) * rows, (len(projs) - i) * rows))",
             ("tests/test_param_table.py",),
             "a fused gate_up_proj's gate and up halves swapped"),
    # -- the distributed export (distributed.dcp_export)
    Mutation("export-float32", "moe_upcycle/distributed/dcp_export.py",
             "[TensorSpec(t.key, t.shape, e.dtype) for e, t in table.to_hf()]",
             "[TensorSpec(t.key, t.shape, torch.float32) for e, t in table.to_hf()]",
             ("tests/test_fsdp.py::test_save_hf_folder_in_one_process_writes_the_build_and_replaces_only_its_own",
              "tests/test_fsdp.py::test_save_hf_folder_writes_the_builds_dtypes_and_bytes"),
             "the export's headers say float32 whatever the parameters' dtype"),
    Mutation("export-gathered-twice", "moe_upcycle/distributed/dcp_export.py",
             "whole = full_tensor(params[entry.name])  # every rank",
             "whole = full_tensor(params[entry.name]) if full_tensor(params[entry.name]) is not None else None  # every rank",
             ("tests/test_fsdp.py::test_no_storage_is_gathered_twice_on_a_tied_qwen2",),
             "every parameter gathered twice by the export"),
    Mutation("fill-tied-gathered-twice", "moe_upcycle/distributed/local_fill.py",
             "firsts = list(dict.fromkeys(self.first_name(key) for key in keys))", "firsts = list(dict.fromkeys(keys))",
             ("tests/test_fsdp.py::test_no_storage_is_gathered_twice_on_a_tied_qwen2",
              "tests/test_mutation_survivors.py::test_a_tied_group_is_gathered_once_under_its_first_name"),
             "the fill gathers a tied head and its embedding each under its own name"),
    # -- gates
    Mutation("gates-center-inverted", "moe_upcycle/gates/router.py",
             "        if params.center:  # remove what", "        if not params.center:  # remove what",
             ("tests/test_gates_basic.py",),
             "cheap_embed's gate_center applied when off and skipped when on"),
    Mutation("gates-negative-added", "moe_upcycle/gates/router.py",
             "rows.append(row - negative if negative is not None else row)",
             "rows.append(row + negative if negative is not None else row)",
             ("tests/test_gates_basic.py",),
             "cheap_embed's negative prompts added, not subtracted"),
    Mutation("gates-masked-mean-count", "moe_upcycle/gates/capture.py",
             '/ per_batch.get(batch, "count", token_counts)  # (B, H) fp32',
             '/ (per_batch.get(batch, "count", token_counts) + 3)  # (B, H) fp32',
             ("tests/test_hidden_gates.py", "tests/test_streamed_gates.py"),
             "a prompt's masked mean of router inputs divided by its token count + 3"),
    Mutation("gates-mergekit-last-is-first", "moe_upcycle/gates/mergekit_gates.py",
             "h.sum(dim=1) / h.shape[1] if average else h[:, -1, :]", "h.sum(dim=1) / h.shape[1] if average else h[:, 0, :]",
             ("tests/test_mergekit_parity.py",),
             "mergekit's hidden rows read the first position (a pad under left padding), not the last"),
    Mutation("gates-mergekit-wrong-layer", "moe_upcycle/gates/mergekit_gates.py",
             "{layer: routers[i].contiguous() for i, layer in enumerate(moe_layers)}",
             "{layer: routers[(i + 1) % len(moe_layers)].contiguous() for i, layer in enumerate(moe_layers)}",
             ("tests/test_mergekit_parity.py",),
             "mergekit's hidden rows of each MoE layer computed on the next MoE layer's inputs"),
    Mutation("gates-hidden-center-axis", "moe_upcycle/gates/hidden_gates.py",
             "direction = direction - direction.mean(dim=1, keepdim=True)",
             "direction = direction - direction.mean(dim=2, keepdim=True)",
             ("tests/test_hidden_gates.py", "tests/test_streamed_gates.py"),
             "hidden gates' gate_center subtracts each row's mean over H, not the mean over experts"),
    Mutation("gates-kmeans-seed-ignored", "moe_upcycle/gates/kmeans.py",
             "gen = torch.Generator().manual_seed(seed)", "gen = torch.Generator().manual_seed(0)",
             ("tests/test_kmeans.py", "tests/test_mutation_survivors.py::test_the_kmeans_seed_chooses_the_clustering"),
             "spherical k-means ignores its seed"),
    # -- recipe: which layers, whole numbers
    Mutation("recipe-every-start", "moe_upcycle/recipe/layer_choice.py",
             "return self.every - 1 if self.start is None else self.start",
             "return self.every if self.start is None else self.start",
             ("tests/test_resolved_once.py", "tests/test_moe_layers.py"),
             "moe_layers: {every: k} starts at layer k, not k - 1"),
    Mutation("recipe-layer-2.5-taken", "moe_upcycle/recipe/layer_choice.py",
             "or (isinstance(x, float) and x.is_integer()) or", "or isinstance(x, float) or",
             ("tests/test_whole_numbers.py",),
             "moe_layers: [1, 2.5] read as [1, 2]"),
    Mutation("resolved-inits-reversed", "moe_upcycle/recipe/resolved.py",
             "inits=tuple(resolve.expert_inits(config))", "inits=tuple(reversed(resolve.expert_inits(config)))",
             ("tests/test_inits.py::test_per_expert_override",),
             "the resolved per-expert inits in reverse slot order"),
    Mutation("resolved-cache-identity-unchecked", "moe_upcycle/recipe/resolved.py",
             "if kept is not None and kept[0] is config:", "if kept is not None:",
             ("tests/test_resolved_once.py",),
             "a resolution is returned for any config that has the same id()",
             why="the cache holds the config object beside its resolution, so while the entry exists no other "
                 "object can have that id(); the identity check never fails, it guards against a future change "
                 "that keeps only ids"),
    # -- the plan
    Mutation("plan-dense-layer-as-moe", "moe_upcycle/planning/plan.py",
             "    if layer in draft.dense_layers:\n        _plan_dense_mlp", "    if False:\n        _plan_dense_mlp",
             ("tests/test_moe_layers.py",),
             "a layer left out of moe_layers is written as an MoE layer"),
    Mutation("plan-missing-tensor-silent", "moe_upcycle/planning/plan.py",
             '            self.problems.append(f"{label}: tensor {key!r} is missing', '            (f"{label}: tensor {key!r} is missing',
             ("tests/test_bad_inputs.py", "tests/test_trust_sources.py"),
             "a tensor missing from a source is not reported"),
    # -- growing an MoE (planning.grow, gates.grow_rows)
    Mutation("grow-rows-interleaved", "moe_upcycle/gates/grow_rows.py",
             ".float().repeat(info.copies, 1)", ".float().repeat_interleave(info.copies, 0)",
             ("tests/test_grow_moe.py::test_grown_x2_is_the_base_function",),
             "grown router row j is base row j // m, not j mod E"),
    Mutation("grow-top-k-default", "moe_upcycle/planning/grow.py",
             "else copies * base.experts_per_token", "else base.experts_per_token",
             ("tests/test_grow_moe.py::test_grown_x2_is_the_base_function",),
             "a grown MoE's experts_per_token defaults to the base's k, not m × k"),
    # -- memory estimate, manifest
    Mutation("memory-lora-one-layer", "moe_upcycle/planning/memory.py",
             "held = max(read, default=0) if gpu else max(pairs, default=0)", "held = max(read, default=0)",
             ("tests/test_plan_memory.py", "tests/test_lora.py"),
             "on the CPU one layer's merged LoRA tensors counted, not two consecutive layers'"),
    Mutation("manifest-sha-wrong-bytes", "moe_upcycle/publish/manifest.py",
             "hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()",
             "hashes[name] = hashlib.sha256(path.read_bytes()[:-1]).hexdigest()",
             ("tests/test_publish.py", "tests/test_verify.py"),
             "a file's sha256 in moe_upcycle.json computed without its last byte"),
]


if __name__ == "__main__":
    sys.exit(main())
