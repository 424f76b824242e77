"""frankenMoE: experts' FFNs from their own fine-tunes; attention from the base or averaged; layer slices."""

from __future__ import annotations

import pytest
import torch

from conftest import model_logits
from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_finetune
from tolerances import assert_close_rel
from test_architectures import CLASSES, dense_tensor, load, tensor

FFN = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


@pytest.fixture(scope="module")
def finetunes(tiny_llama, tmp_path_factory):
    """Two differently-perturbed copies of tiny_llama, and a 4-layer one (its layers 2, 3 are 'new')."""
    root = tmp_path_factory.mktemp("finetunes")
    return (make_finetune(tiny_llama, root / "a", seed=21), make_finetune(tiny_llama, root / "b", seed=22),
            make_finetune(tiny_llama, root / "deep", seed=23, layers=4))


def test_each_expert_is_its_sources_ffn_bytes_and_attention_is_the_base(tiny_llama, finetunes, tmp_path):
    a, b, _ = finetunes
    experts = [{"source_model": str(a)}, {"source_model": str(b)}, {"source_model": str(a)}]
    out = upcycle({"base_model": str(tiny_llama), "experts": experts, "gate_mode": "random"}, tmp_path / "moe").output
    for layer in range(2):
        for e, src in enumerate((a, b, a)):
            for proj, w in FFN.items():
                got = tensor(out, f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight")
                assert torch.equal(got, dense_tensor(src, f"model.layers.{layer}.mlp.{proj}.weight"))
        key = f"model.layers.{layer}.self_attn.q_proj.weight"
        assert torch.equal(tensor(out, key), dense_tensor(tiny_llama, key))
    assert not torch.equal(dense_tensor(a, "model.layers.0.mlp.up_proj.weight"),
                           dense_tensor(b, "model.layers.0.mlp.up_proj.weight"))
    load(out, CLASSES["mixtral"])  # no missing/unexpected keys


def test_attention_from_average_is_the_mean_of_the_sources(tiny_llama, finetunes, tmp_path):
    a, b, _ = finetunes
    cfg = {"base_model": str(tiny_llama), "experts": [{"source_model": str(a)}, {"source_model": str(b)}],
           "gate_mode": "random", "attention_from": "average", "architecture": "qwen2_moe"}
    out = upcycle(cfg, tmp_path / "moe").output
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                "model.layers.1.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight"):
        mean = (dense_tensor(a, key).float() + dense_tensor(b, key).float()) / 2
        assert torch.equal(tensor(out, key), mean), key
        assert not torch.equal(tensor(out, key), dense_tensor(tiny_llama, key))
    # the FFNs are still each expert's own
    assert torch.equal(tensor(out, "model.layers.1.mlp.experts.1.down_proj.weight"),
                       dense_tensor(b, "model.layers.1.mlp.down_proj.weight"))
    load(out, CLASSES["qwen2_moe"])


def test_attention_average_of_copies_reproduces_the_dense_model(tiny_qwen2, tmp_path):
    cfg = {"base_model": str(tiny_qwen2), "num_experts": 2, "gate_mode": "random", "attention_from": "average"}
    out = upcycle(cfg, tmp_path / "moe").output
    assert_close_rel(model_logits(out), model_logits(tiny_qwen2))


def test_layers_slice_takes_ffns_from_a_deeper_model(tiny_llama, finetunes, tmp_path):
    _, _, deep = finetunes
    experts = [{"source_model": str(deep), "layers": [2, 4]}, {"source_model": str(tiny_llama)}]
    out = upcycle({"base_model": str(tiny_llama), "experts": experts, "gate_mode": "random", "layout": "fused"},
                  tmp_path / "moe").output
    for layer in range(2):
        gate_up = tensor(out, f"model.layers.{layer}.mlp.experts.gate_up_proj")
        src = [dense_tensor(deep, f"model.layers.{layer + 2}.mlp.{p}.weight") for p in ("gate_proj", "up_proj")]
        assert torch.equal(gate_up[0], torch.cat(src))
        assert torch.equal(tensor(out, f"model.layers.{layer}.mlp.experts.down_proj")[1],
                           dense_tensor(tiny_llama, f"model.layers.{layer}.mlp.down_proj.weight"))
    load(out, CLASSES["mixtral"])


@pytest.mark.parametrize("mode, said", [("random", True), ("uniform", True), ("hidden", False), ("cheap_embed", False)])
def test_prompts_a_gate_mode_does_not_read_are_named(mode, said, tiny_llama):
    """gate_mode: random with each expert's prompts (a mergekit config switched to random) built quietly, as if
    the prompts had shaped the routers."""
    from moe_upcycle import upcycle

    result = upcycle({"base_model": str(tiny_llama), "gate_mode": mode, "experts": [
        {"source_model": str(tiny_llama), "positive_prompts": ["Write a Python function"]},
        {"source_model": str(tiny_llama), "positive_prompts": ["Solve 2x = 8"], "negative_prompts": ["code"]}]},
        dry_run=True)
    note = (f"gate_mode: {mode} does not read prompts, so the prompts of experts[0], experts[1] do not shape the "
            f"routers (they stay in the recipe); for routers from the prompts use gate_mode: hidden or cheap_embed")
    assert (note in result.plan.cautions) is said
