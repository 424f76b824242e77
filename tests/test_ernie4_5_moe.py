"""ERNIE 4.5 → ERNIE-4.5-MoE: per-expert names, the zero score-correction bias, ERNIE's MoE keys, exact logits.

Oracles: the dense Ernie4_5ForCausalLM's logits (transformers 5, and 4.57 where .venv-tf4 exists), the dense
tensors, the classes Ernie4_5_MoeForCausalLM builds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.errors import PlanError
from tf4_logits import TF4_PYTHON, NO_TF4, folder_logits, folder_tensors, tf4_load
from tolerances import assert_close_rel

IDS = torch.tensor([[1, 17, 42, 250, 9, 77, 123, 5, 61, 200, 33, 8]])


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_dense_model(tmp_path_factory.mktemp("ernie") / "dense", family="ernie4_5", seed=6,
                            random_norms_and_biases=True, num_hidden_layers=3)


@pytest.fixture(scope="module")
def built(dense, tmp_path_factory) -> Path:
    return upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random"},
                   tmp_path_factory.mktemp("ernie") / "moe").output


_tensors = folder_tensors


def _logits(folder: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return folder_logits(folder, IDS, dtype)


def test_config_places_every_layer_as_moe(built):
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["Ernie4_5_MoeForCausalLM"] and cfg["model_type"] == "ernie4_5_moe"
    assert {k: cfg[k] for k in ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_layer_start_index",
                                "moe_layer_interval", "moe_layer_end_index", "moe_num_shared_experts", "use_bias")} \
        == {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 128, "moe_layer_start_index": 0,
            "moe_layer_interval": 1, "moe_layer_end_index": 2, "moe_num_shared_experts": 0, "use_bias": False}


def test_tensors_and_the_zero_correction_bias(built, dense):
    got, base = _tensors(built), _tensors(dense)
    for i in range(3):
        bias = got[f"model.layers.{i}.mlp.moe_statics.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.shape == (1, 4) and not bias.any()
        assert got[f"model.layers.{i}.mlp.gate.weight"].shape == (4, 64)
        for e in range(4):
            for p in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(got[f"model.layers.{i}.mlp.experts.{e}.{p}.weight"],
                                   base[f"model.layers.{i}.mlp.{p}.weight"])
    assert not any(k.endswith(("mlp.gate_proj.weight", "shared_experts.gate_proj.weight")) for k in got)


def test_module_types_and_exact_logits(built, dense):
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as m

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(built), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model) is m.Ernie4_5_MoeForCausalLM
    for layer in model.model.layers:
        assert type(layer.mlp) is m.Ernie4_5_MoeSparseMoeBlock and layer.mlp.shared_experts is None
    assert_close_rel(_logits(built), _logits(dense))


def test_bf16_exact(dense, tmp_path):
    moe = upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                   "dtype": "bfloat16"}, tmp_path / "moe").output
    # bf16 (8 bits of mantissa): the routed weights w and 1 - w add the same bf16 products in another order
    assert_close_rel(_logits(moe, torch.bfloat16), _logits(dense, torch.bfloat16), rel=2 ** -6)


def test_upcycle_model_in_memory(dense):
    from moe_upcycle import upcycle_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    moe = upcycle_model(model, num_experts=4, experts_per_token=2, architecture="ernie4_5_moe").eval()
    assert type(moe).__name__ == "Ernie4_5_MoeForCausalLM"
    with torch.inference_mode():
        assert_close_rel(moe(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("recipe,message", [
    ({"architecture": "mixtral"}, "does not compute what a Ernie4_5ForCausalLM computes"),
    ({"moe_layers": [1]}, "ERNIE-4.5-MoE makes every layer an MoE layer"),
    ({"shared_experts": [{"source_model": "BASE"}]}, "ERNIE-4.5-MoE has no shared expert"),
])
def test_what_ernie4_5_moe_cannot_hold_is_refused(dense, tmp_path, recipe, message):
    if "shared_experts" in recipe:
        recipe = {"shared_experts": [{"source_model": str(dense)}]}
    with pytest.raises(PlanError, match=message):
        upcycle({"base_model": str(dense), "num_experts": 2, "gate_mode": "random", **recipe}, tmp_path / "moe",
                dry_run=True)


def test_runtime_table(dense, tmp_path):
    from moe_upcycle.planning.runtimes import compatibility

    plan = upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random"},
                   tmp_path / "moe", dry_run=True).plan
    assert {v.runtime: v.status for v in compatibility(plan)} == {
        "transformers 5": "exact", "transformers 4.x": "exact", "vLLM": "exact", "llama.cpp": "exact",
        "ExLlamaV2": "will not load"}


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_transformers4_loads_it_exactly(built, dense):
    out = tf4_load(built, IDS.tolist())
    assert out["class"] == "Ernie4_5_MoeForCausalLM" and not out["problems"]
    assert_close_rel(torch.tensor(out["logits"]), _logits(dense)[0])
