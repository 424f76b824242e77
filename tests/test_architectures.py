"""Every input family → output architecture, per-expert and fused: keys, config.json, logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from conftest import PROMPT_TEXT
from moe_upcycle import upcycle
from moe_upcycle.config import load_config
from moe_upcycle.execute import iter_tensors
from moe_upcycle.plan import make_plan
from moe_upcycle.source import meta_checkpoint
from moe_upcycle.writer import TensorParts

CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
PAIRS = [
    ("tiny_llama", "mixtral"), ("tiny_llama", "qwen2_moe"),
    ("tiny_mistral", "mixtral"), ("tiny_mistral", "qwen2_moe"),
    ("tiny_llama_bin_tied", "mixtral"), ("tiny_llama_bin_tied", "qwen2_moe"),
    ("tiny_qwen2", "qwen2_moe"), ("tiny_qwen2_tied", "qwen2_moe"),
    ("tiny_qwen3", "qwen3_moe"), ("tiny_qwen3_tied_bias", "qwen3_moe"),
    ("stories", "qwen2_moe"),
]


def load(folder: Path, class_name: str):
    """Load with the architecture's own class (fp32); fail on any missing/unexpected/mismatched key."""
    model, info = getattr(transformers, class_name).from_pretrained(str(folder), dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def logits(model, folder: Path) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    with torch.inference_mode():
        return model(**tok(PROMPT_TEXT, return_tensors="pt")).logits


def dense_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return logits(model, folder)


def index_keys(folder: Path) -> set[str]:
    return set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


def tensor(folder: Path, key: str) -> torch.Tensor:
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(folder / shard), "pt") as f:
        return f.get_tensor(key)


def dense_tensor(folder: Path, key: str) -> torch.Tensor:
    from moe_upcycle.source import open_checkpoint

    return open_checkpoint(str(folder), "test").read(key)


@pytest.mark.parametrize("fixture,arch", PAIRS)
def test_copy_upcycle_every_pair_loads_and_reproduces_dense(fixture, arch, request, tmp_path):
    base = request.getfixturevalue(fixture)
    result = upcycle({"base_model": str(base), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                      "architecture": arch}, tmp_path / "moe")
    cfg = json.loads((result.output / "config.json").read_text())
    assert cfg["architectures"] == [CLASSES[arch]] and cfg["model_type"] == arch
    dense_cfg = json.loads((base / "config.json").read_text())
    tied = bool(dense_cfg.get("tie_word_embeddings"))
    assert cfg["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in index_keys(result.output)) is not tied  # tied: written once, as the embedding
    model = load(result.output, CLASSES[arch])
    assert type(model).__name__ == CLASSES[arch]
    assert model.config.num_experts_per_tok == 2
    dense = dense_logits(base)  # fp32 rounding relative to the logits' size (sum order differs per kernel)
    torch.testing.assert_close(logits(model, result.output), dense, atol=2e-6 * float(dense.abs().max()), rtol=0)


@pytest.mark.parametrize("fixture,expected", [("tiny_llama", "mixtral"), ("tiny_mistral", "mixtral"),
                                              ("tiny_qwen2", "qwen2_moe"), ("tiny_qwen3", "qwen3_moe")])
def test_architecture_chosen_automatically(fixture, expected, request):
    base = request.getfixturevalue(fixture)
    result = upcycle({"base_model": str(base), "num_experts": 2, "gate_mode": "random"}, dry_run=True)
    assert result.plan.architecture == expected


def test_shared_experts_choose_qwen2_moe_for_llama(tiny_llama):
    cfg = {"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random",
           "shared_experts": [{"source_model": str(tiny_llama)}]}
    assert upcycle(cfg, dry_run=True).plan.architecture == "qwen2_moe"


def test_qwen2_moe_zero_biases_added_when_base_has_none(tiny_llama, tmp_path):
    out = upcycle({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random",
                   "architecture": "qwen2_moe"}, tmp_path / "moe").output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["qkv_bias"] is True and cfg["norm_topk_prob"] is True and cfg["shared_expert_intermediate_size"] == 0
    for layer in range(2):
        q = tensor(out, f"model.layers.{layer}.self_attn.q_proj.bias")
        k = tensor(out, f"model.layers.{layer}.self_attn.k_proj.bias")
        assert q.shape == (64,) and k.shape == (32,)  # 4 heads x 16, 2 kv heads x 16
        assert not q.any() and not k.any()
    assert tensor(out, "model.layers.0.mlp.shared_expert.down_proj.weight").shape == (64, 0)


def test_qwen2_biases_and_qwen3_norms_carried_over(tiny_qwen2, tiny_qwen3_tied_bias, tmp_path):
    out = upcycle({"base_model": str(tiny_qwen2), "num_experts": 2, "gate_mode": "random"}, tmp_path / "q2").output
    for proj in ("q_proj", "k_proj", "v_proj"):
        key = f"model.layers.1.self_attn.{proj}.bias"
        assert torch.equal(tensor(out, key), dense_tensor(tiny_qwen2, key))
        assert tensor(out, key).abs().sum() > 0  # random, so "equal" is not "both zero"
    out = upcycle({"base_model": str(tiny_qwen3_tied_bias), "num_experts": 2, "gate_mode": "random"},
                  tmp_path / "q3").output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["attention_bias"] is True and cfg["num_experts"] == 2 and cfg["moe_intermediate_size"] == 128
    for key in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                "model.layers.1.self_attn.o_proj.bias"):
        assert torch.equal(tensor(out, key), dense_tensor(tiny_qwen3_tied_bias, key))
        assert not torch.equal(tensor(out, key), torch.ones_like(tensor(out, key)))


