"""A source's config.json is checked — types, bounds, against its tensor shapes, and experts against
the base — before a byte is written, every problem named at once (issue 13)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from failure_checks import assert_clean_failure, cli

# (id, fields to set in the base's config.json, words every message must contain)
CASES = [
    ("vocab-contradicts-embed", {"vocab_size": 320}, ["'model.embed_tokens.weight' has shape [300, 64]",
                                                       "implies [320, 64] (vocab_size, hidden_size)"]),
    ("hidden-contradicts", {"hidden_size": 32}, ["config.json implies", "hidden_size"]),
    ("intermediate-contradicts", {"intermediate_size": 256}, ["'model.layers.0.mlp.gate_proj.weight' has shape [128, 64]",
                                                             "(and 1 more like it)", "implies [256, 64]"]),
    ("heads-contradict", {"num_attention_heads": 8}, ["self_attn.q_proj.weight' has shape [64, 64]",
                                                      "implies [128, 64] (num_attention_heads x head_dim"]),
    ("kv-heads-contradict", {"num_key_value_heads": 4}, ["self_attn.k_proj.weight' has shape [32, 64]",
                                                         "num_key_value_heads x head_dim"]),
    ("head-dim-contradicts", {"head_dim": 8}, ["self_attn.q_proj.weight' has shape [64, 64]", "implies [32, 64]"]),
    ("zero-layers", {"num_hidden_layers": 0}, ["num_hidden_layers must be a positive integer, got 0"]),
    ("string-size", {"hidden_size": "64"}, ["hidden_size must be a positive integer, got '64'"]),
    ("float-size", {"vocab_size": 300.0}, ["vocab_size must be a positive integer, got 300.0"]),
    ("bool-size", {"intermediate_size": True}, ["intermediate_size must be a positive integer, got True"]),
    ("null-heads", {"num_attention_heads": 0}, ["num_attention_heads must be a positive integer, got 0"]),
    ("null-heads-none", {"num_attention_heads": None}, ["num_attention_heads is missing"]),
    ("string-heads", {"num_key_value_heads": "2"}, ["num_key_value_heads must be a positive integer, got '2'"]),
    ("tie-string-no", {"tie_word_embeddings": "no"}, ["tie_word_embeddings must be true or false, got 'no'"]),
    ("tie-int", {"tie_word_embeddings": 0}, ["tie_word_embeddings must be true or false, got 0"]),
    ("absurd-layers", {"num_hidden_layers": 10**9}, ["num_hidden_layers is 1000000000, more than 4096"]),
    ("absurd-layers-float", {"num_hidden_layers": 1e9}, ["num_hidden_layers must be a positive integer, got 1000000000.0"]),
    ("absurd-vocab", {"vocab_size": 2**40}, ["vocab_size is 1099511627776, more than"]),
    ("eps-string", {"rms_norm_eps": "1e-6"}, ["rms_norm_eps must be a positive finite number, got '1e-6'"]),
    ("eps-negative", {"rms_norm_eps": -1e-6}, ["rms_norm_eps must be a positive finite number"]),
    ("eps-huge", {"rms_norm_eps": 5.0}, ["rms_norm_eps is 5.0; a norm epsilon is a small number"]),
    ("rope-theta-zero", {"rope_parameters": {"rope_theta": 0, "rope_type": "default"}},
     ["rope_parameters.rope_theta must be a positive finite number, got 0"]),
    ("rope-scaling-string", {"rope_scaling": "linear"}, ["rope_scaling must be an object (or null), got 'linear'"]),
    # transformers 4 reads torch_dtype, 5 dtype: the default output dtype (the base's) would be a guess
    ("dtype-two-values", {"torch_dtype": "float16", "dtype": "bfloat16"},
     ["config.json gives torch_dtype float16 and dtype bfloat16", "set dtype: in the recipe (e.g. dtype: bfloat16)"]),
    # transformers 4 reads the top-level rope_theta, 5 rope_parameters': before, the build took 1e4 and the MoE was
    # max |Δlogit| 10.9 from the dense model as transformers 5 runs it
    ("rope-theta-two-values", {"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
     ["rope_theta is given 2 times with different values (rope_theta 10000.0, rope_parameters.rope_theta 500000.0)",
      "keep the value it was trained with in every place"]),
    ("rope-theta-in-scaling", {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e6}},
     ["rope_theta is given", "rope_scaling.rope_theta 1000000.0"]),
    ("heads-not-multiple", {"num_key_value_heads": 3}, ["num_attention_heads 4 is not a multiple of num_key_value_heads 3"]),
    ("hidden-act-number", {"hidden_act": 3}, ["hidden_act must be a string"]),
    ("hidden-act-unknown", {"hidden_act": "swiglu2"}, ["hidden_act 'swiglu2' is not an activation transformers knows"]),
    ("eps-null", {"rms_norm_eps": None}, ["rms_norm_eps is null"]),
    ("hidden-act-null", {"hidden_act": None}, ["hidden_act is null"]),
    # rope dicts transformers cannot build the rotary embedding from: each built with exit 0 before, and the MoE
    # (and the dense base) then failed to load with KeyError or TypeError
    ("rope-type-unknown", {"rope_parameters": {"rope_type": "bogus", "rope_theta": 10000.0}},
     ["rope_parameters.rope_type 'bogus' is not a rope type transformers knows", "known: default, linear"]),
    ("rope-old-type-unknown", {"rope_scaling": {"type": "su", "factor": 2.0}},
     ["rope_scaling.rope_type 'su' is not a rope type transformers knows"]),
    ("rope-linear-no-factor", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}},
     ["rope_parameters: rope_type 'linear' needs 'factor', which is missing"]),
    ("rope-llama3-partial", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
     ["rope_type 'llama3' needs 'original_max_position_embeddings'", "needs 'high_freq_factor'"]),
    ("rope-factor-string", {"rope_parameters": {"rope_type": "linear", "factor": "2", "rope_theta": 10000.0}},
     ["rope_parameters.factor must be a positive finite number, got '2'"]),
    ("rope-factor-bool", {"rope_scaling": {"type": "dynamic", "factor": True}},
     ["rope_scaling.factor must be a positive finite number, got True"]),
    ("rope-factor-zero", {"rope_scaling": {"rope_type": "yarn", "factor": 0}},
     ["rope_scaling.factor must be a positive finite number, got 0"]),
    ("rope-longrope-length", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                               "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}},
     ["rope_scaling.short_factor has 3 numbers; the rotary dimension needs 8"]),
    ("rope-longrope-strings", {"rope_scaling": {"rope_type": "longrope", "short_factor": "1,1",
                                                "long_factor": [1.0] * 8}},
     ["rope_scaling.short_factor must be a list of numbers, got '1,1'"]),
]


def _edited(src: Path, dest: Path, fields: dict) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(fields)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _recipe(tmp_path: Path, text: str) -> Path:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    return cfg


@pytest.mark.parametrize("case_id,fields,words", CASES, ids=[c[0] for c in CASES])
def test_bad_base_config_refused_before_writing(case_id, fields, words, tiny_llama, tmp_path):
    base = _edited(tiny_llama, tmp_path / "base", fields)
    target = tmp_path / "moe"
    start = time.monotonic()
    code, output = cli("build", _recipe(tmp_path, f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n"), target)
    assert time.monotonic() - start < 30  # absurd sizes fail fast instead of looping over them
    assert_clean_failure(code, output, target, words)
    # the plan (no output) refuses the same
    code, output = cli("plan", _recipe(tmp_path, f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n"))
    assert code == 1 and words[0] in " ".join(output.split()), output


def test_every_problem_named_at_once(tiny_llama, tmp_path):
    base = _edited(tiny_llama, tmp_path / "base", {"vocab_size": 999, "intermediate_size": 100,
                                                    "tie_word_embeddings": "yes", "rms_norm_eps": "tiny"})
    target = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n"), target)
    # types first (config.json alone), all of them in one run
    assert_clean_failure(code, output, target, ["tie_word_embeddings must be true or false, got 'yes'",
                                                "rms_norm_eps must be a positive finite number, got 'tiny'"])
    base2 = _edited(tiny_llama, tmp_path / "base2", {"vocab_size": 999, "intermediate_size": 100})
    code, output = cli("build", _recipe(tmp_path, f"base_model: {base2}\nnum_experts: 2\ngate_mode: random\n"), target)
    assert_clean_failure(code, output, target, ["model.embed_tokens.weight", "implies [999, 64]",
                                                "model.layers.0.mlp.gate_proj.weight", "implies [100, 64]",
                                                "lm_head.weight"])


def test_expert_config_contradicting_its_tensors_refused(tiny_llama, tmp_path):
    expert = _edited(tiny_llama, tmp_path / "expert", {"head_dim": 32})
    target = tmp_path / "moe"
    text = (f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n  - source_model: {tiny_llama}\n"
            f"  - source_model: {expert}\n")
    code, output = cli("build", _recipe(tmp_path, text), target)
    assert_clean_failure(code, output, target, [f"experts[1] ({expert})", "self_attn.q_proj.weight", "implies [128, 64]"])


def test_expert_with_another_activation_refused(tiny_llama, tmp_path):
    expert = _edited(tiny_llama, tmp_path / "expert", {"hidden_act": "gelu"})
    target = tmp_path / "moe"
    text = (f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n  - source_model: {tiny_llama}\n"
            f"  - source_model: {expert}\n")
    code, output = cli("build", _recipe(tmp_path, text), target)
    assert_clean_failure(code, output, target, [f"experts[1] ({expert})", "hidden_act is 'gelu' but base_model",
                                                "has 'silu'", "one value for all experts"])


SETTINGS = [
    ({"rms_norm_eps": 1e-5}, ["rms_norm_eps is 1e-05", "has 1e-06"]),
    ({"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
     ["rope settings is rope_theta=500000.0, scaling: none", "rope_theta=10000.0"]),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}},
     ["rope settings is rope_theta=10000.0, scaling: factor=4.0, rope_type='linear'"]),
]


@pytest.mark.parametrize("fields,words", SETTINGS, ids=["norm-eps", "rope-theta", "rope-scaling"])
def test_expert_with_other_attention_settings_builds_with_a_note(fields, words, tiny_llama, tmp_path):
    """Rope and norm eps act in attention and the norms, which the MoE takes from the base (as mergekit-moe does:
    published frankenMoEs mix Mistral v0.1 and v0.2 fine-tunes, rope_theta 1e4 and 1e6)."""
    from moe_upcycle.build import upcycle

    expert = _edited(tiny_llama, tmp_path / "expert", fields)
    result = upcycle({"base_model": str(tiny_llama), "gate_mode": "random",
                      "experts": [{"source_model": str(tiny_llama)}, {"source_model": str(expert)}]},
                     tmp_path / "moe", checksums=False)
    said = [n for n in result.plan.notes if n.startswith(f"experts[1] ({expert}): ")]
    assert said and "runs base_model's attention and norms with the base's value" in said[0], result.plan.notes
    for w in words:
        assert w in said[0], said
    base_cfg = json.loads((tiny_llama / "config.json").read_text())
    out_cfg = json.loads((result.output / "config.json").read_text())
    assert out_cfg["rms_norm_eps"] == base_cfg["rms_norm_eps"]
    assert out_cfg["rope_parameters"]["rope_theta"] == base_cfg["rope_parameters"]["rope_theta"]


def test_build_prints_the_note_plan_prints(tiny_llama, tmp_path):
    """`build` (not only `plan`) says that an expert's rope settings are not the MoE's: its user may never run plan."""
    expert = _edited(tiny_llama, tmp_path / "expert", SETTINGS[1][0])
    target = tmp_path / "moe"
    text = (f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n"
            f"  - source_model: {tiny_llama}\n  - source_model: {expert}\n")
    code, output = cli("build", _recipe(tmp_path, text), target, "--no-checksums")
    assert code == 0, output
    flat = " ".join(output.split())
    assert f"note: experts[1] ({expert}): rope settings is" in flat, output
    assert "runs base_model's attention and norms with the base's value" in flat
    out_cfg = json.loads((target / "config.json").read_text())
    assert out_cfg["num_local_experts"] == 2 and out_cfg["rope_theta"] == 10000.0  # the base's, as the note says


@pytest.mark.parametrize("fields,words", SETTINGS, ids=["norm-eps", "rope-theta", "rope-scaling"])
def test_other_attention_settings_refused_when_attention_is_averaged(fields, words, tiny_llama, tmp_path):
    expert = _edited(tiny_llama, tmp_path / "expert", fields)
    target = tmp_path / "moe"
    text = (f"base_model: {tiny_llama}\ngate_mode: random\nattention_from: average\nexperts:\n"
            f"  - source_model: {tiny_llama}\n  - source_model: {expert}\n")
    code, output = cli("build", _recipe(tmp_path, text), target)
    assert_clean_failure(code, output, target, [f"experts[1] ({expert})", *words, "attention_from: average would",
                                                "use attention_from: base"])


def test_same_settings_written_differently_still_build(tiny_llama, tmp_path):
    """rope_theta at the top level (transformers 4.x) equals the same value in rope_parameters."""
    cfg = json.loads((tiny_llama / "config.json").read_text())
    fields = {"rope_theta": cfg["rope_parameters"]["rope_theta"]}
    expert = _edited(tiny_llama, tmp_path / "expert", fields)
    json_cfg = json.loads((expert / "config.json").read_text())
    del json_cfg["rope_parameters"]
    (expert / "config.json").write_text(json.dumps(json_cfg))
    text = (f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n  - source_model: {tiny_llama}\n"
            f"  - source_model: {expert}\n")
    code, output = cli("build", _recipe(tmp_path, text), tmp_path / "moe")
    assert code == 0, output


def test_known_rope_types_are_transformers_own():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moe_upcycle.checkpoint.config_checks import ROPE_REQUIRED

    assert set(ROPE_REQUIRED) == set(ROPE_INIT_FUNCTIONS) | {"default"}


@pytest.mark.parametrize("rope", [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
     "rope_type": "llama3"},  # Llama 3.1
    {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},  # Qwen2.5, the old key
    {"type": "dynamic", "factor": 2.0}, {"type": "linear", "factor": 2}, {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2] * 8, "factor": 4.0,
     "original_max_position_embeddings": 64},
    {}])
def test_real_rope_dicts_pass(rope):
    from moe_upcycle.checkpoint.config_checks import value_problems

    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_scaling": rope}
    assert value_problems(config) == []
    assert value_problems({**config, "rope_scaling": None, "rope_parameters": rope}) == []


def test_known_activations_are_transformers_own():
    from transformers.activations import ACT2FN

    from moe_upcycle.checkpoint.config_checks import ACTIVATIONS

    assert ACTIVATIONS <= set(ACT2FN)


@pytest.mark.parametrize("name,content", [("tokenizer.json", b'{"version": "1.0", "trunc'),
                                          ("tokenizer.json", b'{"version": "1.0"}'),  # JSON, but no tokenizer
                                          ("tokenizer.json", b'{"version": "1.0", "model": {"type": "BPE"}}'),
                                          ("tokenizer_config.json", b"\xff\xfe"),
                                          ("generation_config.json", b"[1, 2]")])
def test_damaged_tokenizer_or_generation_file_refused(name, content, tiny_llama, tmp_path):
    """These files are copied byte for byte into the MoE: a truncated one is refused, not shipped."""
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    (base / name).write_bytes(content)
    target = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n"), target)
    assert_clean_failure(code, output, target, [f"{base / name}:", "re-download it"])


def test_activation_aliases_are_one_activation(tiny_llama, tmp_path):
    """transformers' `swish` is `silu` (the same function): an expert that spells it so builds."""
    from moe_upcycle.build import upcycle

    expert = _edited(tiny_llama, tmp_path / "expert", {"hidden_act": "swish"})
    result = upcycle({"base_model": str(tiny_llama), "gate_mode": "random",
                      "experts": [{"source_model": str(tiny_llama)}, {"source_model": str(expert)}]},
                     tmp_path / "moe", checksums=False)
    assert json.loads((result.output / "config.json").read_text())["hidden_act"] == "silu"


def test_two_dtypes_build_when_the_recipe_says_which(tiny_llama, tmp_path):
    base = _edited(tiny_llama, tmp_path / "base", {"torch_dtype": "float16", "dtype": "bfloat16"})
    code, output = cli("build", _recipe(tmp_path, f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n"
                                                  f"dtype: bfloat16\n"), tmp_path / "moe")
    assert code == 0, output
    out_cfg = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert out_cfg["dtype"] == "bfloat16" and out_cfg["torch_dtype"] == "bfloat16"
