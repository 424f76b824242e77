"""Every mismatch between the config, the base and the sources: the message names the model and the field."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from moe_upcycle.cli import app
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import ConfigError, PlanError
from moe_upcycle.planning.plan import make_plan
from moe_upcycle.checkpoint.source import meta_checkpoint


def meta(ref, model_type="llama", layers=2, hidden=64, inter=128, vocab=300, heads=4, kv=2, qkv_bias=False,
         o_bias=False, qk_norm=False, mlp_bias=False, tied=False):
    """A header-only dense checkpoint with the given shape and optional tensors."""
    hd = hidden // heads
    cfg = {"model_type": model_type, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "vocab_size": vocab, "num_attention_heads": heads, "num_key_value_heads": kv,
           "tie_word_embeddings": tied, "torch_dtype": "float32"}
    f = torch.float32
    t = {"model.embed_tokens.weight": ((vocab, hidden), f), "model.norm.weight": ((hidden,), f)}
    if not tied:
        t["lm_head.weight"] = ((vocab, hidden), f)
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": ((hidden,), f), p + "post_attention_layernorm.weight": ((hidden,), f),
                  p + "self_attn.q_proj.weight": ((heads * hd, hidden), f),
                  p + "self_attn.k_proj.weight": ((kv * hd, hidden), f),
                  p + "self_attn.v_proj.weight": ((kv * hd, hidden), f),
                  p + "self_attn.o_proj.weight": ((hidden, heads * hd), f),
                  p + "mlp.gate_proj.weight": ((inter, hidden), f), p + "mlp.up_proj.weight": ((inter, hidden), f),
                  p + "mlp.down_proj.weight": ((hidden, inter), f)})
        if qkv_bias:
            t.update({p + "self_attn.q_proj.bias": ((heads * hd,), f), p + "self_attn.k_proj.bias": ((kv * hd,), f),
                      p + "self_attn.v_proj.bias": ((kv * hd,), f)})
        if o_bias:
            t[p + "self_attn.o_proj.bias"] = ((hidden,), f)
        if qk_norm:
            t.update({p + "self_attn.q_norm.weight": ((hd,), f), p + "self_attn.k_norm.weight": ((hd,), f)})
        if mlp_bias:
            t.update({p + f"mlp.{n}.bias": ((inter if n != "down_proj" else hidden,), f)
                      for n in ("gate_proj", "up_proj", "down_proj")})
    return meta_checkpoint(ref, cfg, t)


def problems(config: dict, *models) -> list[str]:
    """Plan the config against meta models; return the PlanError's problems."""
    sources = {m.ref: m for m in models}
    with pytest.raises(PlanError) as exc:
        make_plan(load_config(config), sources)
    return exc.value.problems


def franken(*experts, **extra) -> dict:
    return {"base_model": "base", "gate_mode": "random", "experts_per_token": 1,
            "experts": [e if isinstance(e, dict) else {"source_model": e} for e in experts], **extra}


# ---- output architecture cannot hold the base

def test_mixtral_refuses_attention_biases_and_points_to_qwen2_moe():
    got = problems({"base_model": "qwen2-base", "num_experts": 2, "gate_mode": "random", "architecture": "mixtral"},
                   meta("qwen2-base", "qwen2", qkv_bias=True))
    assert got == ["architecture: mixtral: the base has attention biases (self_attn.q_proj.bias), which Mixtral "
                   "cannot hold → use architecture: qwen2_moe"]


def test_mixtral_and_qwen2_moe_refuse_qk_norms_and_point_to_qwen3_moe():
    got = problems({"base_model": "q3", "num_experts": 2, "gate_mode": "random", "architecture": "qwen2_moe"},
                   meta("q3", "qwen3", qk_norm=True))
    assert got == ["architecture: qwen2_moe: the base has q/k norms (self_attn.q_norm.weight), which Qwen2-MoE "
                   "cannot hold → use architecture: qwen3_moe"]


def test_qwen3_moe_needs_qk_norms():
    got = problems({"base_model": "llama", "num_experts": 2, "gate_mode": "random", "architecture": "qwen3_moe"},
                   meta("llama"))
    assert got == ["architecture: qwen3_moe: the base has no q/k norms (self_attn.q_norm.weight), which Qwen3-MoE "
                   "needs → use architecture: mixtral or qwen2_moe"]