@pytest.mark.parametrize("fixture,arch,shared", [("tiny_llama", "mixtral", 0), ("tiny_qwen2", "qwen2_moe", 1),
                                                 ("tiny_qwen3_tied_bias", "qwen3_moe", 0)])
def test_fused_layout_equals_per_expert(fixture, arch, shared, request, tmp_path):
    base = request.getfixturevalue(fixture)
    # noisy experts differ from each other, so routing matters; noise is seeded by the per-expert slot name
    cfg = {"base_model": str(base), "architecture": arch, "gate_mode": "random", "experts_per_token": 2,
           "experts": [{"source_model": str(base), "noise_scale": 0.01} for _ in range(3)],
           "shared_experts": [{"source_model": str(base)}] * shared}
    per = upcycle(cfg, tmp_path / "per").output
    fused = upcycle({**cfg, "layout": "fused"}, tmp_path / "fused").output
    model = load(fused, CLASSES[arch])
    # the file holds exactly the transformers-5 in-memory names
    assert index_keys(fused) == set(model.state_dict()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    prefix = "model.layers.1.mlp.experts" if arch != "mixtral" else "model.layers.1.block_sparse_moe.experts"
    gate_up = tensor(fused, "model.layers.1.mlp.experts.gate_up_proj")
    down = tensor(fused, "model.layers.1.mlp.experts.down_proj")
    assert gate_up.shape == (3, 256, 64) and down.shape == (3, 64, 128)
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(3):
        per_gate, per_up, per_down = (tensor(per, f"{prefix}.{e}.{n}.weight") for n in names)
        assert torch.equal(gate_up[e], torch.cat([per_gate, per_up]))
        assert torch.equal(down[e], per_down)
    torch.testing.assert_close(logits(model, fused), logits(load(per, CLASSES[arch]), per), atol=1e-6, rtol=0)


def _meta_llama(layers=32, hidden=4096, inter=14336, vocab=32000, heads=32, kv=8):
    cfg = {"model_type": "mistral", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "vocab_size": vocab, "num_attention_heads": heads, "num_key_value_heads": kv, "torch_dtype": "bfloat16"}
    hd = hidden // heads
    t = {"model.embed_tokens.weight": ((vocab, hidden), torch.bfloat16), "model.norm.weight": ((hidden,), torch.bfloat16),
         "lm_head.weight": ((vocab, hidden), torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": ((hidden,), torch.bfloat16),
                  p + "post_attention_layernorm.weight": ((hidden,), torch.bfloat16),
                  p + "self_attn.q_proj.weight": ((heads * hd, hidden), torch.bfloat16),
                  p + "self_attn.k_proj.weight": ((kv * hd, hidden), torch.bfloat16),
                  p + "self_attn.v_proj.weight": ((kv * hd, hidden), torch.bfloat16),
                  p + "self_attn.o_proj.weight": ((hidden, heads * hd), torch.bfloat16),
                  p + "mlp.gate_proj.weight": ((inter, hidden), torch.bfloat16),
                  p + "mlp.up_proj.weight": ((inter, hidden), torch.bfloat16),
                  p + "mlp.down_proj.weight": ((hidden, inter), torch.bfloat16)})
    return meta_checkpoint("mistral-7b", cfg, t)


def test_fused_plan_for_mixtral_8x7b_shapes_on_meta():
    config = load_config({"base_model": "mistral-7b", "num_experts": 8, "gate_mode": "random", "layout": "fused"})
    plan = make_plan(config, {"mistral-7b": _meta_llama()})
    layer3 = {s.name: s.shape for s in plan.steps if s.layer == 3}
    assert layer3 == {
        "model.layers.3.input_layernorm.weight": (4096,), "model.layers.3.post_attention_layernorm.weight": (4096,),
        "model.layers.3.self_attn.q_proj.weight": (4096, 4096), "model.layers.3.self_attn.k_proj.weight": (1024, 4096),
        "model.layers.3.self_attn.v_proj.weight": (1024, 4096), "model.layers.3.self_attn.o_proj.weight": (4096, 4096),
        "model.layers.3.mlp.gate.weight": (8, 4096),
        "model.layers.3.mlp.experts.gate_up_proj": (8, 28672, 4096),
        "model.layers.3.mlp.experts.down_proj": (8, 4096, 14336),
    }
    gate_up = next(s for s in plan.steps if s.name == "model.layers.3.mlp.experts.gate_up_proj")
    # parts in byte order: expert 0 gate, expert 0 up, expert 1 gate, ...
    assert [p.source[1].split(".")[-2] for p in gate_up.parts[:4]] == ["gate_proj", "up_proj"] * 2
    assert [p.expert for p in gate_up.parts[:4]] == [0, 0, 1, 1]
    assert abs(plan.total_bytes - 46.7e9 * 2) < 0.1e9 * 2  # Mixtral-8x7B: 46.7B parameters in bf16


def test_fused_tensors_stream_part_by_part(tiny_llama):
    """The executor hands fused tensors to the writer lazily: no part is read before it is consumed."""
    from moe_upcycle.build import open_sources

    config = load_config({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "uniform", "layout": "fused",
                          "tensor_policy": "clone"})
    sources = open_sources(config)
    plan = make_plan(config, sources)
    reads: list[str] = []
    ckpt = sources[str(tiny_llama)]
    original = ckpt.read
    ckpt.read = lambda key: (reads.append(key), original(key))[1]
    gates = {layer: torch.zeros(4, 64) for layer in range(2)}
    for step, value in iter_tensors(plan, sources, gates, "clone"):
        if step.name.endswith("gate_up_proj"):
            assert isinstance(value, TensorParts) and value.shape == (4, 256, 64)
            before = len(reads)
            parts = iter(value.parts)
            first = next(parts)
            assert len(reads) == before + 1 and first.shape == (128, 64)  # one (I, H) matrix read, not the stack
            rest = list(parts)
            assert len(rest) == 7 and len(reads) == before + 2  # gate and up each read once, shared by 4 experts
            break
