"""Rope scaling as published configs spell it: the MoE rotates as its dense base does, and the plan says where.

Each case is a tiny random dense model whose config.json carries rope scaling the way real ones do
(transformers 4.x keys, as on the Hub): linear under ``type`` or ``rope_type``, dynamic NTK, Qwen2.5's
yarn (``type``), yarn without ``original_max_position_embeddings``, yarn with both keys (what 4.x's
``save_pretrained`` writes), yarn with ``attention_factor`` or betas, Qwen3's yarn, a transformers-5
``rope_parameters`` yarn, Llama-3.1's llama3 (with its list of eos ids), longrope with
``original_max_position_embeddings`` inside or at the top level (Phi-3 style), with an explicit ``factor``,
a Llama-1-era config that leaves rope_theta / rms_norm_eps / max_position_embeddings out. ``max_position_embeddings`` is 16 (64 for longrope)
and the text 40 tokens, so every scaling is in play. Checked: transformers 5 logits equal the dense
model's; the written config.json spells the scaling once, in the keys every runtime reads
(`planning.rope`); transformers 4.57 (when ``.venv-tf4`` exists) does what the plan's verdict says,
judged against the dense model in transformers 5. llama.cpp's verdicts for the same classes are
measured by ``scripts/check_llamacpp.py`` (cases "dynamic rope", "yarn x4", "longrope", ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.planning.runtimes import EXACT, NO_LOAD, RUNS, compatibility
from tf4_logits import NO_TF4, TF4_PYTHON, tf4_logits, tf5_logits
from tolerances import assert_close_rel

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer")  # logits are fed token ids
SEQ = 40
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300)
COMMON = dict(DIMS, max_position_embeddings=16, bos_token_id=1, eos_token_id=2, hidden_act="silu",
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, attention_dropout=0.0,
              transformers_version="4.45.0", torch_dtype="float32")
LLAMA = dict(COMMON, model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=10000.0,
             tie_word_embeddings=False, head_dim=16)
QWEN2 = dict(COMMON, model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6, tie_word_embeddings=False,
             sliding_window=None, use_sliding_window=False)
QWEN3 = dict(COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], rope_theta=1e6, tie_word_embeddings=True,
             head_dim=32, attention_bias=False, sliding_window=None, use_sliding_window=False)
YARN = {"factor": 4.0, "original_max_position_embeddings": 16}
LONG = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}
CONFIGS = {  # name -> config.json as published
    "linear-type": dict(LLAMA, rope_scaling={"type": "linear", "factor": 2.0}),
    "linear-rope_type": dict(LLAMA, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "dynamic": dict(LLAMA, rope_scaling={"type": "dynamic", "factor": 2.0}),
    "dynamic-qwen2": dict(QWEN2, rope_scaling={"type": "dynamic", "factor": 2.0}),
    "yarn-qwen2.5": dict(QWEN2, rope_scaling={**YARN, "type": "yarn"}),
    "yarn-no-original": dict(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    "yarn-both-keys": dict(LLAMA, rope_scaling={**YARN, "type": "yarn", "rope_type": "yarn"}),
    "yarn-attention-factor": dict(LLAMA, rope_scaling={**YARN, "rope_type": "yarn", "attention_factor": 0.8}),
    "yarn-betas": dict(LLAMA, rope_scaling={**YARN, "rope_type": "yarn", "beta_fast": 16.0, "beta_slow": 2.0}),
    "yarn-long-context": dict(LLAMA, max_position_embeddings=64, rope_scaling={**YARN, "rope_type": "yarn"}),
    "yarn-qwen3": dict(QWEN3, rope_scaling={**YARN, "rope_type": "yarn"}),
    "yarn-rope_parameters": dict({k: v for k, v in LLAMA.items() if k != "rope_theta"},
                                 rope_parameters={**YARN, "rope_type": "yarn", "rope_theta": 10000.0}),
    # Llama-1 era: no rope_theta, rms_norm_eps, max_position_embeddings (Mixtral's defaults: 1e6, 1e-5, 131072)
    "llama-1-defaults": {k: v for k, v in LLAMA.items()
                         if k not in ("rope_theta", "rms_norm_eps", "max_position_embeddings")},
    # Llama-3.1 style: llama3 rope, a list of eos ids, a pad id, tied embeddings
    "llama3.1": dict(LLAMA, eos_token_id=[2, 5, 7], pad_token_id=0, tie_word_embeddings=True, rope_theta=500000.0,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8}),
    "longrope": dict(LLAMA, max_position_embeddings=64,
                     rope_scaling={**LONG, "rope_type": "longrope", "original_max_position_embeddings": 16}),
    "longrope-top-level": dict(LLAMA, max_position_embeddings=64, original_max_position_embeddings=16,
                               rope_scaling={**LONG, "type": "longrope"}),
    "longrope-factor": dict(LLAMA, max_position_embeddings=64, rope_scaling={
        **LONG, "rope_type": "longrope", "original_max_position_embeddings": 16, "factor": 2.0}),
}
ALL_EXACT = (EXACT, EXACT, EXACT, EXACT)
YARN_EXACT = (EXACT, EXACT, EXACT, RUNS)
# (config, architecture) -> verdicts of (transformers 4.x, vLLM, llama.cpp, ExLlamaV2); qwen2_moe runs with every
# expert active (k = 4 of 4), so llama.cpp's unrenormalised routing is not in play
CASES = {
    ("linear-type", "mixtral"): ALL_EXACT,
    ("linear-rope_type", "qwen2_moe"): (EXACT, EXACT, EXACT, NO_LOAD),  # ExLlamaV2 has no Qwen2-MoE
    ("dynamic", "mixtral"): (EXACT, RUNS, RUNS, RUNS),
    ("dynamic-qwen2", "qwen2_moe"): (EXACT, RUNS, RUNS, NO_LOAD),
    ("yarn-qwen2.5", "qwen2_moe"): (EXACT, EXACT, EXACT, NO_LOAD),
    # ExLlamaV2 applies yarn only when max_seq_len (default max_position_embeddings 16) exceeds the original 16
    ("yarn-no-original", "mixtral"): YARN_EXACT,
    ("yarn-both-keys", "mixtral"): YARN_EXACT,
    ("yarn-attention-factor", "mixtral"): (EXACT, RUNS, RUNS, RUNS),
    ("yarn-betas", "mixtral"): (EXACT, EXACT, EXACT, RUNS),
    ("yarn-qwen3", "qwen3_moe"): YARN_EXACT,
    ("yarn-rope_parameters", "mixtral"): YARN_EXACT,
    ("yarn-long-context", "mixtral"): ALL_EXACT,  # max_position_embeddings 64 > original 16
    ("llama3.1", "mixtral"): ALL_EXACT,
    ("llama-1-defaults", "mixtral"): ALL_EXACT,
    ("longrope", "mixtral"): (EXACT, EXACT, RUNS, RUNS),
    ("longrope-top-level", "qwen2_moe"): (EXACT, EXACT, RUNS, NO_LOAD),
    ("longrope-factor", "mixtral"): (RUNS, EXACT, RUNS, RUNS),
}
RUNTIMES = ("transformers 4.x", "vLLM", "llama.cpp", "ExLlamaV2")
# what the runtimes' reasons name (a fragment each)
WHY = {
    ("dynamic", "mixtral"): {"llama.cpp": "identical up to max_position_embeddings (16 tokens)",
                             "vLLM": "at every position", "ExLlamaV2": "no dynamic NTK"},
    ("yarn-attention-factor", "mixtral"): {"llama.cpp": "0.1 ln(factor) + 1", "vLLM": "attn_factor, not attention_factor",
                                           "ExLlamaV2": "factor and original_max_position_embeddings only"},
    ("longrope", "mixtral"): {"llama.cpp": "no short/long rope factors", "ExLlamaV2": "short ones up to 16 tokens"},
    ("yarn-qwen3", "qwen3_moe"): {"ExLlamaV2": "exceeds original_max_position_embeddings (16)"},
    ("longrope-factor", "mixtral"): {"transformers 4.x": "(64 / 16), not factor 2.0"},
}


def _ids() -> list[int]:
    return torch.randint(3, DIMS["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(0)).tolist()


def _dense(root: Path, name: str) -> Path:
    config = CONFIGS[name]
    extra = {k: config[k] for k in ("head_dim", "attention_bias") if config.get(k) is not None}
    folder = make_dense_model(root / name, family=config["model_type"], seed=11, random_norms_and_biases=True,
                              tie_word_embeddings=config["tie_word_embeddings"], tokenizer=False, **DIMS, **extra)
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # as published, not as transformers 5 saves it
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """Every case built once: (config, arch) -> (dense folder, MoE folder, plan)."""
    root = tmp_path_factory.mktemp("rope")
    dense = {name: _dense(root, name) for name in CONFIGS}
    out = {}
    for name, arch in CASES:
        recipe = {"base_model": str(dense[name]), "num_experts": 4, "gate_mode": "random", "architecture": arch,
                  "experts_per_token": 4 if arch == "qwen2_moe" else 2}
        result = upcycle(recipe, root / f"{name}-{arch}")
        out[(name, arch)] = (dense[name], result.output, result.plan)
    return out


def _logits(folder: Path) -> torch.Tensor:
    return tf5_logits(folder, _ids())


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(c) for c in CASES])
def test_transformers5_exact_and_verdicts_per_runtime(case, built):
    dense, moe, plan = built[case]
    assert_close_rel(_logits(moe), _logits(dense))  # positions past max_position_embeddings included
    verdicts = {v.runtime: v for v in compatibility(plan)}
    assert verdicts["transformers 5"].status == EXACT
    assert tuple(verdicts[r].status for r in RUNTIMES) == CASES[case], [verdicts[r].line() for r in RUNTIMES]
    for runtime, fragment in WHY.get(case, {}).items():
        assert fragment in verdicts[runtime].why, verdicts[runtime].line()
    if verdicts["llama.cpp"].status == RUNS:  # the plan says it where the user reads it
        assert any(n.startswith("llama.cpp: runs, not exact") for n in plan.notes), plan.notes


@pytest.mark.parametrize("case,scaling,top_level", [
    # one key: `type`, which ExLlamaV2 reads for linear / yarn / longrope (it asserts when both are present)
    (("yarn-both-keys", "mixtral"), {**YARN, "type": "yarn"}, {}),
    (("linear-rope_type", "qwen2_moe"), {"type": "linear", "factor": 2.0}, {}),
    # yarn's original_max_position_embeddings as transformers uses it (vLLM and ExLlamaV2 require it)
    (("yarn-no-original", "mixtral"), {**YARN, "type": "yarn"}, {}),
    (("yarn-qwen2.5", "qwen2_moe"), {**YARN, "type": "yarn"}, {"rope_theta": 1e6}),
    # transformers 5's rope_parameters: rope_scaling and rope_theta written beside it, saying the same
    (("yarn-rope_parameters", "mixtral"), {**YARN, "type": "yarn"},
     {"rope_theta": 10000.0, "rope_parameters": {**YARN, "rope_type": "yarn", "rope_theta": 10000.0}}),
    # llama3 keeps rope_type (the only key ExLlamaV2 reads for it); token ids as published
    (("llama3.1", "mixtral"), {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8},
     {"rope_theta": 500000.0, "eos_token_id": [2, 5, 7], "pad_token_id": 0, "bos_token_id": 1,
      "tie_word_embeddings": True}),
    # the Llama defaults written out, not left to Mixtral's
    (("llama-1-defaults", "mixtral"), None, {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}),
    # longrope: original_max_position_embeddings at the top level too (4.57 and ExLlamaV2 read it only there)
    (("longrope", "mixtral"), {**LONG, "original_max_position_embeddings": 16, "type": "longrope"},
     {"original_max_position_embeddings": 16}),
    (("longrope-top-level", "qwen2_moe"), {**LONG, "original_max_position_embeddings": 16, "type": "longrope"},
     {"original_max_position_embeddings": 16}),
])
def test_written_rope_fields(built, case, scaling, top_level):
    cfg = json.loads((built[case][1] / "config.json").read_text())
    assert cfg.get("rope_scaling") == scaling
    assert {k: cfg.get(k) for k in top_level} == top_level


@pytest.fixture(scope="module")
def saved_in_memory(built, tmp_path_factory) -> dict:
    """upcycle_model + save_pretrained on two bases: what transformers 5 saves must keep our rope spelling."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle import upcycle_model

    root = tmp_path_factory.mktemp("rope_in_memory")
    out = {}
    for name in ("yarn-both-keys", "longrope"):
        model = AutoModelForCausalLM.from_pretrained(str(built[(name, "mixtral")][0]), dtype=torch.float32).eval()
        upcycle_model(model, num_experts=4, experts_per_token=2, architecture="mixtral").save_pretrained(
            str(root / name))
        out[name] = root / name
    return out