def test_when_nothing_fits_every_candidate_says_why():
    got = problems({"base_model": "llama-bias", "num_experts": 2, "gate_mode": "random"},
                   meta("llama-bias", qkv_bias=True, o_bias=True))
    assert got[0] == ("base_model (llama-bias): no output architecture can hold this LlamaForCausalLM "
                      "(tried mixtral, qwen2_moe, qwen3_moe):")
    assert got[1:] == [
        "mixtral: the base has attention biases (self_attn.q_proj.bias), which Mixtral cannot hold "
        "(only qwen2_moe and qwen3_moe can, and they do not fit either)",
        "mixtral: the base has an attention output bias (self_attn.o_proj.bias), which Mixtral cannot hold "
        "(only qwen3_moe can, and it does not fit either)",
        "qwen2_moe: the base has an attention output bias (self_attn.o_proj.bias), which Qwen2-MoE cannot hold "
        "(only qwen3_moe can, and it does not fit either)",
        "qwen3_moe: the base has no q/k norms (self_attn.q_norm.weight), which Qwen3-MoE needs "
        "(only mixtral and qwen2_moe can, and they do not fit either)",
    ]


def test_mlp_biases_fit_no_output():
    got = problems({"base_model": "b", "num_experts": 2, "gate_mode": "random"}, meta("b", mlp_bias=True))
    assert "mixtral: the base has MLP biases (mlp.gate_proj.bias), which Mixtral experts cannot hold → no supported " \
           "output architecture can hold it" in got


def test_an_mlp_tensor_that_is_no_bias_is_not_called_one():
    base = meta("b")
    base.tensors["model.layers.0.mlp.extra.weight"] = base.tensors["model.norm.weight"]
    got = problems({"base_model": "b", "num_experts": 2, "gate_mode": "random"}, base)
    assert "mixtral: the base has a tensor in its MLP that is not a projection's weight (mlp.extra.weight), which " \
           "Mixtral experts cannot hold → no supported output architecture can hold it" in got, got
    assert not any("MLP biases" in line for line in got), got


def test_shared_experts_need_qwen2_moe():
    got = problems({"base_model": "llama", "num_experts": 2, "gate_mode": "random", "architecture": "mixtral",
                    "shared_experts": [{"source_model": "llama"}]}, meta("llama"))
    assert got == ["architecture: mixtral: Mixtral has no shared expert, but shared_experts lists 1 → use "
                   "architecture: qwen2_moe"]


def test_unsupported_architecture_lists_supported():
    got = problems({"base_model": "llama", "num_experts": 2, "gate_mode": "random", "architecture": "deepseek"},
                   meta("llama"))
    assert got == ["architecture: deepseek: mergekit-moe writes DeepSeek-MoE (v1) checkpoints, which transformers can "
                   "only load with trust_remote_code and code from deepseek-ai/deepseek-moe-16b-base; moe-upcycle "
                   "writes only architectures transformers ships (mixtral, qwen2_moe, qwen3_moe, qwen3_5_moe_text, "
                   "granitemoeshared, glm4_moe, ernie4_5_moe) → use architecture: mixtral (or leave architecture: "
                   "out), which transformers loads natively"]


# ---- unsupported families

def test_unsupported_base_family_names_model_and_field():
    got = problems({"base_model": "gpt", "num_experts": 2, "gate_mode": "random"}, meta("gpt", "gpt2"))
    assert got == ["base_model (gpt): model_type 'gpt2' is not supported as input; supported: LlamaForCausalLM (llama), "
                   "MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3), "
                   "Qwen3_5ForCausalLM (qwen3_5_text), GraniteForCausalLM (granite), Ernie4_5ForCausalLM (ernie4_5)"]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe"])
def test_an_moe_given_as_an_expert_is_told_to_give_its_dense_model(model_type):
    got = problems(franken("base", "m"), meta("base"), meta("m", model_type))
    assert f"model_type {model_type!r} is not supported as input — it is already a Mixture-of-Experts: give the " \
           f"dense model it was made from; supported: LlamaForCausalLM (llama)" in got[0], got


@pytest.mark.parametrize("model_type,says", [
    ("mixtral", "base_model (m): config.json gives the number of experts as nothing; an MoE's config.json has one "
                "positive num_local_experts — re-download the folder"),
    ("qwen3_moe", "base_model (m): config.json gives the number of experts as nothing; an MoE's config.json has one "
                  "positive num_experts — re-download the folder"),
    ("deepseek_v3", "base_model (m): model_type 'deepseek_v3' is an MoE that moe-upcycle does not grow; it grows "
                    "mixtral, qwen2_moe, qwen3_moe checkpoints"),
    ("olmoe", "base_model (m): model_type 'olmoe' is an MoE that moe-upcycle does not grow; it grows mixtral, "
              "qwen2_moe, qwen3_moe checkpoints"),
])
def test_an_moe_base_is_grown_and_what_cannot_be_grown_is_named(model_type, says):
    """An MoE as base_model is grown (tests/test_grow_moe.py); one that cannot be read as an MoE is named."""
    assert problems({"base_model": "m", "num_experts": 2, "gate_mode": "random"}, meta("m", model_type)) == [says]


