"""Every YAML in gate_configs/ is valid: configs against the schema, prompt sets against their own check."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moe_upcycle.recipe import prompt_sets
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import ConfigError

GATE_CONFIGS = Path(__file__).resolve().parents[1] / "gate_configs"
CONFIGS = sorted(p for p in GATE_CONFIGS.glob("*.yaml"))
SETS = sorted((GATE_CONFIGS / "prompts").glob("*.yaml"))


def test_there_are_example_configs_and_sets():
    assert {p.name for p in CONFIGS} >= {"upcycle_8x_kmeans.yaml", "frankenmoe_4x_prompts.yaml", "mergekit_style.yaml",
                                         "sparse_upcycle_every_other.yaml"}
    assert [p.stem for p in SETS] == ["chat", "code", "creative", "math", "multilingual", "reasoning", "science"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_is_valid(path, monkeypatch):
    monkeypatch.chdir(GATE_CONFIGS.parent)  # calibration_text paths are relative to the repository root
    config = load_config(path)
    experts = config.expert_list()  # resolves every *_prompts_from
    assert len(experts) == config.expert_count >= 2
    if config.gate_mode in ("hidden", "hidden_avg", "hidden_last", "cheap_embed"):
        assert all(e.positive_prompts for e in experts)
    if config.gate_mode == "kmeans":
        assert Path(config.calibration_text).is_file()


@pytest.mark.parametrize("path", SETS, ids=lambda p: p.name)
def test_prompt_set_is_valid(path):
    assert prompt_sets.check_set_file(path) == []


def test_set_names_resolve_through_package_data():
    # moe_upcycle/data/prompts is what an installed package ships; in a checkout it is the same folder
    folder = prompt_sets.set_dir()
    assert folder.resolve() == (GATE_CONFIGS / "prompts").resolve()
    assert prompt_sets.set_names() == [p.stem for p in SETS]


def test_frankenmoe_experts_get_their_sets():
    config = load_config(GATE_CONFIGS / "frankenmoe_4x_prompts.yaml")
    code = yaml.safe_load((GATE_CONFIGS / "prompts" / "code.yaml").read_text())["prompts"]
    experts = {e.name: e for e in config.expert_list()}
    assert experts["code"].positive_prompts == code
    assert experts["math"].negative_prompts == code and len(experts["math"].positive_prompts) >= 20


def test_prompts_from_file_and_listed_prompts_combine(tmp_path):
    extra = tmp_path / "mine.txt"
    extra.write_text("first prompt\n\nsecond prompt\n", encoding="utf-8")
    config = load_config({"base_model": "m", "gate_mode": "hidden", "experts": [
        {"source_model": "m", "positive_prompts": ["listed"], "positive_prompts_from": str(extra)},
        {"source_model": "m", "positive_prompts_from": "math"}]})
    assert config.expert_list()[0].positive_prompts == ["listed", "first prompt", "second prompt"]


def test_unknown_prompt_set_names_the_field():
    with pytest.raises(ConfigError) as info:
        load_config({"base_model": "m", "gate_mode": "hidden", "experts": [
            {"source_model": "m", "positive_prompts_from": "cod"}]})
    (problem,) = info.value.problems
    assert problem.startswith("config: experts[0].positive_prompts_from: 'cod' is neither a prompt set (chat, code,")
    assert "give the path of a YAML/JSON/text prompt file" in problem


def test_check_set_file_reports_problems(tmp_path):
    bad = tmp_path / "tiny.yaml"
    bad.write_text(yaml.safe_dump({"name": "other", "prompts": ["a", "a", "b"], "extra": 1}))
    problems = prompt_sets.check_set_file(bad)
    assert any("unknown key(s) ['extra']" in p for p in problems)
    assert any("must equal the file name 'tiny'" in p for p in problems)
    assert any("description:" in p for p in problems)
    assert any("has 2 distinct prompts; a set needs at least 20" in p for p in problems)
