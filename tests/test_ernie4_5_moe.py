"""ERNIE 4.5 → ERNIE-4.5-MoE: per-expert names, the zero score-correction bias, ERNIE's MoE keys, exact logits.

Oracles: the dense Ernie4_5ForCausalLM's logits (transformers 5, and 4.57 where .venv-tf4 exists), the dense
tensors, the classes Ernie4_5_MoeForCausalLM builds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.errors import PlanError
from tolerances import assert_close_rel

IDS = torch.tensor([[1, 17, 42, 250, 9, 77, 123, 5, 61, 200, 33, 8]])
TF4_PYTHON = Path(__file__).resolve().parents[1] / ".venv-tf4" / "bin" / "python"


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_dense_model(tmp_path_factory.mktemp("ernie") / "dense", family="ernie4_5", seed=6,
                            random_norms_and_biases=True, num_hidden_layers=3)


@pytest.fixture(scope="module")
def built(dense, tmp_path_factory) -> Path:
    return upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random"},
                   tmp_path_factory.mktemp("ernie") / "moe").output


def _logits(folder: Path, dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    with torch.inference_mode():
        return model(IDS).logits.float()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


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


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason="needs .venv-tf4 (transformers 4.57), which .ci/run creates")
def test_transformers4_loads_it_exactly(built, dense):
    code = ("import sys, json, torch, transformers\n"
            "m, info = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32, "
            "output_loading_info=True)\n"
            "with torch.inference_mode():\n"
            "    out = m(torch.tensor(json.loads(sys.argv[2]))).logits[0].tolist()\n"
            "print(json.dumps({'class': type(m).__name__, 'problems': {k: list(v) for k, v in info.items() if v}, "
            "'logits': out}))")
    run = subprocess.run([str(TF4_PYTHON), "-c", code, str(built), json.dumps(IDS.tolist())], capture_output=True,
                         text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["class"] == "Ernie4_5_MoeForCausalLM" and not out["problems"]
    assert_close_rel(torch.tensor(out["logits"]), _logits(dense)[0])
