"""Expert initialisations (copy, noise, drop, split): bytes, statistics, exactness and drift."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import PROMPT_TEXT, model_logits
from moe_upcycle import upcycle
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import ConfigError, PlanError
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.planning.inits import drop_count, drop_indices
from moe_upcycle.planning.plan import make_plan
from moe_upcycle.checkpoint.source import meta_checkpoint
from tolerances import assert_close_rel

W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def build(base: Path, out: Path, expert_init="copy", **extra):
    cfg = {"base_model": str(base), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
           "expert_init": expert_init, **extra}
    return upcycle(cfg, out)


def read(folder: Path, key: str) -> torch.Tensor:
    index = folder / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][key] if index.is_file() else "model.safetensors"
    with safe_open(str(folder / shard), "pt") as f:
        return f.get_tensor(key)


def expert(folder: Path, layer: int, e: int, proj: str) -> torch.Tensor:
    return read(folder, f"model.layers.{layer}.block_sparse_moe.experts.{e}.{W[proj]}.weight")


def dense(folder: Path, layer: int, proj: str) -> torch.Tensor:
    return read(folder, f"model.layers.{layer}.mlp.{proj}.weight")


def eager_logits(folder: Path, text: str = PROMPT_TEXT) -> torch.Tensor:
    """Logits with transformers' eager experts loop (grouped_mm on CPU rejects 86-wide stories slices)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True,
                                                       experts_implementation="eager")
    assert not any(info.values()), info
    with torch.inference_mode():
        return model.eval()(**tok(text, return_tensors="pt")).logits


# ------------------------------------------------------------------------------------- copy


def test_copy_equals_dense_and_reports_zero_drift(stories, tmp_path):
    result = build(stories, tmp_path / "moe", "copy", report_init_drift=True)
    assert_close_rel(model_logits(result.output), model_logits(stories))
    assert build(stories, tmp_path / "auto", "copy").drift is None  # auto: copy is exact by construction
    assert result.drift is not None and result.drift.top1_agreement == 1.0 and result.drift.mean_kl < 1e-9
    assert result.drift.tokens > 50
    card = (result.output / "README.md").read_text()
    assert "init drift from the dense model: mean KL" in card and "top-1 agreement 100.0%" in card


# ------------------------------------------------------------------------------------ noise


@pytest.mark.parametrize("scale", [0.01, 0.1])
def test_noise_relative_std_matches_scale(tiny_llama, tmp_path, scale):
    out = build(tiny_llama, tmp_path / "moe", {"method": "noise", "scale": scale}).output
    for layer in range(2):
        for proj in W:
            src = dense(tiny_llama, layer, proj)
            for e in range(4):
                rel = (expert(out, layer, e, proj) - src).std() / src.std()
                assert abs(rel / scale - 1) < 0.10, (layer, proj, e, float(rel))
    # each expert draws its own noise
    assert not torch.equal(expert(out, 0, 0, "up_proj"), expert(out, 0, 1, "up_proj"))


def test_noise_absolute_and_mergekit_noise_scale_are_the_same_thing(tiny_llama, tmp_path):
    a = build(tiny_llama, tmp_path / "a", {"method": "noise", "scale": 0.003, "absolute": True}).output
    experts = [{"source_model": str(tiny_llama), "noise_scale": 0.003} for _ in range(4)]
    b = upcycle({"base_model": str(tiny_llama), "experts": experts, "gate_mode": "random"}, tmp_path / "b").output
    src = dense(tiny_llama, 1, "down_proj")
    diff = expert(a, 1, 2, "down_proj") - src
    assert abs(float(diff.std()) / 0.003 - 1) < 0.10
    assert torch.equal(expert(a, 1, 2, "down_proj"), expert(b, 1, 2, "down_proj"))