def test_upcycle_model_saves_one_rope_spelling(saved_in_memory):
    cfg = json.loads((saved_in_memory["yarn-both-keys"] / "config.json").read_text())
    assert cfg["rope_scaling"] == {**YARN, "type": "yarn"}  # transformers 5 had added rope_type and rope_theta in place
    cfg = json.loads((saved_in_memory["longrope"] / "config.json").read_text())
    assert cfg["original_max_position_embeddings"] == 16 and cfg["rope_scaling"]["type"] == "longrope"


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_transformers4_does_what_the_verdict_says(built, saved_in_memory):
    """One 4.57 process runs every MoE; each is judged against its dense model in transformers 5 (4.57 cannot run
    some of the dense models: a longrope without a top-level original_max_position_embeddings, a config that
    transformers 5 saved)."""
    folders = [str(moe) for _, moe, _ in built.values()] + [str(p) for p in saved_in_memory.values()]
    got = tf4_logits(_ids(), folders)
    wrong = []
    for case, (dense, moe, plan) in built.items():
        verdict = {v.runtime: v.status for v in compatibility(plan)}["transformers 4.x"]
        have = got[str(moe)]
        if isinstance(have, str):
            seen = NO_LOAD
        else:
            want, have = _logits(dense), torch.tensor(have)
            seen = EXACT if float((have - want).abs().max()) <= 1e-5 * float(want.abs().max()) else RUNS
        if seen != verdict:
            wrong.append(f"{case}: verdict {verdict}, 4.57 {seen}" + (f" ({have})" if seen == NO_LOAD else ""))
    assert not wrong, wrong
    for name, folder in saved_in_memory.items():
        assert not isinstance(got[str(folder)], str), f"{name}: {got[str(folder)]}"
        assert_close_rel(torch.tensor(got[str(folder)]), _logits(built[(name, "mixtral")][0]))


