"""Granite → Granite-MoE-Shared: the multipliers kept, JetMoE's fused input_linear / output_linear, exact logits.

Oracles: the dense GraniteForCausalLM's logits (transformers 5, and 4.57 where .venv-tf4 exists), the dense
tensors stacked by hand, the classes GraniteMoeSharedForCausalLM builds.
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

# Granite-3-like multipliers, far from 1 so that a dropped one moves the logits by a lot
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                   logits_scaling=8.0)
IDS = torch.tensor([[1, 17, 42, 250, 9, 77, 123, 5, 61, 200, 33, 8]])


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_dense_model(tmp_path_factory.mktemp("granite") / "dense", family="granite", seed=5,
                            random_norms_and_biases=True, **MULTIPLIERS)


@pytest.fixture(scope="module")
def built(dense, tmp_path_factory) -> Path:
    return upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random"},
                   tmp_path_factory.mktemp("granite") / "moe").output


_tensors = folder_tensors


def _logits(folder: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return folder_logits(folder, IDS, dtype)


def test_config_keeps_the_multipliers(built):
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["GraniteMoeSharedForCausalLM"] and cfg["model_type"] == "granitemoeshared"
    assert {k: cfg[k] for k in MULTIPLIERS} == MULTIPLIERS
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == (4, 2, 128)
    assert cfg["shared_intermediate_size"] == 0  # no shared MLP (its output is ungated)


def test_tensor_names_and_fused_experts(built, dense):
    got, base = _tensors(built), _tensors(dense)
    layer = {"input_layernorm.weight", "post_attention_layernorm.weight", "block_sparse_moe.router.layer.weight",
             "block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight",
             *(f"self_attn.{p}_proj.weight" for p in "qkvo")}
    assert set(got) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                        *(f"model.layers.{i}.{s}" for i in range(2) for s in layer)}
    for i in range(2):
        gate, up, down = (base[f"model.layers.{i}.mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        # JetMoE's ParallelExperts: input_linear (E, 2I, H) = per expert [gate; up] (chunk(2): act(first) * second)
        assert torch.equal(got[f"model.layers.{i}.block_sparse_moe.input_linear.weight"],
                           torch.cat([gate, up]).expand(4, -1, -1))
        assert torch.equal(got[f"model.layers.{i}.block_sparse_moe.output_linear.weight"], down.expand(4, -1, -1))
    shard = next(built.glob("*.safetensors")).read_bytes()[:4096].decode("latin1")
    assert '"format":"pt"' in shard.replace(" ", "")  # not the transformers-5-only fused format: 4.57 reads it


def test_module_types_and_exact_logits(built, dense):
    from transformers.models.granitemoeshared import modeling_granitemoeshared as m

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(built), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model) is m.GraniteMoeSharedForCausalLM
    for layer in model.model.layers:
        assert type(layer.block_sparse_moe) is m.GraniteMoeSharedMoE and layer.shared_mlp is None
    assert_close_rel(_logits(built), _logits(dense))


def test_bf16_exact(dense, tmp_path):
    moe = upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                   "dtype": "bfloat16"}, tmp_path / "moe").output
    # bf16 (8 bits of mantissa): the routed weights w and 1 - w add the same bf16 products in another order
    assert_close_rel(_logits(moe, torch.bfloat16), _logits(dense, torch.bfloat16), rel=2 ** -6)


def test_upcycle_model_in_memory(dense):
    from moe_upcycle import upcycle_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    moe = upcycle_model(model, num_experts=4, experts_per_token=2, architecture="granitemoeshared").eval()
    assert type(moe).__name__ == "GraniteMoeSharedForCausalLM" and moe.config.logits_scaling == 8.0
    with torch.inference_mode():
        assert_close_rel(moe(IDS).logits, model(IDS).logits)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_other_outputs_refuse_a_granite_base(dense, tmp_path, arch):
    with pytest.raises(PlanError, match=rf"architecture: {arch}: .* does not compute what a GraniteForCausalLM "
                                        r"computes \(its multipliers and logits_scaling have no place there\); use "
                                        r"architecture: granitemoeshared"):
        upcycle({"base_model": str(dense), "num_experts": 2, "gate_mode": "random", "architecture": arch},
                tmp_path / "moe", dry_run=True)
    assert not (tmp_path / "moe").exists()


def test_shared_experts_are_refused(dense, tmp_path):
    with pytest.raises(PlanError, match="Granite-MoE-Shared has no shared expert, but shared_experts lists 1"):
        upcycle({"base_model": str(dense), "num_experts": 2, "gate_mode": "random",
                 "shared_experts": [{"source_model": str(dense)}]}, tmp_path / "moe", dry_run=True)


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
    assert out["class"] == "GraniteMoeSharedForCausalLM" and not out["problems"]
    assert_close_rel(torch.tensor(out["logits"]), _logits(dense)[0])
