"""`moe-upcycle verify`: passes on good outputs, fails (exit 1, named cause) on damaged ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_upcycle import upcycle
from moe_upcycle.cli import app
from moe_upcycle.check.compare import compare_logits
from moe_upcycle.check.verify import IDENTITY_MAX_KL, verify

runner = CliRunner()
SHARD = "model-00001-of-00001.safetensors"
EXPERT_W2 = "model.layers.0.block_sparse_moe.experts.1.w2.weight"


@pytest.fixture(scope="module")
def tiny_moe(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "moe"
    upcycle({"base_model": str(tiny_llama), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random"}, out)
    return out


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("# two prompts keep damaged-model tests fast\nOnce upon a time\nThe cat sat on the mat.\n")
    return path


def _damaged_copy(folder: Path, tmp_path: Path, edit) -> Path:
    """Copy a built folder and rewrite its only shard with `edit(tensors)` applied."""
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    tensors = load_file(str(copy / SHARD))
    edit(tensors)
    save_file(tensors, str(copy / SHARD), metadata={"format": "pt"})
    return copy


def _verify_cli(*args: str):
    return runner.invoke(app, ["verify", *map(str, args)])


def test_compare_logits_numbers():
    ref = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])]
    other = [torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]])]
    c = compare_logits(ref, other)
    p = torch.softmax(ref[0][0].double(), -1)
    q = torch.softmax(other[0][0].double(), -1)
    kl0 = float((p * (p / q).log()).sum())
    assert c.positions == 2 and c.max_abs_diff == 2.0 and c.top1_agreement == 0.5
    assert c.mean_kl == pytest.approx(kl0 / 2, rel=1e-12) and c.max_kl == pytest.approx(kl0, rel=1e-12)


def test_verify_passes_on_copy_upcycled_tiny_model(tiny_moe, tiny_llama):
    result = verify(tiny_moe)  # base taken from the recorded recipe
    assert result.ok, result.problems
    assert result.base == str(tiny_llama) and result.loaded_class == "MixtralForCausalLM"
    assert result.num_tensors == result.planned_tensors == 2 + 2 * (6 + 1 + 4 * 3) + 1  # embed, norm, head
    assert (result.num_experts, result.experts_per_token) == (4, 2)
    c = result.comparison
    assert c.max_abs_diff < 1e-5 and c.top1_agreement == 1.0 and c.mean_kl < 1e-10 and c.positions > 50
    assert result.perplexity_moe == pytest.approx(result.perplexity_dense, rel=1e-5)
    assert result.text_tokens == 256  # the shipped text, cut to max_position_embeddings
    assert len(result.continuations) == 3
    assert all(c["dense"] == c["moe"] and c["moe"] for c in result.continuations)
    # function-preserving recipe: the identity thresholds apply by default
    assert (result.max_kl, result.min_agreement) == (IDENTITY_MAX_KL, 0.95)


def test_verify_cli_passes_on_stories(stories, tmp_path):
    out = tmp_path / "moe"
    upcycle({"base_model": str(stories), "num_experts": 4, "gate_mode": "random", "dtype": "bfloat16"}, out)
    res = _verify_cli(out, "--json", "--max-new-tokens", "8")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] is True and data["problems"] == []
    assert data["planned_tensors"] == data["num_tensors"] == 97
    c = data["comparison"]
    # bf16 experts vs the fp32 dense model: close, not equal
    assert 0 < c["mean_kl"] < 1e-3 and c["top1_agreement"] >= 0.95
    assert data["perplexity_moe"] == pytest.approx(data["perplexity_dense"], rel=0.02)
    assert data["continuations"][0]["dense"].strip() != ""


def test_verify_fails_when_a_tensor_is_deleted(tiny_moe, tmp_path, prompts_file):
    gone = "model.layers.1.self_attn.k_proj.weight"

    def delete(tensors):
        del tensors[gone]

    damaged = _damaged_copy(tiny_moe, tmp_path, delete)
    index = json.loads((damaged / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    (damaged / "model.safetensors.index.json").write_text(json.dumps(index))
    res = _verify_cli(damaged, "--prompts", prompts_file, "--max-new-tokens", "2")
    assert res.exit_code == 1
    assert f"1 planned tensor(s) missing from the output: {gone}" in res.stderr
    assert "missing key(s) when loading" in res.stderr and gone in res.stderr


def test_verify_fails_when_a_shard_is_truncated(tiny_moe, tmp_path):
    damaged = tmp_path / "truncated"
    shutil.copytree(tiny_moe, damaged)
    shard = damaged / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    res = _verify_cli(damaged, "--json")
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["ok"] is False and data["loaded_class"] is None
    text = "\n".join(data["problems"])
    assert f"{SHARD}: truncated" in text
    assert f"{SHARD}: sha256 differs" in text
    assert "does not load with transformers" in text


def test_verify_fails_when_an_expert_is_corrupted(tiny_moe, tmp_path, prompts_file):
    def corrupt(tensors):
        gen = torch.Generator().manual_seed(0)
        tensors[EXPERT_W2] = torch.randn(tensors[EXPERT_W2].shape, generator=gen) * 50

    damaged = _damaged_copy(tiny_moe, tmp_path, corrupt)
    # without the sha256 check, the numbers alone must catch it
    res = _verify_cli(damaged, "--skip-hashes", "--json", "--prompts", prompts_file, "--max-new-tokens", "2")
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["loaded_class"] == "MixtralForCausalLM"  # it loads fine: only the numbers are wrong
    assert data["comparison"]["mean_kl"] > 0.1
    assert len(data["problems"]) >= 1 and all("KL" in p or "top-1" in p for p in data["problems"])
    assert any(p.startswith("mean KL(dense‖moe) is") and "above the threshold 0.001" in p for p in data["problems"])
    # with it, the damaged file is named too
    res = _verify_cli(damaged, "--prompts", prompts_file, "--max-new-tokens", "2")
    assert res.exit_code == 1 and f"{SHARD}: sha256 differs" in res.stderr


def test_verify_fails_on_shape_mismatch_and_wrong_router_fields(tiny_moe, tmp_path, prompts_file):
    def reshape(tensors):
        tensors["model.norm.weight"] = torch.ones(65)

    damaged = _damaged_copy(tiny_moe, tmp_path, reshape)
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["num_experts_per_tok"] = 3
    (damaged / "config.json").write_text(json.dumps(cfg))
    result = verify(damaged, prompts=prompts_file, max_new_tokens=2, hashes=False)
    assert not result.ok
    assert "tensor model.norm.weight: on disk [65] torch.float32, planned [64] torch.float32" in result.problems
    assert "config.json: num_experts_per_tok is 3 but the recipe has 2" in result.problems
    assert result.experts_per_token == 3


def test_thresholds_apply_to_a_model_that_is_meant_to_differ(tiny_llama, tmp_path, prompts_file):
    out = tmp_path / "noisy"
    upcycle({"base_model": str(tiny_llama), "gate_mode": "random",
             "experts": [{"source_model": str(tiny_llama), "noise_scale": 0.05} for _ in range(4)]}, out)
    relaxed = verify(out, prompts=prompts_file, max_new_tokens=2)
    assert relaxed.ok and relaxed.max_kl is None and relaxed.comparison.mean_kl > 1e-6  # no default threshold
    strict = _verify_cli(out, "--prompts", prompts_file, "--max-new-tokens", "2", "--max-kl", "1e-9",
                         "--min-agreement", "1.0")
    assert strict.exit_code == 1 and "above the threshold 1e-09" in strict.stderr


def test_verify_without_recipe_or_base_checks_loading_only(tiny_moe, tmp_path, prompts_file):
    copy = tmp_path / "hub_download"
    shutil.copytree(tiny_moe, copy)
    (copy / "moe_upcycle.json").unlink()
    result = verify(copy, prompts=prompts_file, max_new_tokens=2)
    assert result.ok and result.comparison is None and result.planned_tensors is None
    assert result.loaded_class == "MixtralForCausalLM" and result.num_tensors == 41
    assert any("no moe_upcycle.json" in n for n in result.notes)
    res = _verify_cli(copy, "--prompts", prompts_file, "--max-new-tokens", "2", "--max-kl", "0.1")
    assert res.exit_code == 1 and "need the dense base; pass --base DENSE" in res.stderr


def test_verify_errors_name_the_folder(tmp_path):
    res = _verify_cli(tmp_path / "nowhere")
    assert res.exit_code == 1 and "nowhere does not exist" in res.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_on_cuda_matches_cpu(tiny_moe, prompts_file):
    gpu = verify(tiny_moe, prompts=prompts_file, max_new_tokens=2, device="cuda")
    cpu = verify(tiny_moe, prompts=prompts_file, max_new_tokens=2)
    assert gpu.ok and gpu.comparison.top1_agreement == 1.0
    assert gpu.perplexity_moe == pytest.approx(cpu.perplexity_moe, rel=1e-3)
