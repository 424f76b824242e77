"""Qwen2-MoE shared experts: the exact split, several shared experts as one, the sigmoid gate."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import model_logits
from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_finetune
from tolerances import assert_close_rel
from test_architectures import dense_tensor, tensor


def _cfg(base, shared, routed_scale=None, **extra):
    expert = {"source_model": str(base)}
    if routed_scale is not None:
        expert["residual_scale"] = routed_scale
    return {"base_model": str(base), "architecture": "qwen2_moe", "gate_mode": "random", "experts_per_token": 2,
            "experts": [dict(expert) for _ in range(4)], "shared_experts": shared, **extra}


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_llama", "stories"])
def test_exact_split_one_shared_expert(fixture, request, tmp_path):
    """Routed residual_scale 1/2 + shared expert behind a constant gate (sigmoid = 1/2) = the dense FFN."""
    base = request.getfixturevalue(fixture)
    result = upcycle(_cfg(base, [{"source_model": str(base)}], routed_scale=0.5), tmp_path / "moe")
    assert any("exactly the dense FFN" in n for n in result.plan.notes), result.plan.notes
    assert torch.equal(tensor(result.output, "model.layers.0.mlp.shared_expert_gate.weight"),
                       torch.full((1, 64), 2.0 ** -64))  # not zeros: llama.cpp's silu(z)/z is NaN at z = 0
    assert_close_rel(model_logits(result.output), model_logits(base))


def test_two_shared_experts_become_one_with_summed_size_and_stay_exact(tiny_qwen2, tmp_path):
    base = str(tiny_qwen2)
    shared = [{"source_model": base, "residual_scale": 0.5}, {"source_model": base, "residual_scale": 0.5}]
    result = upcycle(_cfg(tiny_qwen2, shared, routed_scale=0.5), tmp_path / "moe")
    cfg = json.loads((result.output / "config.json").read_text())
    assert cfg["shared_expert_intermediate_size"] == 256 and cfg["moe_intermediate_size"] == 128
    gate = dense_tensor(tiny_qwen2, "model.layers.1.mlp.gate_proj.weight")
    down = dense_tensor(tiny_qwen2, "model.layers.1.mlp.down_proj.weight")
    assert torch.equal(tensor(result.output, "model.layers.1.mlp.shared_expert.gate_proj.weight"), torch.cat([gate, gate]))
    assert torch.equal(tensor(result.output, "model.layers.1.mlp.shared_expert.down_proj.weight"),
                       torch.cat([down * 0.5, down * 0.5], dim=1))
    assert_close_rel(model_logits(result.output), model_logits(tiny_qwen2))


def test_shared_experts_from_two_models_concatenate_their_bytes(tiny_qwen2, tmp_path):
    other = make_finetune(tiny_qwen2, tmp_path / "ft", seed=11)
    shared = [{"source_model": str(tiny_qwen2)}, {"source_model": str(other)}]
    out = upcycle(_cfg(tiny_qwen2, shared), tmp_path / "moe").output
    for proj, dim in (("up_proj", 0), ("down_proj", 1)):
        key = f"model.layers.0.mlp.{proj}.weight"
        expected = torch.cat([dense_tensor(tiny_qwen2, key), dense_tensor(other, key)], dim=dim)
        assert torch.equal(tensor(out, f"model.layers.0.mlp.shared_expert.{proj}.weight"), expected)


def test_without_the_split_the_note_says_the_factor_and_logits_differ(tiny_qwen2, tmp_path):
    result = upcycle(_cfg(tiny_qwen2, [{"source_model": str(tiny_qwen2)}]), tmp_path / "moe")
    note = next(n for n in result.plan.notes if "shared_expert_gate" in n)
    assert "1.5 x the dense FFN" in note and "residual_scale: 0.5" in note
    diff = (model_logits(result.output) - model_logits(tiny_qwen2)).abs().max()
    assert diff > 1e-3


def test_prompt_gate_is_the_normalised_prompt_embedding_and_not_exact(tiny_qwen2, tmp_path):
    base = str(tiny_qwen2)
    cfg = _cfg(tiny_qwen2, [{"source_model": base, "positive_prompts": ["def add(a, b):", "import numpy as np"]}],
               routed_scale=0.5, gate_mode="cheap_embed", gate_scale=2.0)
    cfg["experts"] = [{"source_model": base, "residual_scale": 0.5, "positive_prompts": [p]}
                      for p in ("Once upon a time", "What is 12 times 7?")]
    result = upcycle(cfg, tmp_path / "moe")
    assert any("not the dense model's" in n for n in result.plan.notes)
    # the recipe left shared_expert_gate to its default; the card names what that built
    assert "1 source FFN(s) concatenated, sigmoid gate `prompts`." in (result.output / "README.md").read_text()
    gate = tensor(result.output, "model.layers.1.mlp.shared_expert_gate.weight")
    assert gate.shape == (1, 64)
    assert_close_rel(gate.norm(), torch.tensor(2.0))
    # the direction is the mean token embedding of the prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    embed = dense_tensor(tiny_qwen2, "model.embed_tokens.weight")
    rows = [embed[torch.tensor(tok(p, add_special_tokens=False)["input_ids"])].mean(0)
            for p in ("def add(a, b):", "import numpy as np")]
    mean = torch.stack(rows).mean(0)
    assert_close_rel(gate[0], mean / mean.norm() * 2.0, rel=1e-06)
    assert (model_logits(result.output) - model_logits(tiny_qwen2)).abs().max() > 1e-4


def test_constant_gate_can_be_forced_over_prompts(tiny_qwen2, tmp_path):
    base = str(tiny_qwen2)
    cfg = _cfg(tiny_qwen2, [{"source_model": base, "positive_prompts": ["def add(a, b):"]}], routed_scale=0.5,
               gate_mode="cheap_embed", shared_expert_gate="constant")
    cfg["experts"] = [{"source_model": base, "residual_scale": 0.5, "positive_prompts": [p]}
                      for p in ("Once upon a time", "def add(a, b):")]
    result = upcycle(cfg, tmp_path / "moe")
    assert torch.equal(tensor(result.output, "model.layers.0.mlp.shared_expert_gate.weight"),
                       torch.full((1, 64), 2.0 ** -64))
    assert "sigmoid gate `constant`." in (result.output / "README.md").read_text()
    assert_close_rel(model_logits(result.output), model_logits(tiny_qwen2))


def test_fused_layout_with_shared_expert_is_exact(tiny_qwen2, tmp_path):
    result = upcycle(_cfg(tiny_qwen2, [{"source_model": str(tiny_qwen2)}], routed_scale=0.5, layout="fused"),
                     tmp_path / "moe")
    assert_close_rel(model_logits(result.output), model_logits(tiny_qwen2))
