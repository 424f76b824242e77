"""``gate_source: mergekit`` reproduces mergekit-moe 0.1.5's routers; our default differs, measurably.

The reference (tests/mergekit_reference.py) is mergekit's algorithm re-implemented from its source
with transformers called directly. Both run on the real pretrained stories260K with a 4-expert
config in the shape of a published frankenMoE (keyword prompts, a negative prompt, an empty
"default expert" prompt). The numbers are printed by scripts/mergekit_agreement.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import mergekit_reference as reference
from moe_upcycle.build import upcycle

EXPERTS = reference.PUBLISHED_4X
HELD_OUT = [text for text, _ in reference.HELD_OUT]


def built_rows(stories, tmp_path, mode: str, source: str) -> torch.Tensor:
    config = {"base_model": str(stories), "gate_mode": mode, "gate_source": source, "dtype": "float32",
              "experts": [{"source_model": str(stories), **e} for e in EXPERTS]}
    out = upcycle(config, tmp_path / f"{mode}-{source}", checksums=False).output
    state = {}
    for shard in sorted(out.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return torch.stack([state[f"model.layers.{layer}.block_sparse_moe.gate.weight"] for layer in range(5)])


@pytest.mark.parametrize("mode", ["hidden", "hidden_avg", "hidden_last", "cheap_embed"])
def test_mergekit_source_matches_mergekit_rows(stories, tmp_path, mode):
    ours = built_rows(stories, tmp_path, mode, "mergekit")
    theirs = reference.gate_params(stories, EXPERTS, mode).float()
    assert ours.shape == theirs.shape == (5, len(EXPERTS), 64)
    cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)  # (L, E)
    assert cos.min() >= 0.999, cos
    # unit rows, as mergekit writes them (bf16 model: the norm is 1 to bf16 rounding)
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(5, len(EXPERTS)), rtol=0, atol=1e-2)


def test_top1_agreement_with_mergekit_routers(stories, tmp_path):
    """mergekit mode routes like mergekit on held-out text; native `hidden` routes differently."""
    inputs = reference.router_inputs(stories, HELD_OUT)
    theirs = reference.gate_params(stories, EXPERTS, "hidden")
    mergekit_mode = reference.top1_agreement(built_rows(stories, tmp_path, "hidden", "mergekit"), theirs, inputs)
    native = reference.top1_agreement(built_rows(stories, tmp_path, "hidden", "native"), theirs, inputs)
    assert mergekit_mode >= 0.99
    assert native < mergekit_mode  # the difference the build note warns about


def test_mergekit_source_shared_expert_gate(tiny_qwen2, tmp_path, monkeypatch):
    """qwen2_moe with one prompted shared expert: its gate row is mergekit's, like a routed expert's, and the base is
    streamed once for the routers and the shared expert's gate together (each layer read once)."""
    from moe_upcycle.gates import mergekit_gates
    from moe_upcycle.gates.layer_reader import LayerReader

    opened, readers = [], []
    real_open, real_init = mergekit_gates.open_streamed, LayerReader.__init__
    monkeypatch.setattr(mergekit_gates, "open_streamed", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    monkeypatch.setattr(LayerReader, "__init__", lambda self, *a, **k: readers.append(1) or real_init(self, *a, **k))
    experts = [{"positive_prompts": ["def add(a, b):", "import numpy as np"]},
               {"positive_prompts": ["Once upon a time there was a little dragon."]}]
    shared = {"positive_prompts": ["Hello! How are you today?"], "residual_scale": 0.5}
    config = {"base_model": str(tiny_qwen2), "architecture": "qwen", "gate_mode": "hidden", "gate_source": "mergekit",
              "dtype": "float32", "experts": [{"source_model": str(tiny_qwen2), **e} for e in experts],
              "shared_experts": [{"source_model": str(tiny_qwen2), **shared}]}
    out = upcycle(config, tmp_path / "out", checksums=False).output
    assert len(opened) == 1 and len(readers) == 1, (opened, readers)
    state = load_file(str(next(out.glob("*.safetensors"))))
    theirs = reference.gate_params(tiny_qwen2, experts + [shared], "hidden").float()  # mergekit's need_gates
    for layer in range(2):
        got = torch.cat([state[f"model.layers.{layer}.mlp.gate.weight"],
                         state[f"model.layers.{layer}.mlp.shared_expert_gate.weight"]])
        cos = torch.nn.functional.cosine_similarity(got, theirs[layer], dim=-1)
        assert cos.min() >= 0.999, (layer, cos)
