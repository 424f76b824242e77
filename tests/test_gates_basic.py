"""Gate modes that need no forward pass: random, uniform_random, uniform, cheap_embed."""

from __future__ import annotations

import math

import torch

from moe_upcycle.build import prepare
from moe_upcycle.gates.router import compute_gates
from moe_upcycle.recipe.resolve import gate_params


def _gates(base, **cfg):
    config, sources, plan = prepare({"base_model": str(base), **cfg})
    return compute_gates(gate_params(config), plan, sources[config.base_model])


def test_random_gates_std_and_seed(tiny_llama):
    g = _gates(tiny_llama, num_experts=8, gate_mode="random", router_init_std=0.02, seed=1)
    assert set(g) == {0, 1} and g[0].shape == (8, 64)
    assert abs(torch.cat([g[0], g[1]]).std().item() - 0.02) < 0.002
    again = _gates(tiny_llama, num_experts=8, gate_mode="random", seed=1)
    other = _gates(tiny_llama, num_experts=8, gate_mode="random", seed=2)
    assert torch.equal(g[0], again[0]) and not torch.equal(g[0], other[0])
    assert not torch.equal(g[0], g[1])


def test_uniform_and_uniform_random(tiny_llama):
    zeros = _gates(tiny_llama, num_experts=4, gate_mode="uniform")
    assert all(torch.count_nonzero(t) == 0 for t in zeros.values())
    u = _gates(tiny_llama, num_experts=4, gate_mode="uniform_random")[0]
    bound = 1 / math.sqrt(64)
    assert u.abs().max() <= bound and u.abs().max() > 0.8 * bound


def test_cheap_embed_is_masked_mean_of_token_embeddings(stories):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    prompts = ["Once upon a time", "The dog ran to the park"]
    neg = ["Lily was sad"]
    g = _gates(stories, gate_mode="cheap_embed", gate_scale=3.0, experts=[
        {"source_model": str(stories), "positive_prompts": prompts, "negative_prompts": neg},
        {"source_model": str(stories), "positive_prompts": ["She ate a big red apple"]},
    ])
    tok = AutoTokenizer.from_pretrained(str(stories))
    with safe_open(str(stories / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")

    def mean(ps):
        return torch.stack([emb[tok(p, add_special_tokens=False)["input_ids"]].mean(0) for p in ps]).mean(0)

    want = mean(prompts) - mean(neg)
    torch.testing.assert_close(g[0][0], want / want.norm() * 3.0)
    assert torch.equal(g[0], g[4])  # same vector every layer