# the same scaling as a base and its fine-tunes may spell it (the Hub's config, 4.57's re-save with both keys,
# transformers 5's rope_parameters): one rope setting, so a frankenMoE of them builds
SPELLINGS = {
    "type": {"rope_theta": 1e6, "rope_scaling": {**YARN, "type": "yarn"}},
    "both-keys": {"rope_theta": 1e6, "rope_scaling": {**YARN, "type": "yarn", "rope_type": "yarn"}},
    "rope_parameters": {"rope_parameters": {**YARN, "rope_type": "yarn", "rope_theta": 1e6}},
    "no-original": {"rope_theta": 1e6, "rope_scaling": {"factor": 4.0, "rope_type": "yarn"}},  # max_position 16
}


def _expert_recipe(built, fields: dict, folder: Path) -> dict:
    base = built[("yarn-qwen2.5", "qwen2_moe")][0]
    cfg = {k: v for k, v in json.loads((base / "config.json").read_text()).items()
           if k not in ("rope_theta", "rope_scaling")}
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(base / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))
    return {"base_model": str(base), "gate_mode": "random", "architecture": "qwen2_moe", "experts_per_token": 2,
            "experts": [{"source_model": str(base)}, {"source_model": str(folder)}]}


@pytest.mark.parametrize("spelling", [s for s in SPELLINGS if s != "type"])
def test_experts_with_the_same_rope_spelled_otherwise_build(built, spelling, tmp_path):
    plan = upcycle(_expert_recipe(built, SPELLINGS[spelling], tmp_path / "expert"), dry_run=True).plan
    assert plan.experts_per_token == 2 and len(plan.expert_names) == 2
    assert not [n for n in plan.notes if "rope settings" in n], plan.notes  # the same scaling: nothing to say


