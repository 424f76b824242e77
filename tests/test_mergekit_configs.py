"""Published mergekit-moe configs (tests/data/mergekit_configs) build unchanged, or are refused only
where the config itself is wrong — with a message naming the key and the fix.

Hub ids in the configs are served from a fake Hugging Face cache whose snapshots are tiny local
models of the right family (Qwen3 ids → tiny Qwen3, other Qwen ids → tiny Qwen2, the rest → tiny
Llama), each id a fixed choice among the family's base and two stand-in fine-tunes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import model_logits
from fake_hub import build_hub_cache, model_refs
from moe_upcycle.build import upcycle
from moe_upcycle.cli import app
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import UpcycleError, UpcycleWarning
from moe_upcycle.checkpoint.tiny import make_finetune

CONFIGS = Path(__file__).resolve().parent / "data" / "mergekit_configs"

# file -> (model_type, architecture class, experts, experts per token, dtype) of the built output
BUILDS = {
    "beyonder_4x7b": ("mixtral", "MixtralForCausalLM", 4, 2, "float32"),
    "mixtral_2x7b_random": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "laser_dolphin_2x7b": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "tinyllama_4x_fp16": ("mixtral", "MixtralForCausalLM", 4, 1, "float16"),
    "default_expert_empty_prompt": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "null_prompt_lists": ("mixtral", "MixtralForCausalLM", 2, 2, "float32"),
    "anchors_aliases": ("mixtral", "MixtralForCausalLM", 3, 2, "bfloat16"),
    "architecture_mixtral_caps": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "qwen2_shared_expert": ("qwen2_moe", "Qwen2MoeForCausalLM", 2, 2, "bfloat16"),
    "qwen3_4x": ("qwen3_moe", "Qwen3MoeForCausalLM", 4, 2, "bfloat16"),
    "qwen_on_qwen3": ("qwen3_moe", "Qwen3MoeForCausalLM", 2, 2, "float32"),
    "noise_residual_scale": ("mixtral", "MixtralForCausalLM", 4, 2, "float32"),
    "dtype_spellings": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "dtype_bf16": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "hidden_avg": ("mixtral", "MixtralForCausalLM", 2, 2, "float16"),
    "hidden_last": ("mixtral", "MixtralForCausalLM", 2, 2, "float32"),
    "revision_refs": ("mixtral", "MixtralForCausalLM", 2, 2, "float32"),
    "unknown_keys": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "eight_experts_top1": ("mixtral", "MixtralForCausalLM", 8, 1, "float32"),
    "llama3_4x8b": ("mixtral", "MixtralForCausalLM", 4, 2, "bfloat16"),
}
# file -> words the refusal must contain (the key and the fix)
REFUSED = {
    "null_prompts_hidden": ["experts[0].positive_prompts", "gate_mode hidden needs at least one prompt"],
    "deepseek_shared": ["architecture: deepseek", "trust_remote_code", "use architecture: qwen2_moe",
                        "shared_expert_gate: constant", "shared_experts[0].residual_scale: 0.2"],
    "typo_key": ["experts[0].postive_prompts: unknown key", "did you mean positive_prompts?"],
    "too_many_per_token": ["experts_per_token is 4 but there are only 2 experts", "use a value from 1 to 2"],
    "unknown_keys": ["merge_method: unknown key", "--allow-unknown-keys", "experts[0].weight: unknown key"],
}
ALLOW_UNKNOWN = {"unknown_keys"}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_llama, tiny_qwen2, tiny_qwen3) -> Path:
    """A Hugging Face cache (models--org--name/{refs,snapshots}) holding every hub id of the configs."""
    root = tmp_path_factory.mktemp("hf_cache")
    stand_ins = {}
    for family, base in (("llama", tiny_llama), ("qwen2", tiny_qwen2), ("qwen3", tiny_qwen3)):
        stand_ins[family] = [base] + [make_finetune(base, root.parent / f"{root.name}_{family}_ft{s}", seed=s)
                                      for s in (1, 2)]
    refs = set()
    for path in CONFIGS.glob("*.yaml"):
        refs |= model_refs(yaml.safe_load(path.read_text()))
    return build_hub_cache(root, stand_ins, refs)


@pytest.fixture
def cache(hub_cache, monkeypatch) -> Path:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def test_at_least_twenty_published_shapes():
    names = {p.stem for p in CONFIGS.glob("*.yaml")}
    assert len(names) >= 20
    assert names == set(BUILDS) | set(REFUSED), "every config has an expectation"


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_published_config_builds_unchanged(name, cache, tmp_path):
    model_type, arch_class, n_experts, per_token, dtype = BUILDS[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UpcycleWarning)
        result = upcycle(CONFIGS / f"{name}.yaml", tmp_path / "out", checksums=False,
                         allow_unknown_keys=name in ALLOW_UNKNOWN)
    config = json.loads((result.output / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (model_type, [arch_class])
    experts_key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    assert (config[experts_key], config["num_experts_per_tok"], config["dtype"]) == (n_experts, per_token, dtype)
    logits = model_logits(result.output)  # transformers loads it with no missing or unexpected keys
    assert torch.isfinite(logits).all()
    if name in ALLOW_UNKNOWN:
        ignored = sorted(str(w.message).split(":")[0] for w in caught if "unknown key ignored" in str(w.message))
        assert ignored == ["experts[0].weight", "merge_method", "tokenizer_source"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_wrong_published_config_is_refused_with_the_key_and_fix(name, cache, tmp_path):
    with pytest.raises(UpcycleError) as info:
        upcycle(CONFIGS / f"{name}.yaml", tmp_path / "out", checksums=False)
    text = " ".join(str(info.value).split())
    for words in REFUSED[name]:
        assert words in text
    assert not (tmp_path / "out").exists()


def test_revision_refs_resolve_to_that_snapshot(cache):
    from moe_upcycle.checkpoint.model_refs import resolve_model

    commit = "3bac358730f8806e5c3dc7c7e19eb36e045bf720"
    path = resolve_model(f"HuggingFaceH4/zephyr-7b-beta@{commit}", "experts[1].source_model")
    assert path.name == commit and (path / "config.json").is_file()
    main = resolve_model("mistralai/Mistral-7B-v0.1@main", "base_model")
    assert main == resolve_model("mistralai/Mistral-7B-v0.1", "base_model")
    with pytest.raises(UpcycleError) as info:
        resolve_model("mistralai/Mistral-7B-v0.1@v9.9", "base_model")
    assert "at revision 'v9.9'" in str(info.value) and "--revision v9.9" in str(info.value)


def test_the_note_is_printed_once_and_names_the_switch(cache, tmp_path):
    runner = CliRunner()
    config = CONFIGS / "beyonder_4x7b.yaml"
    result = runner.invoke(app, ["build", str(config), str(tmp_path / "a"), "--no-checksums"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.count("note:") == 1
    assert "gate_mode: hidden was built with moe-upcycle's router inputs" in text
    assert "gate_source: mergekit" in text and "--mergekit" in text
    result = runner.invoke(app, ["build", str(config), str(tmp_path / "b"), "--no-checksums", "--mergekit"])
    assert result.exit_code == 0, result.output
    assert "note:" not in result.output
    recipe = json.loads((tmp_path / "b" / "moe_upcycle.json").read_text())
    assert recipe["config"]["gate_source"] == "mergekit"


def test_unknown_keys_cli_flag(cache, tmp_path):
    runner = CliRunner()
    config = CONFIGS / "unknown_keys.yaml"
    refused = runner.invoke(app, ["build", str(config), str(tmp_path / "a")])
    assert refused.exit_code == 1
    assert "tokenizer_source: unknown key" in " ".join(refused.output.split())
    built = runner.invoke(app, ["build", str(config), str(tmp_path / "b"), "--allow-unknown-keys", "--no-checksums"])
    assert built.exit_code == 0, built.output
    text = " ".join(built.output.split())
    assert text.count("warning: tokenizer_source: unknown key ignored") == 1  # once, not again by the lint pass
    planned = runner.invoke(app, ["plan", str(config), "--allow-unknown-keys"])
    assert planned.exit_code == 0, planned.output
    assert "warning: merge_method: unknown key ignored" in " ".join(planned.output.split())


@pytest.mark.parametrize("spelling, ours", [
    ("mixtral", "mixtral"), ("Mixtral", "mixtral"), ("MIXTRAL", "mixtral"), ("qwen", "qwen"), ("Qwen", "qwen"),
    ("qwen moe", "qwen2_moe"), ("Qwen MoE", "qwen2_moe"), ("qwen2_moe", "qwen2_moe"), ("qwen2", "qwen2_moe"),
    ("qwen3", "qwen3_moe"), ("Qwen3 MoE", "qwen3_moe"), ("qwen3_moe", "qwen3_moe"), ("deepseek", "deepseek"),
    ("DeepSeek MoE", "deepseek"), ("", None),
])
def test_architecture_spellings(spelling, ours):
    config = load_config({"base_model": "m", "num_experts": 2, "gate_mode": "random", "architecture": spelling})
    assert config.architecture == ours


@pytest.mark.parametrize("spelling, ours", [
    ("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("torch.bfloat16", "bfloat16"),
    ("float16", "float16"), ("fp16", "float16"), ("half", "float16"), ("torch.float16", "float16"),
    ("float32", "float32"), ("fp32", "float32"), ("float", "float32"), ("torch.float32", "float32"),
])
def test_dtype_spellings(spelling, ours):
    config = load_config({"base_model": "m", "num_experts": 2, "gate_mode": "random", "dtype": spelling})
    assert config.dtype == ours


def test_unknown_architecture_lists_the_choices():
    with pytest.raises(UpcycleError) as info:
        load_config({"base_model": "m", "num_experts": 2, "architecture": "llama"})
    assert "architecture: 'llama' is not allowed" in str(info.value) and "'mixtral'" in str(info.value)


@pytest.mark.parametrize("key, hint", [
    ("gate_mdoe", "gate_mode"), ("Base_Model", "base_model"), ("experts-per-token", "experts_per_token"),
    ("experts_per_tok", "experts_per_token"), ("num_experts_per_tok", "experts_per_token"), ("dtpye", "dtype"),
])
def test_typos_are_errors_even_when_unknown_keys_are_allowed(key, hint):
    with pytest.raises(UpcycleError) as info:
        load_config({"base_model": "m", "num_experts": 2, key: 1}, allow_unknown_keys=True)
    assert f"{key}: unknown key — did you mean {hint}?" in str(info.value)


def test_empty_and_null_prompts_are_accepted():
    config = load_config({"base_model": "m", "gate_mode": "hidden", "experts": [
        {"source_model": "m", "positive_prompts": [""], "negative_prompts": None},
        {"source_model": "m", "positive_prompts": ["  "]}], "shared_experts": None})
    assert [e.positive_prompts for e in config.experts] == [[""], ["  "]]
    assert config.experts[0].negative_prompts == [] and config.shared_experts == []


def test_qwen_on_qwen3_with_a_shared_expert_says_which_output_it_read(tiny_qwen3):
    """mergekit's Qwen3 MoE has no shared expert, so "qwen" means qwen2_moe, which cannot hold Qwen3's q/k norms."""
    base = str(tiny_qwen3)
    with pytest.raises(UpcycleError) as info:
        upcycle({"base_model": base, "architecture": "qwen", "gate_mode": "random",
                 "experts": [{"source_model": base}, {"source_model": base}], "shared_experts": [{"source_model": base}]},
                dry_run=True)
    assert str(info.value).startswith("architecture: qwen (read as qwen2_moe): the base has q/k norms "
                                      "(self_attn.q_norm.weight), which Qwen2-MoE cannot hold")


def _qwen_recipe(base: Path, expert_arch: str) -> dict:
    """BenevolenceMessiah/Qwen2.5-Coder-7B-Chat-8x-MoE's shape: architecture: qwen at the top and under every
    expert and the shared expert."""
    return {"base_model": str(base), "architecture": "qwen", "gate_mode": "random", "dtype": "float32",
            "experts": [{"source_model": str(base), "architecture": expert_arch} for _ in range(2)],
            "shared_experts": [{"source_model": str(base), "architecture": "qwen"}]}


def test_a_top_level_key_repeated_under_each_expert_with_its_value_builds(tiny_qwen2, tmp_path):
    """mergekit-moe ignores the copies; before, each was refused with "it belongs at the top level; move it there",
    though it was there already."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = upcycle(_qwen_recipe(tiny_qwen2, "qwen"), tmp_path / "moe")
    said = [str(w.message) for w in caught if issubclass(w.category, UpcycleWarning) and "repeated" in str(w.message)]
    assert said == ["architecture: repeated in experts[0], experts[1] and shared_experts[0] with the top level's "
                    "value; the copies are ignored (the MoE has one architecture, set at the top level) — remove "
                    "them to silence this warning"]
    config = json.loads((result.output / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["shared_expert_intermediate_size"] > 0) == \
        ("qwen2_moe", 2, True)


def test_a_top_level_key_repeated_under_an_expert_with_another_value_is_refused(tiny_qwen2, tmp_path):
    with pytest.raises(UpcycleError) as caught:
        upcycle(_qwen_recipe(tiny_qwen2, "mixtral"), tmp_path / "moe")
    assert caught.value.problems == [
        "config: experts[0].architecture: unknown key — the MoE has one architecture, and the top level already "
        "says architecture: 'qwen'; remove it here",
        "config: experts[1].architecture: unknown key — the MoE has one architecture, and the top level already says "
        "architecture: 'qwen'; remove it here"]
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("source,builds", [("model:{base}", True), ("model: {base}/", True), ("base", True),
                                           ("model:{other}", False), ("model:", False)])
def test_tokenizer_source_naming_base_model_is_base(source, builds, tiny_llama, tiny_mistral, tmp_path):
    """Aratako/Qwen1.5-MoE-2x72B writes tokenizer_source: model:./Qwen1.5-72B-Chat beside base_model:
    ./Qwen1.5-72B-Chat — base_model's tokenizer, which every MoE gets; another model's stays refused."""
    recipe = {"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random",
              "tokenizer_source": source.format(base=tiny_llama, other=tiny_mistral)}
    if builds:
        assert load_config(recipe).base_model == str(tiny_llama)
    else:
        with pytest.raises(UpcycleError, match="tokenizer_source: unknown key"):
            load_config(recipe)


@pytest.mark.parametrize("family,window", [("mistral", 4096), ("llama", None)])
def test_a_base_with_a_sliding_window_is_told_mergekit_drops_it(family, window, tiny_llama, tiny_mistral):
    """mergekit-moe 0.1.5 writes sliding_window: null for Mixtral and Qwen2-MoE; this MoE keeps the dense
    model's window (Mistral-7B-v0.1: 4096), so a frankenMoE built from one differs beyond it: said in the plan."""
    base = tiny_mistral if family == "mistral" else tiny_llama
    plan = upcycle({"base_model": str(base), "num_experts": 2, "gate_mode": "random"}, dry_run=True).plan
    said = [n for n in plan.notes if "sliding window" in n and "mergekit" in n]
    if window is None:
        assert said == []
        return
    assert plan.base_config.get("sliding_window", window) == window
    assert said == [f"mistral base_model attends within a sliding window of {window} tokens, and so does this MoE "
                    f"(its config.json keeps the window); mergekit-moe 0.1.5 writes sliding_window: null, so its "
                    f"MoE attends over the whole context and differs from the dense model on texts longer than "
                    f"{window} tokens"]
