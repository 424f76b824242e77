"""Growing an existing MoE (issue 40, part 2): more experts copied from the base's own, or added from dense fine-tunes.

Oracles are written here: the base MoE run by transformers (its logits), the grown model's safetensors read
directly, and the softmax-top-k arithmetic spelled out. Not about `prompts grow` (tests/test_grow.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moe_upcycle.build import upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model, make_finetune
from moe_upcycle.cli import app
from moe_upcycle.errors import PlanError
from tf4_logits import TF4_PYTHON, NO_TF4, folder_tensors

IDS = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))  # tokens of the tiny vocab
MIX = dict(family="mixtral", num_local_experts=4, num_experts_per_tok=2)
QWEN3 = dict(family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             norm_topk_prob=False, random_norms_and_biases=True)
QWEN2 = dict(family="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, random_norms_and_biases=True)


@pytest.fixture(scope="module")
def hub_mixtral(tmp_path_factory) -> Path:
    """A Mixtral saved by transformers' save_pretrained (a hub folder), random init."""
    return make_dense_model(tmp_path_factory.mktemp("hub") / "mixtral", seed=11, **MIX)


@pytest.fixture(scope="module")
def hub_qwen3(tmp_path_factory) -> Path:
    return make_dense_model(tmp_path_factory.mktemp("hub") / "qwen3_moe", seed=12, **QWEN3)


@pytest.fixture(scope="module")
def hub_qwen2(tmp_path_factory) -> Path:
    return make_dense_model(tmp_path_factory.mktemp("hub") / "qwen2_moe", seed=13, **QWEN2)


def logits(folder: Path) -> torch.Tensor:
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.inference_mode():
        return model.eval()(IDS).logits


tensors = folder_tensors  # every tensor of a folder, by name


def assert_same_function(base: Path, grown: Path) -> None:
    want, got = logits(base), logits(grown)
    # fp32; the only difference allowed is the order of the experts' sums: a few ulps of the logits' size
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


@pytest.mark.parametrize("fixture", ["hub_mixtral", "hub_qwen3"])
def test_grown_x2_is_the_base_function(request, tmp_path, write_yaml, fixture):
    base = request.getfixturevalue(fixture)
    out = upcycle(write_yaml({"base_model": str(base), "num_experts": 8}), tmp_path / "grown")
    cfg = json.loads((out.output / "config.json").read_text())
    base_cfg = json.loads((base / "config.json").read_text())
    counts = [k for k in ("num_experts", "num_local_experts") if k in base_cfg]  # transformers 5 writes the latter
    assert counts and all(cfg[k] == 8 for k in counts) and cfg["num_experts_per_tok"] == 4  # m × k by default
    assert cfg["model_type"] == base_cfg["model_type"] and cfg["architectures"] == base_cfg["architectures"]
    assert any("grows 4 experts → 8 (each expert ×2" in n for n in out.plan.notes)
    assert not out.plan.inexact
    assert_same_function(base, out.output)
    # expert j is base expert j mod 4, router row j is the base's row j mod 4: byte for byte
    got, had = tensors(out.output), tensors(base)
    router = next(k for k in had if k.endswith("gate.weight") and ".0." in k and "shared" not in k)
    assert torch.equal(got[router], torch.cat([had[router], had[router]]))
    w = [k for k in had if ".experts.1." in k and k.startswith("model.layers.1.")]
    assert w and all(torch.equal(got[k.replace(".experts.1.", ".experts.5.")], had[k]) for k in w)
    card = (out.output / "README.md").read_text()
    assert f"MoE grown from local model {base.name}" in card and "upcycled" not in card.split("## Recipe")[0]
    assert f"| 5 | expert_1_copy1 | local model `{base.name}`, expert 1 | 0 | copy of expert 1 |" in card
    assert "experts_per_token: 4  # default for a grown MoE: 2 × the base's 2" in card


def test_the_softmax_arithmetic_behind_exactness():
    """The rule the planner relies on, spelled out: m equal logits per expert, top-(mk), weights summed per expert."""
    g = torch.Generator().manual_seed(3)
    logit = torch.randn(5, 4, generator=g)  # 5 tokens, E=4
    for renorm in (True, False):
        p = logit.softmax(-1)
        w, i = p.topk(2, -1)
        w = w / w.sum(-1, keepdim=True) if renorm else w
        base = torch.zeros_like(p).scatter(1, i, w)
        p2 = logit.repeat(1, 3).softmax(-1)  # m=3 copies: expert j is base expert j mod 4
        w2, i2 = p2.topk(6, -1)
        w2 = w2 / w2.sum(-1, keepdim=True) if renorm else w2
        grown = torch.zeros_like(p2).scatter(1, i2, w2).view(5, 3, 4).sum(1)
        torch.testing.assert_close(grown, base)