def test_unsupported_or_different_expert_family():
    got = problems(franken("base", "gpt", "mis"), meta("base"), meta("gpt", "gpt2"), meta("mis", "mistral"))
    assert got[0].startswith("experts[1] (gpt): model_type 'gpt2' is not supported as input; supported: ")
    assert got[1] == ("experts[2] (mis): model_type 'mistral' differs from base_model's 'llama'; experts must be "
                      "fine-tunes of the same family as base_model")


# ---- sources that do not fit the base

def test_every_shape_mismatch_at_once_names_model_and_field():
    got = problems(franken("base", "wide", "bigvocab", "deep"), meta("base"), meta("wide", hidden=32),
                   meta("bigvocab", vocab=32000), meta("deep", layers=4))
    assert "experts[1] (wide): hidden_size is 32 but base_model base has 64; experts must have the base's shape" in got
    assert ("experts[2] (bigvocab): vocab_size is 32000 but base_model base has 300: the expert has 31700 tokens more "
            "than the base, where a fine-tune's vocabulary and its base's differ by at most the 1024 tokens a "
            "fine-tune adds; it is a model from another pretraining, whose FFN expects that model's hidden states; "
            "use experts fine-tuned from the same base") in got, got
    assert ("experts[3] (deep): num_hidden_layers is 4 but base_model base has 2; experts must have the base's layer "
            "count; take 2 of its layers with layers: [0, 2]") in got


def test_a_smaller_expert_vocabulary_is_worded_the_right_way_round():
    """An expert whose vocabulary is the smaller one (512 next to SmolLM2's 49152): before, the message said the base
    had "more than the 1024 tokens a fine-tune adds", as if the expert had added them."""
    got = problems(franken("base", "small"), meta("base", vocab=49152), meta("small", vocab=512))
    assert got == ["experts[1] (small): vocab_size is 512 but base_model base has 49152: the expert has 48640 tokens "
                   "fewer than the base, where a fine-tune's vocabulary and its base's differ by at most the 1024 "
                   "tokens a fine-tune adds; it is a model from another pretraining, whose FFN expects that model's "
                   "hidden states; use experts fine-tuned from the same base"]
    # within 1024 either way round: added tokens (a ChatML base's 32002 next to a fine-tune's 32000) build
    make_plan(load_config(franken("base", "ft")), {"base": meta("base", vocab=32002), "ft": meta("ft", vocab=32000)})


def test_intermediate_size_mismatch_in_a_shared_expert():
    got = problems(franken("base", architecture="qwen2_moe", shared_experts=[{"source_model": "narrow"}]),
                   meta("base"), meta("narrow", inter=96))
    assert got == ["shared_experts[0] (narrow): intermediate_size is 96 but base_model base has 128; experts must "
                   "have the base's shape"]


def test_expert_with_mlp_biases():
    got = problems(franken("base", "biased"), meta("base"), meta("biased", mlp_bias=True))
    assert got == ["experts[1] (biased): tensor 'model.layers.0.mlp.gate_proj.bias' is an MLP bias, which MoE experts "
                   "cannot hold; it would be silently dropped, so the build stops"]


def test_layers_slice_count_names_both_counts():
    got = problems(franken({"source_model": "deep", "layers": [0, 3]}, "base"), meta("base"), meta("deep", layers=4))
    assert got == ["experts[0].layers (deep): [0, 3] selects 3 layers but base_model base has 2 (num_hidden_layers); "
                   "each MoE layer takes one FFN per expert, so the range must span 2 layers, e.g. [0, 2]"]


def test_layers_slice_beyond_the_source():
    got = problems(franken({"source_model": "deep", "layers": [3, 5]}), meta("base"), meta("deep", layers=4))
    assert got == ["experts[0].layers (deep): [3, 5] goes past the 4 layers of deep (num_hidden_layers); use a range "
                   "within [0, 4]"]