def test_expert_with_another_yarn_factor_builds_with_a_note(built, tmp_path):
    """Another real factor is named (the MoE runs the base's attention, as mergekit-moe builds it)."""
    fields = {"rope_theta": 1e6, "rope_scaling": {**YARN, "factor": 2.0, "rope_type": "yarn"}}
    plan = upcycle(_expert_recipe(built, fields, tmp_path / "expert"), dry_run=True).plan
    notes = [n for n in plan.notes if "rope settings" in n]
    assert len(notes) == 1 and "experts[1]" in notes[0], plan.notes
    assert "factor=2.0" in notes[0] and "factor=4.0" in notes[0] and "base's value" in notes[0]


@pytest.mark.parametrize("base,written", [
    # "default" under both keys is no scaling: null, which ExLlamaV2 reads (it asserts on a dict with both keys)
    ({"rope_theta": 1e6, "rope_scaling": {"type": "default", "rope_type": "default"}},
     {"rope_theta": 1e6, "rope_scaling": None}),
    ({"rope_scaling": None}, {"rope_theta": 10000.0, "rope_scaling": None}),  # Llama-1 era: transformers' default
    # transformers 5: rope_theta from rope_parameters, written beside it for 4.x
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
    # a scaling type we do not respell stays as the base has it
    ({"rope_theta": 1e4, "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.5}},
     {"rope_theta": 1e4, "rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.5}}),
])
def test_rope_fields_of_unscaled_and_unknown_types(base, written):
    from moe_upcycle.planning.rope import rope_fields

    assert rope_fields({"max_position_embeddings": 16, **base}) == written


def test_mistral_config_without_sliding_window_key_keeps_transformers_default_window(tmp_path):
    """MistralConfig's default window is 4096 (4.57 and 5): a config.json without the key slides, so must the MoE."""
    dense = make_dense_model(tmp_path / "mistral", family="mistral", tokenizer=False, **DIMS)
    cfg = json.loads((dense / "config.json").read_text())
    del cfg["sliding_window"]
    (dense / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(dense)).sliding_window == 4096
    for arch, written in (("mixtral", {"sliding_window": 4096}),
                          ("qwen2_moe", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 0})):
        result = upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 4, "gate_mode": "random",
                          "architecture": arch}, tmp_path / arch)
        out = json.loads((result.output / "config.json").read_text())
        assert {k: out.get(k) for k in written} == written
        llamacpp = next(v for v in compatibility(result.plan) if v.runtime == "llama.cpp")
        assert llamacpp.status == RUNS and "window of 4096 tokens" in llamacpp.why
