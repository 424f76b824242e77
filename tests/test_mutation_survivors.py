"""Tests written for mutations that survived `scripts/mutation_check.py`: each names the guarantee it holds and the
mutation it was added for. The oracles are written here (hand-made rank records, plans changed by hand), not
computed by the functions under test."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_upcycle.build import prepare
from moe_upcycle.distributed.agreement import build_facts, check_agreement
from moe_upcycle.errors import ConfigError


class _ThreeRanks:
    """A world of three ranks whose all-gather returns the records given (rank 0's first)."""

    size = 3

    def __init__(self, records: list[dict]) -> None:
        self.records = records

    def gather_bytes(self, data: bytes) -> list[bytes]:
        assert json.loads(data)["facts"] == self.records[0]["facts"]  # this process is rank 0
        return [json.dumps(r).encode() for r in self.records]


def test_a_third_rank_that_differs_is_refused():
    """mutation agree-third-rank-unchecked: ranks 0 and 1 agree, rank 2 has another seed; the build must stop, and
    the message names rank 2 and both seeds."""
    same = [["tool", "moe-upcycle", "moe-upcycle 1"], ["recipe", "seed", "seed 0"]]
    other = [["tool", "moe-upcycle", "moe-upcycle 1"], ["recipe", "seed", "seed 1"]]
    records = [{"host": "h0", "digest": "d-same", "facts": same}, {"host": "h1", "digest": "d-same", "facts": same},
               {"host": "h2", "digest": "d-other", "facts": other}]
    with pytest.raises(ConfigError) as raised:
        check_agreement(_ThreeRanks(records), [tuple(f) for f in same])
    (said,) = raised.value.problems
    assert said.startswith("ranks disagree on the recipe: rank 2 (host h2) has seed 1, rank 0 (host h0) has seed 0")


def test_plans_that_write_other_bytes_are_other_facts(stories, tmp_path):
    """mutation agree-plan-tensors-left-out: two plans with the same names, shapes and dtypes (so the same shard
    layout) but one expert scaled, or read from another tensor, write other bytes: their plan facts differ."""
    config, sources, plan = prepare({"base_model": str(stories), "num_experts": 2, "gate_mode": "random"})
    k = next(i for i, s in enumerate(plan.steps) if s.kind == "expert")
    step = plan.steps[k]
    other_key = next(s.source for s in plan.steps if s.kind == "expert" and s.source != step.source)
    changed = [dataclasses.replace(step, transforms=(*step.transforms, ("scale", 2.0))),
               dataclasses.replace(step, source=other_key)]

    def plan_fact(p) -> str:
        (fact,) = [phrase for group, _, phrase in build_facts(config, sources, p, tmp_path / "moe", 10**6)
                   if group == "plan"]
        return fact

    first = plan_fact(plan)
    assert plan_fact(dataclasses.replace(plan)) == first  # the same plan is the same fact
    for new in changed:
        steps = (*plan.steps[:k], new, *plan.steps[k + 1:])
        assert plan_fact(dataclasses.replace(plan, steps=steps)) != first


def test_the_kmeans_seed_chooses_the_clustering():
    """mutation gates-kmeans-seed-ignored: on points with no cluster structure (60 gaussian points in 6 dims, 5
    clusters) each seed's k-means++ starts end in another local optimum, so 8 seeds give more than one partition
    (compared as sets of point sets, so a relabelling does not count); one seed always gives the same."""
    from moe_upcycle.gates.kmeans import spherical_kmeans

    points = torch.randn(60, 6, generator=torch.Generator().manual_seed(3))

    def partition(seed: int) -> frozenset:
        labels = spherical_kmeans(points, 5, seed=seed).assignment.tolist()
        return frozenset(frozenset(i for i, c in enumerate(labels) if c == cluster) for cluster in set(labels))

    assert partition(4) == partition(4)
    assert len({partition(seed) for seed in range(8)}) > 1


def test_a_tied_group_is_gathered_once_under_its_first_name(monkeypatch):
    """mutation fill-tied-gathered-twice: `ModelSource.gathered` asked for both names of one storage (a tied head
    and its embedding, in either order) gathers it once, under the first name, and serves both names from it. The
    fills of today's plans never ask for both names in one group (a tied head's step is skipped, a plain copy is
    not gathered), so this holds the contract where a plan would."""
    from moe_upcycle.distributed import local_fill

    calls = []

    def counted(value: torch.Tensor) -> torch.Tensor:
        calls.append(value)
        return value.detach()

    monkeypatch.setattr(local_fill, "full_tensor", counted)
    embed = torch.randn(5, 3)
    source = local_fill.ModelSource(ref="dense", path=None, config={}, tensors={},
                                    shared_groups=[["model.embed_tokens.weight", "lm_head.weight"]],
                                    state={"model.embed_tokens.weight": embed, "lm_head.weight": embed,
                                           "model.norm.weight": torch.ones(3)})
    with source.gathered(["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]):
        assert len(calls) == 2  # the tied storage once, the norm once
        assert source.read("lm_head.weight") is source.read("model.embed_tokens.weight")
    assert len(calls) == 2


@pytest.mark.parametrize("gate_scale", [None, 3.0])
def test_cheap_embed_rows_have_the_documented_length(tiny_llama, tmp_path, gate_scale):
    """mutation gates-default-scale: docs/gates.md gives a prompt row the length 16 / sqrt(hidden_size) when
    gate_scale is not set (a cosine gap of 0.25 is then a logit gap of about 4), else gate_scale. Read from the
    written router, every row of every layer."""
    from safetensors import safe_open

    from moe_upcycle import upcycle

    experts = [{"source_model": str(tiny_llama), "positive_prompts": [p]}
               for p in ("def add(a, b): return a + b", "Once upon a time there was a dragon.")]
    recipe = {"base_model": str(tiny_llama), "experts": experts, "gate_mode": "cheap_embed", "experts_per_token": 1,
              **({"gate_scale": gate_scale} if gate_scale else {})}
    out = upcycle(recipe, tmp_path / "moe").output
    hidden = json.loads((tiny_llama / "config.json").read_text())["hidden_size"]
    want = gate_scale or 16.0 / hidden ** 0.5
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    routers = []
    for name in files:
        with safe_open(str(out / name), "pt") as f:
            routers += [f.get_tensor(k) for k in f.keys() if k.endswith("block_sparse_moe.gate.weight")]
    assert len(routers) == 2
    for rows in routers:
        torch.testing.assert_close(rows.float().norm(dim=1), torch.full((2,), want), rtol=1e-6, atol=0)
