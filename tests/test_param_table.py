"""`param_table`: one name <-> parameter table for a model in memory, ties as one entry, `from_hf` the inverse of
`to_hf`. Models are built on the meta device (no memory); the expected names are spelled out here."""

from __future__ import annotations

import pytest
import torch

from moe_upcycle.checkpoint.param_table import param_table

DIMS = dict(hidden_size=64, intermediate_size=48, moe_intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=301, shared_expert_intermediate_size=32)


def meta_model(model_type: str, experts: int, tied: bool):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    count = {"num_local_experts": experts} if model_type == "mixtral" else {"num_experts": experts}
    config = AutoConfig.for_model(model_type, tie_word_embeddings=tied, **DIMS, **count)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    if tied:
        model.tie_weights()  # from_config on meta leaves it to the caller
    return model


def test_a_tied_head_is_one_entry_written_after_the_embedding_where_asked():
    model = meta_model("qwen2_moe", 3, tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    table = param_table(model, written_aliases=("lm_head.weight",))
    assert table.ties == [["model.embed_tokens.weight", "lm_head.weight"]]
    keys = [t.key for _, t in table.to_hf()]
    assert keys[:2] == ["model.embed_tokens.weight", "lm_head.weight"]  # one gather serves both
    assert len(keys) == len(set(keys))
    assert table.is_alias("lm_head.weight") and not table.is_alias("model.embed_tokens.weight")
    assert table.from_hf("lm_head.weight") == ("model.embed_tokens.weight", None)
    assert "lm_head.weight" not in [t.key for _, t in param_table(model).to_hf()]  # not written unless asked
    assert param_table(model).from_hf("lm_head.weight") == ("model.embed_tokens.weight", None)
    untied = meta_model("qwen2_moe", 3, tied=False)
    assert param_table(untied).ties == []


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_from_hf_inverts_to_hf_for_every_fused_expert(model_type):
    """3 experts of intermediate size I=48: gate_up_proj (3, 2I, H) holds expert e's gate rows [0, I) and up rows
    [I, 2I); down_proj (3, H, I) expert e's down projection."""
    model = meta_model(model_type, 3, tied=False)
    table = param_table(model)
    i = 48
    pairs = list(table.to_hf())
    assert len({t.key for _, t in pairs}) == len(pairs)
    for entry, tensor in pairs:
        assert table.from_hf(tensor.key) == (entry.name, tensor.index)
        whole = torch.empty(entry.shape, device="meta")
        assert tuple((whole if tensor.index is None else whole[tensor.index]).shape) == tensor.shape
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    if model_type == "mixtral":
        gate, up, down, router = ("model.layers.1.block_sparse_moe.experts.2.w1.weight",
                                  "model.layers.1.block_sparse_moe.experts.2.w3.weight",
                                  "model.layers.1.block_sparse_moe.experts.2.w2.weight",
                                  "model.layers.1.block_sparse_moe.gate.weight")
    else:
        gate, up, down, router = (f"model.layers.1.mlp.experts.2.{p}.weight" for p in ("gate_proj", "up_proj",
                                                                                       "down_proj", "gate"))
        router = "model.layers.1.mlp.gate.weight"
    assert table.from_hf(gate) == (fused, (2, slice(0, i)))
    assert table.from_hf(up) == (fused, (2, slice(i, 2 * i)))
    assert table.from_hf(down) == ("model.layers.1.mlp.experts.down_proj", (2,))
    assert table.from_hf(router) == ("model.layers.1.mlp.gate.weight", None)
    experts = [t.key for e, t in pairs if e.name == fused]  # gate of experts 0..2, then up of experts 0..2
    assert experts[0].endswith(("0.w1.weight", "0.gate_proj.weight")) and experts[3].endswith(("0.w3.weight",
                                                                                                "0.up_proj.weight"))
    with pytest.raises(RuntimeError, match="model.layers.9.mlp.gate.weight has no parameter in the model"):
        table.from_hf("model.layers.9.mlp.gate.weight")