def test_per_expert_override(tiny_llama, tmp_path):
    experts = [{"source_model": str(tiny_llama)},
               {"source_model": str(tiny_llama), "expert_init": {"method": "drop", "ratio": 0.25}},
               {"source_model": str(tiny_llama), "expert_init": "copy"}]
    out = upcycle({"base_model": str(tiny_llama), "experts": experts, "gate_mode": "random",
                   "expert_init": {"method": "noise", "scale": 0.05}}, tmp_path / "moe").output
    src = dense(tiny_llama, 0, "gate_proj")
    assert not torch.equal(expert(out, 0, 0, "gate_proj"), src)  # config-wide noise
    rows_changed = (expert(out, 0, 1, "gate_proj") != src).any(dim=1).sum()
    assert int(rows_changed) == drop_count(128, 0.25) == 32  # its own drop
    assert torch.equal(expert(out, 0, 2, "gate_proj"), src)  # its own copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_noise_and_drop_statistics_in_every_output_dtype(dtype, tmp_path):
    """Noise: out = round_dtype(W + N(0, (s · std W)^2)), so out - W has std s · std(W), widened only by the
    rounding (at most eps · |out| / 2 per value: its variance bound is added). Drop: round(r · I) neurons re-drawn
    from N(mean W, std(W)^2), the same ones in gate/up/down, every other value byte-identical. I = 128, H = 64."""
    base = make_dense_model(tmp_path / "base", dtype=dtype, seed=11)
    scale, ratio = 0.1, 0.25
    noisy = build(base, tmp_path / "noise", {"method": "noise", "scale": scale}, dtype=str(dtype)[6:]).output
    dropped = build(base, tmp_path / "drop", {"method": "drop", "ratio": ratio}, dtype=str(dtype)[6:]).output
    eps = torch.finfo(dtype).eps
    for layer, e, proj in [(layer, e, proj) for layer in range(2) for e in range(4) for proj in W]:
        src = dense(base, layer, proj).double()
        got = expert(noisy, layer, e, proj)
        assert got.dtype == dtype
        diff = got.double() - src
        sigma = scale * float(src.std())
        rounding = eps * float(got.double().pow(2).mean().sqrt()) / 2  # bound on the rounding's std
        n = src.numel()
        assert abs(float(diff.std()) / sigma - 1) < 5 / math.sqrt(2 * n) + (rounding / sigma) ** 2, (layer, e, proj)
        assert abs(float(diff.mean())) < 5 * sigma / math.sqrt(n) + rounding
        got = expert(dropped, layer, e, proj).double()
        neuron_axis, other = (1, 0) if proj == "down_proj" else (0, 1)
        changed = (got != src).any(dim=other)
        assert int(changed.sum()) == round(ratio * 128) == 32, (layer, e, proj)
        if proj == "gate_proj":
            neurons = changed
        assert torch.equal(changed, neurons)  # the same neurons in gate, up and down
        kept, fresh = got.index_select(neuron_axis, (~changed).nonzero().flatten()), \
            got.index_select(neuron_axis, changed.nonzero().flatten())
        assert torch.equal(kept, src.index_select(neuron_axis, (~changed).nonzero().flatten()))
        m = fresh.numel()  # 32 · 64 values drawn from N(mean W, std(W)^2), then rounded
        assert abs(float(fresh.std() / src.std()) - 1) < 5 / math.sqrt(2 * m) + eps
        assert abs(float(fresh.mean() - src.mean())) < (5 / math.sqrt(m) + eps) * float(src.std())


# ------------------------------------------------------------------------------------- drop


def test_drop_changes_exactly_round_ratio_I_neurons_shared_by_gate_up_down(stories, tmp_path):
    ratio = 0.3
    out = build(stories, tmp_path / "moe", {"method": "drop", "ratio": ratio}, seed=7).output
    n = drop_count(172, ratio)
    assert n == 52
    sets = []
    for layer in (0, 4):
        for e in range(4):
            changed = {}
            for proj in W:
                src, got = dense(stories, layer, proj), expert(out, layer, e, proj)
                axis_other = 0 if proj == "down_proj" else 1  # neurons: columns of down, rows of gate/up
                differs = (got != src).any(dim=axis_other)
                changed[proj] = set(torch.nonzero(differs).flatten().tolist())
                kept = ~differs
                if proj == "down_proj":
                    assert torch.equal(got[:, kept], src[:, kept])  # byte-identical elsewhere
                else:
                    assert torch.equal(got[kept], src[kept])
            assert len(changed["gate_proj"]) == n
            assert changed["gate_proj"] == changed["up_proj"] == changed["down_proj"]
            assert changed["gate_proj"] == set(drop_indices(172, ratio, 7, layer, e).tolist())
            sets.append(frozenset(changed["gate_proj"]))
    assert len(set(sets)) == len(sets)  # every (layer, expert) drops its own set