def test_layers_slice_that_fits_plans():
    plan = make_plan(load_config(franken({"source_model": "deep", "layers": [2, 4]}, "base")),
                     {"base": meta("base"), "deep": meta("deep", layers=4)})
    sources = {s.name: s.source for s in plan.steps if s.kind == "expert" and s.expert == 0}
    assert sources["model.layers.1.block_sparse_moe.experts.0.w2.weight"] == ("deep", "model.layers.3.mlp.down_proj.weight")


def test_attention_average_needs_matching_attention():
    got = problems(franken("base", "gqa", "biased", attention_from="average", architecture="qwen2_moe"),
                   meta("base"), meta("gqa", kv=4), meta("biased", qkv_bias=True))
    assert ("experts[1] (gqa): num_key_value_heads is 4 but base_model base has 2; attention_from: average needs every "
            "source to match the base (or use attention_from: base)") in got
    assert ("experts[1] (gqa): tensor 'model.layers.0.self_attn.k_proj.weight' has shape [64, 64] but base_model base "
            "has [32, 64]; attention_from: average needs equal shapes") in got
    assert ("experts[2] (biased): has attention biases (model.layers.0.self_attn.q_proj.bias) that base_model base "
            "lacks; attention_from: average would drop them, so the build stops (use attention_from: base, or a base "
            "with them)") in got


def test_attention_from_base_ignores_expert_attention():
    plan = make_plan(load_config(franken("base", "gqa")), {"base": meta("base"), "gqa": meta("gqa", kv=4)})
    assert plan.architecture == "mixtral"


def test_attention_average_tied_mismatch():
    got = problems(franken("base", "tied", attention_from="average"), meta("base"), meta("tied", tied=True))
    assert got[0] == ("experts[1] (tied): tie_word_embeddings is True but base_model base has False; attention_from: "
                      "average needs every source to match the base (or use attention_from: base)")


# ---- config schema

def test_layers_must_be_a_range():
    with pytest.raises(ConfigError) as exc:
        load_config(franken({"source_model": "a", "layers": [3, 1]}))
    assert exc.value.problems == ["config: experts[0].layers: [3, 1] is not a layer range; write [start, end) with "
                                  "0 <= start < end, e.g. [0, 24]"]


def test_prompt_shared_gate_needs_prompts():
    with pytest.raises(ConfigError) as exc:
        load_config(franken("a", shared_experts=[{"source_model": "a"}], shared_expert_gate="prompts"))
    assert "shared_experts[0].positive_prompts: shared_expert_gate: prompts needs at least one prompt" in str(exc.value)


def test_layout_typo_is_reported_with_choices():
    with pytest.raises(ConfigError) as exc:
        load_config(franken("a", layout="fusd"))
    assert exc.value.problems == [
        "config: layout: 'fusd' is not allowed; did you mean fused? expected 'per_expert' or 'fused'"]


# ---- through the CLI

def test_cli_reports_architecture_mismatch_and_exits_1(tiny_qwen2, write_yaml):
    path = write_yaml({"base_model": str(tiny_qwen2), "num_experts": 2, "gate_mode": "random",
                       "architecture": "mixtral"})
    result = CliRunner().invoke(app, ["build", str(path), "--dry-run"])
    assert result.exit_code == 1
    assert ("architecture: mixtral: the base has attention biases (self_attn.q_proj.bias), which Mixtral cannot hold "
            "→ use architecture: qwen2_moe") in " ".join(result.output.split())


def test_cli_dry_run_shows_fused_tensors(tiny_qwen2, write_yaml):
    path = write_yaml({"base_model": str(tiny_qwen2), "num_experts": 2, "gate_mode": "random", "layout": "fused",
                       "shared_experts": [{"source_model": str(tiny_qwen2)}]})
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "2x256x64" in line]  # (E, 2I, H)
    assert "qwen2_moe" in result.output and len(rows) == 1 and "4 slots" in rows[0] and "expert" in rows[0]
    assert any("2x64x128" in line and "2 slots" in line for line in result.output.splitlines())  # (E, H, I)


def test_mergekit_qwen_alias_means_qwen2_moe():
    config = load_config({"base_model": "llama", "num_experts": 2, "gate_mode": "random", "architecture": "qwen",
                          "shared_experts": [{"source_model": "llama"}]})
    plan = make_plan(config, {"llama": meta("llama")})
    assert plan.architecture == "qwen2_moe"
    assert {s.name for s in plan.steps if s.layer == 0 and s.kind in ("shared", "zeros", "half_gate")} == {
        "model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert.up_proj.weight",
        "model.layers.0.mlp.shared_expert.down_proj.weight", "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.bias"}