def test_experts_per_token_unchanged_builds_and_says_not_exact(tmp_path, write_yaml, hub_mixtral):
    out = upcycle(write_yaml({"base_model": str(hub_mixtral), "num_experts": 8, "experts_per_token": 2}),
                  tmp_path / "k2")
    assert json.loads((out.output / "config.json").read_text())["num_experts_per_tok"] == 2
    assert any("experts_per_token: 2, not 2 × the base's 2 = 4" in c for c in out.plan.inexact)
    assert any("not 2 × the base's 2" in n for n in out.notes)  # what build prints
    diff = (logits(out.output) - logits(hub_mixtral)).abs().max()
    assert diff > 1e-3  # really another function: a token reaches one expert (2 copies) instead of two


def test_count_no_multiple_is_refused_named_and_nothing_written(tmp_path, write_yaml, hub_mixtral):
    recipe = write_yaml({"base_model": str(hub_mixtral), "num_experts": 6})
    with pytest.raises(PlanError) as err:
        upcycle(recipe, tmp_path / "six")
    msg = str(err.value)
    assert "num_experts: 6 is no multiple of the base's 4 experts" in msg and "8 (each ×2)" in msg
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "six")])
    assert result.exit_code == 1 and "no multiple of the base's 4 experts" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "six").exists()
    with pytest.raises(PlanError, match="num_experts: 2 is fewer than the base's 4 experts"):
        upcycle(write_yaml({"base_model": str(hub_mixtral), "num_experts": 2}), tmp_path / "two")


@pytest.mark.parametrize("init", [{"method": "noise", "scale": 0.01}, {"method": "drop", "ratio": 0.25}])
def test_expert_init_applies_to_the_copies_only(tmp_path, write_yaml, hub_qwen3, init):
    out = upcycle(write_yaml({"base_model": str(hub_qwen3), "num_experts": 8, "expert_init": init}), tmp_path / "i")
    got, had = tensors(out.output), tensors(hub_qwen3)
    for layer in (0, 1):
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                key = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                copy = got[key.replace(f".experts.{e}.", f".experts.{e + 4}.")]
                assert torch.equal(got[key], had[key])  # the base's experts: byte for byte
                if init["method"] == "noise":
                    rel = (copy - had[key]).std() / had[key].std()
                    assert 0.005 < rel < 0.02, rel  # std 0.01 × the matrix's std
                else:  # 25 % of the 32 neurons re-drawn: rows of gate/up, columns of down
                    neurons = (copy != had[key]).any(dim=1 if proj != "down_proj" else 0)
                    assert int(neurons.sum()) == 8, int(neurons.sum())
    assert any(f"expert_init {init['method']} changes the copies" in c for c in out.plan.inexact)


def test_qwen2_moe_shared_expert_kept_byte_identical(tmp_path, write_yaml, hub_qwen2):
    out = upcycle(write_yaml({"base_model": str(hub_qwen2), "num_experts": 12}), tmp_path / "q2")
    got, had = tensors(out.output), tensors(hub_qwen2)
    shared = [k for k in had if "shared_expert" in k or "self_attn" in k or "norm" in k or "embed" in k]
    assert len([k for k in shared if "shared_expert" in k]) == 2 * 4  # 3 matrices + the gate, 2 layers
    for k in shared:
        assert torch.equal(got[k], had[k]) and got[k].dtype == had[k].dtype, k
    assert json.loads((out.output / "config.json").read_text())["num_experts_per_tok"] == 6
    assert_same_function(hub_qwen2, out.output)


def test_plan_shows_what_grows(tmp_path, write_yaml, hub_mixtral):
    result = CliRunner().invoke(app, ["plan", str(write_yaml({"base_model": str(hub_mixtral), "num_experts": 8}))])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "grows 4 experts → 8 (each expert ×2, with its router row)" in text
    assert "router: base routers" in text and "(exact)" in text