def test_drop_reinit_uses_source_mean_and_std(stories, tmp_path):
    out = build(stories, tmp_path / "moe", {"method": "drop", "ratio": 0.5}).output
    src, got = dense(stories, 2, "up_proj"), expert(out, 2, 1, "up_proj")
    fresh = got[(got != src).any(dim=1)]  # (86, 64) re-drawn rows
    assert abs(float(fresh.std() / src.std()) - 1) < 0.10
    assert abs(float(fresh.mean() - src.mean())) < 0.1 * float(src.std())


def test_drop_same_seed_same_bytes_other_seed_other_bytes(tiny_llama, tmp_path):
    runs = [build(tiny_llama, tmp_path / f"m{i}", {"method": "drop"}, seed=s, report_init_drift=False)
            for i, s in enumerate((3, 3, 4))]
    shards = [r.sha256[r.shards[0]] for r in runs]
    assert shards[0] == shards[1] != shards[2]


# ------------------------------------------------------------------------------------ split

EXACT = [  # (granularity, num_experts, top-k, shuffle): E and k multiples of G, one source per group
    (2, 8, 2, False), (2, 8, 4, True), (4, 8, 4, False), (2, 2, 2, False), (4, 4, 4, True),
]


@pytest.mark.parametrize("g,e,k,shuffle", EXACT)
def test_split_with_virtual_groups_equals_dense(tiny_llama, tmp_path, g, e, k, shuffle):
    """Function-preserving within 1e-5 of the largest logit (fp32 rounding of the weighted sum of slices)."""
    result = build(tiny_llama, tmp_path / "moe", {"method": "split", "granularity": g, "shuffle": shuffle},
                   num_experts=e, experts_per_token=k)
    assert any("function-preserving at init" in n and "NOT" not in n for n in result.plan.notes)
    cfg = json.loads((result.output / "config.json").read_text())
    assert cfg["intermediate_size"] == 128 // g and cfg["num_local_experts"] == e
    assert_close_rel(model_logits(result.output), model_logits(tiny_llama))
    assert result.drift.top1_agreement == 1.0 and result.drift.mean_kl < 1e-9


def test_split_on_stories_is_exact(stories, tmp_path):
    """Exact in real arithmetic; over 5 layers fp32 re-association stays within 1e-5 of the largest logit."""
    result = build(stories, tmp_path / "moe", {"method": "split", "granularity": 2, "shuffle": True},
                   num_experts=8, experts_per_token=2)
    assert_close_rel(eager_logits(result.output), eager_logits(stories))
    assert result.drift.top1_agreement == 1.0 and result.drift.mean_kl < 1e-9


def test_split_slices_scaling_and_tied_routers(tiny_llama, tmp_path):
    out = build(tiny_llama, tmp_path / "moe", {"method": "split", "granularity": 4, "shuffle": True},
                num_experts=8, experts_per_token=4).output
    gate, up, down = (dense(tiny_llama, 1, p) for p in ("gate_proj", "up_proj", "down_proj"))
    router = read(out, "model.layers.1.block_sparse_moe.gate.weight")
    for group in range(2):
        rows = []
        for j in range(group * 4, group * 4 + 4):
            w1, w3, w2 = (expert(out, 1, j, p) for p in ("gate_proj", "up_proj", "down_proj"))
            assert w1.shape == w3.shape == (32, 64) and w2.shape == (64, 32)
            # find which dense neurons this slice holds: the same ones for gate, up and down
            idx = [int(torch.nonzero((gate == r).all(dim=1))[0]) for r in w1]
            assert torch.equal(w3, up[idx]) and torch.equal(w2, down[:, idx] * 4)
            rows += idx
            assert torch.equal(router[j], router[group * 4])  # one router row per virtual group
        assert sorted(rows) == list(range(128))  # a group's slices partition the dense FFN
    assert not torch.equal(router[0], router[4])


@pytest.mark.parametrize("e,k,reason", [
    (8, 1, "experts_per_token 1 is not a multiple of granularity 2"),
    (8, 3, "experts_per_token 3 is not a multiple of granularity 2"),
    (5, 2, "num_experts 5 is not a multiple of granularity 2"),
])
def test_split_where_exactness_does_not_hold(tiny_llama, tmp_path, e, k, reason):
    """Documents the configurations that are NOT function-preserving: the plan says so and the logits move."""
    result = build(tiny_llama, tmp_path / "moe", {"method": "split", "granularity": 2},
                   num_experts=e, experts_per_token=k)
    notes = " ".join(result.plan.notes)
    assert "NOT function-preserving at init" in notes and reason in notes
    diff = (model_logits(result.output) - model_logits(tiny_llama)).abs().max()
    assert diff > 1e-3
    assert result.drift.mean_kl > 1e-6


