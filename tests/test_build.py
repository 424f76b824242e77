"""End-to-end builds: dense → Mixtral, loaded with transformers, logits equal to the dense model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import model_logits
from moe_upcycle import upcycle
from tolerances import assert_close_rel


def _upcycle_copy(base: Path, out: Path, **extra):
    cfg = {"base_model": str(base), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random", **extra}
    return upcycle(cfg, out)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_mistral", "tiny_llama_bin_tied", "stories"])
def test_copy_upcycle_reproduces_dense_logits(fixture, request, tmp_path):
    base = request.getfixturevalue(fixture)
    result = _upcycle_copy(base, tmp_path / "moe")
    cfg = json.loads((result.output / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 4
    assert cfg["num_experts_per_tok"] == 2
    assert_close_rel(model_logits(result.output), model_logits(base))


def test_stories_output_keys_and_tied_embeddings(stories, tmp_path):
    result = _upcycle_copy(stories, tmp_path / "moe")
    index = json.loads((result.output / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert "lm_head.weight" not in keys  # tied: written once, as the embedding
    assert json.loads((result.output / "config.json").read_text())["tie_word_embeddings"] is True
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(5):
        expected |= {f"model.layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "block_sparse_moe.gate")}
        expected |= {f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")}
    assert keys == expected
    # tokenizer and generation config copied byte for byte
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (result.output / name).read_bytes() == (stories / name).read_bytes()


def test_expert_weights_equal_source_bytes(tiny_llama, tmp_path):
    result = _upcycle_copy(tiny_llama, tmp_path / "moe", tensor_policy="clone")
    with safe_open(str(tiny_llama / "model.safetensors"), "pt") as src:
        dense = src.get_tensor("model.layers.1.mlp.down_proj.weight")
    shard = result.output / result.shards[0]
    with safe_open(str(shard), "pt") as f:
        for e in range(4):
            assert torch.equal(f.get_tensor(f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"), dense)


def test_sharding_index_lists_every_tensor_once(tiny_llama, tmp_path):
    result = _upcycle_copy(tiny_llama, tmp_path / "moe", max_shard_size=50_000)
    assert len(result.shards) > 2
    index = json.loads((result.output / "model.safetensors.index.json").read_text())
    total, seen = 0, []
    for shard in result.shards:
        with safe_open(str(result.output / shard), "pt") as f:
            for key in f.keys():
                seen.append(key)
                assert index["weight_map"][key] == shard
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert sorted(seen) == sorted(index["weight_map"]) and len(seen) == len(set(seen))
    assert index["metadata"]["total_size"] == total == result.plan.total_bytes
    assert_close_rel(model_logits(result.output), model_logits(tiny_llama))


def test_bf16_output_dtype(tiny_llama, tmp_path):
    result = _upcycle_copy(tiny_llama, tmp_path / "moe", dtype="bfloat16")
    cfg = json.loads((result.output / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" == cfg["torch_dtype"]
    with safe_open(str(result.output / result.shards[0]), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_recorded_recipe_config_reloads(tiny_llama, tmp_path):
    """moe_upcycle.json's resolved config (every default written out) is itself a valid config."""
    from moe_upcycle import load_config

    result = _upcycle_copy(tiny_llama, tmp_path / "moe", expert_init={"method": "drop", "ratio": 0.25})
    from moe_upcycle.planning.replan import recorded_config

    recipe = json.loads((result.output / "moe_upcycle.json").read_text())
    again = load_config(recorded_config(recipe, result.output))  # its paths read relative to the output
    assert again == result.config.model_copy(update={"output": None}) and again.expert_init.ratio == 0.25


def test_no_checksums_skips_shard_hashes_but_keeps_small_files(tiny_llama, tmp_path):
    import hashlib

    result = _upcycle_copy(tiny_llama, tmp_path / "moe", checksums=False, max_shard_size=100_000)
    recipe = json.loads((result.output / "moe_upcycle.json").read_text())
    assert recipe["config"]["checksums"] is False and result.sha256 == {}
    assert not set(recipe["sha256"]) & set(result.shards)  # shards not hashed
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "README.md"):
        assert recipe["sha256"][name] == hashlib.sha256((result.output / name).read_bytes()).hexdigest()
    on = _upcycle_copy(tiny_llama, tmp_path / "moe2", max_shard_size=100_000)
    for shard in on.shards:  # same bytes with or without hashing
        assert (on.output / shard).read_bytes() == (result.output / shard).read_bytes()
        assert on.sha256[shard] == hashlib.sha256((on.output / shard).read_bytes()).hexdigest()


def test_paths_from_python_are_read_as_their_text(tiny_llama, tmp_path):
    """`upcycle` given pathlib.Path values (models, output, prompt files) builds what the same strings build,
    and records the strings (before, each Path was refused: "Input should be a valid string")."""
    prompts = tmp_path / "code.txt"
    prompts.write_text("write a python function\nfix this bug\n")

    def recipe(path):
        return {"base_model": path(tiny_llama), "gate_mode": "cheap_embed", "output": path(tmp_path / f"moe-{path.__name__}"),
                "experts": [{"source_model": path(tiny_llama), "positive_prompts_from": path(prompts)},
                            {"source_model": path(tiny_llama), "positive_prompts": ["tell a bedtime story"]}]}

    built = {path.__name__: upcycle(recipe(path)) for path in (str, Path)}
    assert built["Path"].output == tmp_path / "moe-Path"
    manifests = {name: json.loads((r.output / "moe_upcycle.json").read_text()) for name, r in built.items()}
    recorded = {name: {k: v for k, v in m["config"].items() if k != "output"} for name, m in manifests.items()}
    # recorded relative to each output (the same place for both), never as the absolute path
    assert recorded["Path"] == recorded["str"] and recorded["Path"]["base_model"].startswith("../")
    assert built["Path"].sha256 == built["str"].sha256  # the same bytes
