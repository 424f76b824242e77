"""`prompts grow`: picks pool prompts that fit an expert, never writes over the input config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moe_upcycle.cli import app
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.prompts.embed import load_embedder
from moe_upcycle.errors import ConfigError, OutputError
from moe_upcycle.prompts.grow import grow_prompts, read_pool
from moe_upcycle.recipe.rewrite import write_grown_config
from moe_upcycle.recipe.resolve import expert_prompts

ROOT = Path(__file__).resolve().parents[1]
POOL = ROOT / "tests/data/pool.jsonl"
LABELS = {(r.get("text") or r.get("prompt")): r["label"] for r in map(json.loads, POOL.read_text().splitlines())}
runner = CliRunner()


def shipped(name: str) -> list[str]:
    return yaml.safe_load((ROOT / f"gate_configs/prompts/{name}.yaml").read_text())["prompts"]


@pytest.fixture
def config_path(tmp_path, tiny_llama) -> Path:
    """code, math, creative and chat experts with the shipped prompt sets; a comment-free YAML."""
    data = {"base_model": str(tiny_llama), "gate_mode": "cheap_embed", "experts": [
        {"source_model": str(tiny_llama), "name": name, "positive_prompts": shipped(name)}
        for name in ("code", "math", "creative", "chat")]}
    path = tmp_path / "experts.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def test_read_pool_jsonl_and_text(tmp_path):
    pool = read_pool(POOL)
    assert len(pool) == 16 and pool[0].startswith("Write a Python script") and pool[6].startswith("What is the sum")
    text = tmp_path / "pool.txt"
    text.write_text("first prompt\n\n  second prompt  \nfirst prompt\n")
    assert read_pool(text, "lines") == ["first prompt", "second prompt"]
    assert read_pool(text) == ["first prompt", "second prompt\nfirst prompt"]  # blank line: paragraphs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"label": "x"}\nnot json\n{"text": 1}\n{"prompt": null}\n')
    with pytest.raises(ConfigError) as err:
        read_pool(bad)
    assert err.value.problems == [f'{bad}:2: needs a "text" or "prompt" field (or instruction, question, query, '
                                  f'input; or a chat record\'s "messages" / "conversations", whose first user turn is '
                                  f"read); this record's fields: 'label'",
                                  f"{bad}:3: not valid JSON (Expecting value)",
                                  f"{bad}:4: its 'text' is a JSON int, not the text of a prompt",
                                  f"{bad}:5: its 'prompt' is null, not the text of a prompt"]


def test_grow_picks_code_prompts_for_code_expert(config_path):
    experts = expert_prompts(load_config(config_path).expert_list())
    picks = grow_prompts(experts, read_pool(POOL), load_embedder(), per_expert=3)
    code = [p.text for p in picks["code"]]
    math = [p.text for p in picks["math"]]
    assert len(code) == 3 and all(LABELS[t] == "code" for t in code)
    assert len(math) == 3 and all(LABELS[t] == "math" for t in math)
    assert code[0] == "Write a unit test in Go for a function that parses a URL query string."  # measured best, 0.39
    assert all(p.similarity >= 0.2 and p.margin >= 0.05 for ps in picks.values() for p in ps)
    assert [p.similarity for p in picks["code"]] == sorted((p.similarity for p in picks["code"]), reverse=True)
    # with room for more, code still takes only code prompts, and no candidate goes to two experts
    wide = grow_prompts(experts, read_pool(POOL), load_embedder(), per_expert=10)
    assert [LABELS[p.text] for p in wide["code"]] == ["code"] * 4  # the two left out have margin < 0.05
    # math gets its three pool prompts not already near-duplicated in math.yaml, plus one borderline
    # factual question (measured similarity 0.21, margin 0.056: just over the defaults)
    assert [LABELS[p.text] for p in wide["math"]] == ["math", "math", "math", "other"]
    assert wide["math"][-1].text == "What is the capital of Australia?" and wide["math"][-1].margin < 0.07
    assert "Solve the system of equations 2x + y = 7 and x - y = 2." not in [p.text for p in wide["math"]]
    chosen = [p.text for ps in wide.values() for p in ps]
    assert len(chosen) == len(set(chosen))


def test_grow_skips_known_and_duplicate_candidates(config_path):
    known = shipped("code")[0]
    pool = [known, "Write a unit test in Go for a function that parses a URL query string.",
            "Write a unit test in Go for a function which parses a URL query string."]
    picks = grow_prompts(expert_prompts(load_config(config_path).expert_list()), pool, load_embedder(), per_expert=5)
    assert [p.text for p in picks["code"]] == [pool[1]] or [p.text for p in picks["code"]] == [pool[2]]
    assert picks["math"] == [] and picks["chat"] == []


def test_cli_grow_writes_new_file_and_never_the_input(config_path, tmp_path):
    before = config_path.read_bytes()
    result = runner.invoke(app, ["prompts", "grow", str(config_path), "--pool", str(POOL), "--per-expert", "2"])
    assert result.exit_code == 0, result.output
    grown = tmp_path / "experts.grown.yaml"
    assert f"Wrote {grown}" in result.output.replace("\n", "")
    assert config_path.read_bytes() == before
    new, old = yaml.safe_load(grown.read_text()), yaml.safe_load(before)
    for n, (a, b) in enumerate(zip(new["experts"], old["experts"])):
        assert a["positive_prompts"][:len(b["positive_prompts"])] == b["positive_prompts"]
        added = a["positive_prompts"][len(b["positive_prompts"]):]
        assert len(added) <= 2
        if a["name"] in ("code", "math"):
            assert len(added) == 2 and {LABELS[t] for t in added} == {a["name"]}
    load_config(grown)  # still a valid config
    # -o pointing at the input is refused, and the input is untouched
    same = runner.invoke(app, ["prompts", "grow", str(config_path), "--pool", str(POOL), "-o", str(config_path)])
    assert same.exit_code == 1 and "that is the input config; it is never overwritten unless you pass --in-place" in same.output
    assert config_path.read_bytes() == before
    again = runner.invoke(app, ["prompts", "grow", str(config_path), "--pool", str(POOL)])
    assert again.exit_code == 1 and "file exists; pass --force" in again.output
    assert runner.invoke(app, ["prompts", "grow", str(config_path), "--pool", str(POOL), "--force"]).exit_code == 0


def test_cli_grow_in_place(config_path):
    before = yaml.safe_load(config_path.read_text())
    result = runner.invoke(app, ["prompts", "grow", str(config_path), "--pool", str(POOL), "--per-expert", "1",
                                 "--in-place"])
    assert result.exit_code == 0, result.output
    after = yaml.safe_load(config_path.read_text())
    code_added = after["experts"][0]["positive_prompts"][len(before["experts"][0]["positive_prompts"]):]
    assert code_added == ["Write a unit test in Go for a function that parses a URL query string."]
    assert not list(config_path.parent.glob(".*.tmp"))


def test_write_grown_config_refuses_in_place_with_other_output(config_path, tmp_path):
    with pytest.raises(OutputError, match="give one of -o and --in-place"):
        write_grown_config(config_path, {}, output=tmp_path / "other.yaml", in_place=True)


def test_a_recipe_changed_while_the_prompts_were_chosen_is_not_written(config_path):
    """Two `prompts grow --in-place` on one recipe: the second appended its picks to the first's result, so every
    prompt was there twice. The picks belong to the bytes they were chosen for; other bytes now: nothing written."""
    chosen_for = config_path.read_bytes()
    grown_meanwhile = chosen_for.replace(b"positive_prompts:", b"positive_prompts:", 1) + b"# saved by an editor\n"
    config_path.write_bytes(grown_meanwhile)
    with pytest.raises(OutputError, match=r"experts.yaml: changed while the prompts were chosen \(another prompts "
                                          r"grow, or an editor saved it\); nothing was written"):
        write_grown_config(config_path, {"code": ["new prompt"]}, in_place=True, expected=chosen_for)
    assert config_path.read_bytes() == grown_meanwhile
    write_grown_config(config_path, {"code": ["new prompt"]}, in_place=True, expected=grown_meanwhile)
    assert yaml.safe_load(config_path.read_text())["experts"][0]["positive_prompts"][-1] == "new prompt"


def test_grow_needs_prompts(tiny_llama):
    with pytest.raises(ConfigError, match="no expert has positive_prompts"):
        grow_prompts(expert_prompts(load_config({"base_model": str(tiny_llama), "num_experts": 2}).expert_list()), ["x"],
                     None)


def test_write_grown_config_refuses_missing_folder(config_path, tmp_path):
    with pytest.raises(OutputError, match="does not exist; create it or choose another -o"):
        write_grown_config(config_path, {}, output=tmp_path / "no" / "such.yaml")


def test_an_expert_that_gets_no_new_prompts_is_told_why(config_path):
    """Before, `prompts grow` said `creative +0` and nothing more."""
    from moe_upcycle.prompts.grow import grow

    experts = expert_prompts(load_config(config_path).expert_list())
    embedder = load_embedder()
    code_only = ["Write a unit test in Go for a function that parses a URL query string.",
                 "Refactor this JavaScript callback into async/await."]
    growth = grow(experts, code_only, embedder)
    assert [p.text for p in growth.picks["code"]] and "code" not in growth.why_none
    assert growth.why_none["math"].startswith("no pool prompt is closer to it than to another expert (the closest, at ")
    assert growth.why_none["math"].endswith(", is closer to code)")
    strict = grow(experts, code_only, embedder, min_similarity=0.9)
    assert strict.why_none["code"].startswith("2 pool prompt(s) are closest to it, but 2 score under "
                                              "--min-similarity 0.90 (best 0.")
    wide = grow(experts, code_only, embedder, margin=1.5)
    assert wide.why_none["code"].startswith("2 pool prompt(s) are closest to it, but 2 lead the next expert by under "
                                            "--margin 1.50 (most 0.")
    repeat = shipped("code")[0] + " "  # not the same text, the same prompt
    assert grow(experts, [repeat], embedder).why_none["code"] == (
        "1 pool prompt(s) are closest to it, but 1 repeat one of its prompts (cosine 0.90 or more)")
    assert set(grow(experts, [shipped("math")[0]], embedder).why_none.values()) == {
        "the pool holds no prompt that the recipe does not have already"}


def test_cli_grow_says_why_an_expert_got_nothing(config_path, tmp_path):
    pool = tmp_path / "pool.txt"
    pool.write_text("Write a unit test in Go for a function that parses a URL query string.\n"
                    "Refactor this JavaScript callback into async/await.\n")
    result = runner.invoke(app, ["prompts", "grow", str(config_path), "--pool", str(pool)])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stdout.splitlines() if ": no new prompts: " in line]
    assert [line.split(":")[0] for line in said] == ["math", "creative", "chat"]
    assert all("no pool prompt is closer to it than to another expert" in line for line in said), said