def test_random_gate_mode_replaces_the_routers_and_says_so(tmp_path, write_yaml, hub_mixtral):
    out = upcycle(write_yaml({"base_model": str(hub_mixtral), "num_experts": 8, "gate_mode": "random"}),
                  tmp_path / "random")
    assert any("gate_mode: random replaces the base's trained routers" in c for c in out.plan.inexact)
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert not torch.equal(tensors(out.output)[router][:4], tensors(hub_mixtral)[router])


def test_grow_what_this_tool_built_and_add_a_dense_finetune(tmp_path, write_yaml, tiny_llama):
    """mergekit#171: a Mixtral built here from a dense Llama, then two fine-tunes of that Llama added as experts."""
    built = upcycle(write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random"}, "a.yaml"),
                    tmp_path / "moe").output
    grown = upcycle(write_yaml({"base_model": str(built), "num_experts": 8}, "b.yaml"), tmp_path / "x2")
    assert grown.plan.architecture == "mixtral" and not grown.plan.inexact
    assert_same_function(built, grown.output)

    tunes = [make_finetune(tiny_llama, tmp_path / f"tune{i}", seed=20 + i, scale=0.2) for i in (0, 1)]
    recipe = {"base_model": str(built), "experts": [
        {"source_model": str(tunes[0]), "positive_prompts": ["def add(a, b): return a + b", "import numpy as np"]},
        {"source_model": str(tunes[1]), "positive_prompts": ["Once upon a time there was a little dragon."]}]}
    added = upcycle(write_yaml(recipe, "c.yaml"), tmp_path / "added")
    got, had, tune = tensors(added.output), tensors(built), tensors(tunes[0])
    cfg = json.loads((added.output / "config.json").read_text())
    assert cfg["num_local_experts"] == 6 and cfg["num_experts_per_tok"] == 2
    for layer in (0, 1):
        router = f"model.layers.{layer}.block_sparse_moe.gate.weight"
        assert torch.equal(got[router][:4], had[router])  # the base's rows: byte for byte
        new = got[router][4:]
        assert new.shape == (2, 64) and bool((new.norm(dim=1) > 0).all())
        # the same length as the base rows' mean: the new experts compete on equal terms
        torch.testing.assert_close(new.norm(dim=1), had[router].norm(dim=1).mean().expand(2))
        for e in range(4):
            for w in ("w1", "w2", "w3"):
                key = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                assert torch.equal(got[key], had[key])
        assert torch.equal(got[f"model.layers.{layer}.block_sparse_moe.experts.4.w1.weight"],
                           tune[f"model.layers.{layer}.mlp.gate_proj.weight"])
        assert torch.equal(got[f"model.layers.{layer}.block_sparse_moe.experts.4.w2.weight"],
                           tune[f"model.layers.{layer}.mlp.down_proj.weight"])
    assert any("added expert(s) compete" in c for c in added.plan.inexact)
    logits(added.output)  # loads with transformers, nothing missing


def test_added_expert_of_another_size_or_without_prompts_is_refused(tmp_path, write_yaml, hub_qwen3):
    dense = make_dense_model(tmp_path / "qwen3", family="qwen3", seed=30)  # intermediate 128, experts 32
    with pytest.raises(PlanError) as err:
        upcycle(write_yaml({"base_model": str(hub_qwen3), "experts": [
            {"source_model": str(dense), "positive_prompts": ["x"]},
            {"source_model": str(hub_qwen3), "positive_prompts": ["z"]}]}), tmp_path / "no")
    assert err.value.problems == [
        f"experts[0] ({dense}): its FFN has intermediate_size 128, the base's experts 32 (moe_intermediate_size); an "
        f"added expert must have the experts' size (a Qwen MoE's experts are narrower than its dense model's FFN)",
        "experts[1]: the base's own experts are kept, all of them; list only new experts (dense fine-tunes of the "
        "MoE's dense model), or use num_experts: to copy the base's"]
    with pytest.raises(PlanError) as err:  # no expert has prompts: the recipe's default gate mode is random
        upcycle(write_yaml({"base_model": str(hub_qwen3), "experts_per_token": 1, "experts": [
            {"source_model": str(dense)}]}), tmp_path / "no")
    assert err.value.problems[0] == (
        "experts[0].positive_prompts: none given; an added expert's router row is made from its prompts on the MoE's "
        "router inputs — give a few texts it should handle")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_bf16_base_grown_keeps_its_bytes(tmp_path, write_yaml, layout):
    base = make_dense_model(tmp_path / "bf16", seed=14, dtype=torch.bfloat16, **MIX)
    out = upcycle(write_yaml({"base_model": str(base), "num_experts": 12, "layout": layout}), tmp_path / "g")
    got, had = tensors(out.output), tensors(base)
    router = "model.layers.1." + ("block_sparse_moe.gate.weight" if layout == "per_expert" else "mlp.gate.weight")
    assert got[router].dtype == torch.bfloat16 and torch.equal(got[router], had[
        "model.layers.1.block_sparse_moe.gate.weight"].repeat(3, 1))
    assert json.loads((out.output / "config.json").read_text())["num_experts_per_tok"] == 6
    assert_same_function(base, out.output)