def test_split_mixed_sources_in_a_group_is_flagged(tiny_llama, models):
    from moe_upcycle.checkpoint.tiny import make_dense_model

    other = make_dense_model(models / "llama_other_seed", family="llama", seed=5)
    experts = [{"source_model": str(tiny_llama)}, {"source_model": str(other)}]
    result = upcycle({"base_model": str(tiny_llama), "experts": experts, "gate_mode": "random",
                      "expert_init": {"method": "split", "granularity": 2}}, dry_run=True)
    assert "a virtual group mixes source models" in " ".join(result.plan.notes)


def test_split_plan_on_mistral_7b_shapes_meta():
    cfg = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
           "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 8}
    tensors = {"model.embed_tokens.weight": ((32000, 4096), torch.bfloat16), "model.norm.weight": ((4096,), torch.bfloat16),
               "lm_head.weight": ((32000, 4096), torch.bfloat16)}
    for i in range(2):
        for n, shape in [("input_layernorm", (4096,)), ("post_attention_layernorm", (4096,)),
                         ("self_attn.q_proj", (4096, 4096)), ("self_attn.k_proj", (1024, 4096)),
                         ("self_attn.v_proj", (1024, 4096)), ("self_attn.o_proj", (4096, 4096)),
                         ("mlp.gate_proj", (14336, 4096)), ("mlp.up_proj", (14336, 4096)),
                         ("mlp.down_proj", (4096, 14336))]:
            tensors[f"model.layers.{i}.{n}.weight"] = (shape, torch.bfloat16)
    base = meta_checkpoint("mistral-7b", cfg, tensors)
    config = load_config({"base_model": "mistral-7b", "num_experts": 64, "experts_per_token": 8,
                          "gate_mode": "random", "expert_init": {"method": "split", "granularity": 8}})
    plan = make_plan(config, {"mistral-7b": base})
    shapes = {s.name: s.shape for s in plan.steps if s.layer == 1 and s.kind != "copy"}
    assert shapes["model.layers.1.block_sparse_moe.gate.weight"] == (64, 4096)
    assert shapes["model.layers.1.block_sparse_moe.experts.63.w1.weight"] == (1792, 4096)
    assert shapes["model.layers.1.block_sparse_moe.experts.63.w2.weight"] == (4096, 1792)
    assert len(shapes) == 1 + 64 * 3 and plan.expert_intermediate_size == 1792
    step = next(s for s in plan.steps if s.name == "model.layers.1.block_sparse_moe.experts.13.w2.weight")
    assert step.transforms[0][1].index == 5 and step.transforms[0][1].group == 1 and step.transforms[1] == ("scale", 8.0)


# ----------------------------------------------------------------------------- config checks


@pytest.mark.parametrize("data,message", [
    ({"expert_init": "noise"}, "expert_init: method noise needs scale"),
    ({"expert_init": {"method": "drop", "scale": 0.1}}, "expert_init: scale is not used by method drop"),
    ({"expert_init": {"method": "split", "granularty": 2}}, "expert_init.granularty: unknown key — did you mean granularity?"),
    ({"expert_init": {"method": "drop", "ratio": 1.5}}, "expert_init.ratio:"),
    ({"expert_init": {"method": "nois"}}, "expert_init.method: 'nois' is not allowed"),
    ({"router_jitter_noise": -0.1}, "router_jitter_noise:"),
])
def test_expert_init_config_errors_name_the_field(data, message):
    with pytest.raises(ConfigError) as err:
        load_config({"base_model": "x", "num_experts": 4, **data})
    assert any(message in p for p in err.value.problems), err.value.problems


def test_split_only_at_top_level():
    with pytest.raises(ConfigError) as err:
        load_config({"base_model": "x", "experts": [
            {"source_model": "x", "expert_init": {"method": "split", "granularity": 2}},
            {"source_model": "x", "noise_scale": 0.1}]})
    assert "experts[0].expert_init: split changes every expert's shape" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config({"base_model": "x", "expert_init": {"method": "split", "granularity": 2},
                     "experts": [{"source_model": "x"}, {"source_model": "x", "noise_scale": 0.1}]})
    assert "experts[1].noise_scale: cannot be combined with the top-level expert_init: split" in str(err.value)


