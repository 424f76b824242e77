"""Every shipped example in gate_configs/ passes `lint` and `plan` as a user would run them.

The hub models they name are given by their published config.json (tests/data/hub_configs) in a
Hugging Face cache layout, so `plan --from-config` runs offline; the ``./`` folders an example
asks the user to supply (their own fine-tunes of the base) are made with the base's config.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub import constants
from typer.testing import CliRunner

from moe_upcycle.cli import app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "gate_configs").glob("*.yaml"))
HUB_CONFIGS = Path(__file__).resolve().parent / "data" / "hub_configs"
runner = CliRunner()


@pytest.fixture
def user_dir(tmp_path, monkeypatch) -> Path:
    """A working directory like a clone's root: gate_configs/ and a cache holding the examples' hub models."""
    cache = tmp_path / "hf_cache"
    for folder in HUB_CONFIGS.iterdir():
        if not folder.is_dir():
            continue
        repo = cache / f"models--{folder.name}"
        shutil.copytree(folder, repo / "snapshots" / ("0" * 40))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    work = tmp_path / "work"
    work.mkdir()
    (work / "gate_configs").symlink_to(ROOT / "gate_configs")
    monkeypatch.chdir(work)
    return work


def supply_local_fine_tunes(example: Path, work: Path) -> list[str]:
    """Make each ./folder the example names, as a fine-tune of its base (same config.json)."""
    data = yaml.safe_load(example.read_text())
    base = HUB_CONFIGS / data["base_model"].replace("/", "--") / "config.json"
    made = []
    for expert in data.get("experts", []):
        ref = expert["source_model"]
        if ref.startswith("./"):
            (work / ref).mkdir(exist_ok=True)
            shutil.copy(base, work / ref / "config.json")
            made.append(ref)
    return made


def test_every_hub_model_of_the_examples_has_its_config():
    named = set()
    for example in EXAMPLES:
        data = yaml.safe_load(example.read_text())
        named |= {data["base_model"]} | {e["source_model"] for e in data.get("experts", [])}
    hub = {r for r in named if not r.startswith((".", "/"))}
    assert hub == {p.name.replace("--", "/") for p in HUB_CONFIGS.iterdir() if p.is_dir()}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_lint(example, user_dir):
    result = runner.invoke(app, ["lint", "--strict", f"gate_configs/{example.name}"])
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(example.read_text())
    if data.get("gate_mode") == "kmeans":
        assert result.stdout.startswith("Nothing to lint: gate_mode kmeans makes routers without prompts")
    else:
        assert "Prompt sets look separable" in result.stdout or "lint:" in result.stderr
        assert "expert prompt sets" in result.stdout


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_plan(example, user_dir):
    supply_local_fine_tunes(example, user_dir)
    result = runner.invoke(app, ["plan", "--from-config", f"gate_configs/{example.name}"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(example.read_text())
    n = data.get("num_experts") or len(data["experts"])
    assert f"{n} (" in result.stdout and f"top-{data['experts_per_token']}" in result.stdout
    assert data.get("architecture", "mixtral") in result.stdout
    if "moe_layers" in data:  # the sparse-upcycling example: every other layer of Llama-3.2-1B's 16
        assert "layers 1, 3, 5, 7, 9, 11, 13, 15 of 16 (dense MLP in 0, 2, 4, 6, 8, 10, 12, 14)" in result.stdout


def test_frankenmoe_example_rejects_an_expert_of_another_shape(user_dir):
    """What the example's comment warns about: a Llama-2-shaped expert (CodeLlama-7B) fails plan, named."""
    supply_local_fine_tunes(ROOT / "gate_configs" / "frankenmoe_4x_prompts.yaml", user_dir)
    config = json.loads((user_dir / "mistral-7b-code" / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"], intermediate_size=11008,
                  num_key_value_heads=32, vocab_size=32016)
    (user_dir / "mistral-7b-code" / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["plan", "--from-config", "gate_configs/frankenmoe_4x_prompts.yaml"])
    assert result.exit_code == 1
    assert "experts[1] (./mistral-7b-code)" in result.stderr