def test_verify_compares_a_grown_model_with_its_moe_base(tmp_path, write_yaml, hub_mixtral):
    out = upcycle(write_yaml({"base_model": str(hub_mixtral), "num_experts": 8}), tmp_path / "grown")
    result = CliRunner().invoke(app, ["verify", str(out.output)])
    assert result.exit_code == 0, result.output
    from moe_upcycle.check.verify import verify

    checked = verify(out.output)
    assert checked.ok and checked.base == str(hub_mixtral)
    assert checked.comparison.max_abs_diff <= 1e-5 * 30  # the MoE base's logits, to summation order
    assert checked.comparison.top1_agreement == 1.0
    assert "the base is an MoE (4 experts): the grown model is compared with the MoE it grew" in checked.notes
    assert verify(out.output, base=hub_mixtral).ok  # the MoE it grew, named explicitly: fewer experts
    same = CliRunner().invoke(app, ["verify", str(out.output), "--base", str(out.output)])
    assert same.exit_code == 1 and "is itself a Mixture-of-Experts (8 experts)" in same.output  # never itself


def test_build_verify_on_a_grown_model(tmp_path, write_yaml, hub_qwen3):
    recipe = write_yaml({"base_model": str(hub_qwen3), "num_experts": 8})
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "g"), "--verify"])
    assert result.exit_code == 0, result.output
    assert "PASSED" in result.output
    manifest = json.loads((tmp_path / "g" / "moe_upcycle.json").read_text())
    # left out, so that re-planning resolves them from the base as the build did
    assert "gate_mode" not in manifest["config"] and "experts_per_token" not in manifest["config"]
    assert manifest["verify"]["comparison"]["top1_agreement"] == 1.0


def test_dense_layers_kept_and_plan_from_config_alone(tmp_path, write_yaml):
    """A Qwen2-MoE whose layer 0 keeps a dense MLP (mlp_only_layers): it stays dense and byte for byte; `plan
    --from-config` (no weights) plans the same tensors as the headers."""
    base = make_dense_model(tmp_path / "q2dense0", seed=15, mlp_only_layers=[0], **QWEN2)
    recipe = write_yaml({"base_model": str(base), "num_experts": 8})
    planned = upcycle(recipe, dry_run=True, from_config=True).plan
    out = upcycle(recipe, tmp_path / "g")
    described = sorted((s.name, s.shape, s.kind) for s in planned.steps)
    assert described == sorted((s.name, s.shape, s.kind) for s in out.plan.steps)
    got, had = tensors(out.output), tensors(base)
    dense = [f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    assert all(torch.equal(got[k], had[k]) for k in dense)
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in got)
    assert out.plan.dense_layers == (0,)
    assert json.loads((out.output / "config.json").read_text())["mlp_only_layers"] == [0]
    assert_same_function(base, out.output)


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_grown_models_run_the_bases_function_in_transformers_4(tmp_path, write_yaml, hub_mixtral, hub_qwen3):
    """transformers 4.57 reads Qwen3-MoE's num_experts, which transformers 5 saves as num_local_experts only: the
    grown config.json spells both, and 4.57 computes the (transformers 5) base's logits."""
    from tf4_logits import tf4_logits, tf5_logits

    ids = IDS[0].tolist()
    grown = {base: upcycle(write_yaml({"base_model": str(base), "num_experts": 8}, f"{base.name}.yaml"),
                           tmp_path / base.name).output for base in (hub_mixtral, hub_qwen3)}
    got = tf4_logits(ids, [str(g) for g in grown.values()])
    for base, folder in grown.items():
        assert isinstance(got[str(folder)], list), got[str(folder)]
        want = tf5_logits(base, ids)
        diff = (torch.tensor(got[str(folder)]) - want).abs().max()
        assert diff <= 1e-5 * want.abs().max(), diff