def test_granularity_must_divide_intermediate_size(stories):
    with pytest.raises(PlanError) as err:
        upcycle({"base_model": str(stories), "num_experts": 6, "experts_per_token": 3, "gate_mode": "random",
                 "expert_init": {"method": "split", "granularity": 3}}, dry_run=True)
    assert "expert_init.granularity: 3 does not divide intermediate_size 172" in str(err.value)


def test_router_knobs_written_to_config_json(tiny_llama, tmp_path):
    from transformers import AutoConfig

    out = build(tiny_llama, tmp_path / "moe", router_jitter_noise=0.01, router_aux_loss_coef=0.02,
                report_init_drift=False).output
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["router_jitter_noise"], cfg["output_router_logits"], cfg["router_aux_loss_coef"]) == (0.01, False, 0.02)
    hf = AutoConfig.from_pretrained(str(out))
    assert (hf.router_jitter_noise, hf.output_router_logits, hf.router_aux_loss_coef) == (0.01, False, 0.02)


def test_output_router_logits_true_is_refused_with_the_way_to_train(tiny_llama, tmp_path):
    """Written into config.json it made transformers fail to generate padded batches (4.57: any prompt), so
    the recipe refuses it before anything is opened, and says where router logits are asked for instead."""
    with pytest.raises(ConfigError) as err:
        build(tiny_llama, tmp_path / "moe", output_router_logits=True)
    (problem,) = err.value.problems
    assert problem.startswith("config: output_router_logits: true would be written into the output's config.json, "
                              "which transformers reads at inference too")
    assert "remove the key (the output says false)" in problem
    assert "model(**batch, labels=..., output_router_logits=True)" in problem
    assert not (tmp_path / "moe").exists()


def test_split_note_says_16_bit_router_logits_can_tie_across_groups():
    """In bf16/fp16 two groups' router logits can round to one value, and torch.topk then takes an expert of each
    (measured on stories260K: up to 3.5 logits off at 1-2 of 1,135 token-layers): the plan says so for 16-bit
    splits and not for fp32; the grouped_mm alignment, which the config handles, is not the user's to act on."""
    from moe_upcycle.planning.inits import split_notes

    groups = [{"base"}] * 4
    fp32, inexact32 = split_notes(8, 2, 2, groups, 172, "random", itemsize=4)
    bf16, inexact16 = split_notes(8, 2, 2, groups, 172, "random", itemsize=2)
    assert inexact32 == inexact16 == ""  # still function-preserving: the tie is rounding, not the recipe
    assert "16-bit dtype" not in fp32[1] and fp32[1].endswith("(exact up to float rounding)")
    assert "in a 16-bit dtype the router logits of two groups can round to the same value" in bf16[1]
    assert "up to 3.5 logits" in bf16[1]
    # the grouped_mm alignment is the config's business (`model_config.experts_implementation`), not the user's
    assert not any("grouped_mm" in line or "experts_implementation" in line for line in fp32 + bf16)


def test_uniform_split_llamacpp_reason_says_it_takes_whole_groups(tiny_llama):
    """Under uniform gates llama.cpp takes experts 0..k-1; for a split whose G divides k those are whole virtual
    groups, so llama.cpp computes the dense FFN (measured: 6.8e-7 of max |logit| against transformers 5 on
    E=4 and E=8, k=2); the reason says so instead of "these experts differ"."""
    from moe_upcycle.build import upcycle as build_plan
    from moe_upcycle.planning import llamacpp

    def plan(init, k):
        return build_plan({"base_model": str(tiny_llama), "num_experts": 8, "experts_per_token": k,
                           "gate_mode": "uniform", "expert_init": init}, dry_run=True).plan

    status, why = llamacpp.verdict(plan({"method": "split", "granularity": 2}, 2))
    assert status == "runs, not exact"
    assert "lowest-indexed experts, 0 to 1, 1 whole virtual group(s) of this split, so it computes the dense FFN" in why
    _, why = llamacpp.verdict(plan({"method": "split", "granularity": 2}, 4))
    assert "0 to 3, 2 whole virtual group(s)" in why
    _, why = llamacpp.verdict(plan({"method": "noise", "scale": 0.01}, 2))
    assert "these experts differ, so the outputs do" in why and "virtual group" not in why
