"""The first hour with the tool: the simplest recipe builds, labelled prompt tables read as written, and `build` /
`demo` end with what to do next; a Ctrl-C under --force says the previous folder is untouched."""

from __future__ import annotations

import json
import subprocess

import pytest
from typer.testing import CliRunner

from failure_checks import leftovers, module_cmd, module_env
from moe_upcycle.check.route_eval import read_labeled
from moe_upcycle.cli import app
from moe_upcycle.errors import ConfigError
from moe_upcycle.recipe.schema import load_config

runner = CliRunner()


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ---- gate_mode's default follows the recipe

def test_the_simplest_recipe_builds_with_random_gates(stories, tmp_path):
    """`base_model` and `num_experts` alone: before, gate_mode defaulted to hidden, which needs prompts, and the
    build failed. Copies without prompts now get random routers; plan says it is the default."""
    config = tmp_path / "experts.yaml"
    config.write_text(f"base_model: {stories}\nnum_experts: 4\n")
    plan = runner.invoke(app, ["plan", str(config)], env={"COLUMNS": "120"})
    assert plan.exit_code == 0, plan.output
    assert "random (the default for copies without prompts)" in plan.stdout
    as_json = runner.invoke(app, ["plan", "--json", str(config)])
    data = json.loads(as_json.stdout)
    assert (data["gate_mode"], data["gate_mode_default"]) == ("random", "the default for copies without prompts")
    built = runner.invoke(app, ["build", str(config), str(tmp_path / "moe")])
    assert built.exit_code == 0, built.output
    recipe = json.loads((tmp_path / "moe" / "moe_upcycle.json").read_text())
    assert recipe["config"]["gate_mode"] == "random"  # recorded as resolved: a rebuild from it gives the same bytes


@pytest.mark.parametrize("experts, mode, why", [
    ([{"source_model": "a"}, {"source_model": "b"}], "random", "the default when no expert has prompts"),
    ([{"source_model": "a", "positive_prompts": ["def f():"]}, {"source_model": "b", "positive_prompts_from": "math"}],
     "hidden", "the default when experts have prompts"),
    ([{"source_model": "a", "positive_prompts": [""]}, {"source_model": "b", "positive_prompts": ["x"]}],
     "hidden", "the default when experts have prompts"),  # mergekit's empty "default expert" prompt is a prompt
])
def test_the_default_gate_mode_is_the_one_the_experts_can_use(experts, mode, why):
    config = load_config({"base_model": "base", "experts": experts})
    assert (config.gate_mode, config.gate_mode_default) == (mode, why)
    given = load_config({"base_model": "base", "experts": experts, "gate_mode": "cheap_embed"})
    assert (given.gate_mode, given.gate_mode_default) == ("cheap_embed", "")


def test_experts_partly_without_prompts_are_told_the_default_and_the_way_out(stories, write_yaml):
    config = write_yaml({"base_model": str(stories), "experts": [
        {"source_model": str(stories), "positive_prompts": ["Lily saw a cat."]}, {"source_model": str(stories)}]})
    result = runner.invoke(app, ["plan", str(config)])
    assert result.exit_code == 1
    assert (f"config error: {config}: experts[1].positive_prompts: gate_mode hidden (the default when experts have "
            f"prompts) needs at least one prompt (or positive_prompts_from: a prompt set); or set gate_mode: random to "
            f"build without prompts (routers to train)") in _one_line(result.stderr)


def test_hidden_gates_asked_for_on_copies_name_the_default(stories, write_yaml):
    config = write_yaml({"base_model": str(stories), "num_experts": 2, "gate_mode": "hidden"})
    result = runner.invoke(app, ["plan", str(config)])
    assert result.exit_code == 1
    assert ("gate_mode: hidden needs prompts, but num_experts gives copies without prompts; use gate_mode: random (or "
            "uniform, uniform_random; random is the default for copies: leave gate_mode out), or list experts with "
            "prompts") in _one_line(result.stderr)


# ---- route --labeled: a CSV/TSV with or without a header row

LINES = "code\tWrite a Python function\nstory\tOnce upon a time\n"


@pytest.mark.parametrize("name, text", [
    ("plain.txt", LINES), ("headerless.tsv", LINES),
    ("headerless.csv", 'code,"Write a Python function"\nstory,Once upon a time\n'),
    ("header.tsv", "expert\ttext\n" + LINES), ("header.csv", "Label,Prompt\ncode,Write a Python function\n"
                                                             "story,Once upon a time\n"),
    ("extra-columns.csv", "id,text,expert\n1,Write a Python function,code\n2,Once upon a time,story\n"),
])
def test_labelled_lines_read_the_same_with_or_without_a_header(name, text, tmp_path):
    """`expert<TAB>prompt` lines in a .tsv needed a header row, unlike the same lines in a .txt (before: "its header
    row names no "text" or "prompt" column")."""
    path = tmp_path / name
    path.write_text(text)
    assert read_labeled(path) == (["Write a Python function", "Once upon a time"], ["code", "story"])


@pytest.mark.parametrize("text, said", [
    ("code\tprompt\nstory\tOnce upon a time\n",
     "its first row ('code', 'prompt') is either a header or the prompt 'prompt' for expert 'code'; for a header, name "
     "the first column expert (or label); for labelled prompts, add the header row expert<TAB>text above it"),
    ("code\tWrite a Python function\tx\nstory\tOnce upon a time\n",
     ":1: 3 cell(s) where a TSV without a header row has two, expert<TAB>prompt (the prompt); or add a header row "
     "naming the text and expert columns"),
    ("code\t\n", ":1: 2 cell(s) where a TSV without a header row has two"),
    ("expert\tlabel\ncode\tWrite\n", "its header row names no \"text\" or \"prompt\" column (columns: 'expert', 'label')"),
])
def test_an_ambiguous_or_malformed_labelled_table_is_refused_with_what_to_write(text, said, tmp_path):
    path = tmp_path / "labels.tsv"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_labeled(path)
    assert said in " ".join(info.value.problems)


def test_route_reads_a_headerless_labelled_tsv(stories, write_yaml, tmp_path):
    config = write_yaml({"base_model": str(stories), "num_experts": 2})
    assert runner.invoke(app, ["build", str(config), str(tmp_path / "moe")]).exit_code == 0
    labels = tmp_path / "labels.tsv"
    labels.write_text("expert_0\tOnce upon a time\nexpert_1\tLily saw a cat.\n")
    result = runner.invoke(app, ["route", str(tmp_path / "moe"), "--labeled", str(labels), "--device", "cpu",
                                 "--json"])
    assert result.exit_code == 0, result.output
    accuracy = json.loads(result.stdout)["accuracy"]
    assert accuracy["experts"] == ["expert_0", "expert_1"] and sum(map(sum, accuracy["confusion"])) == 2


# ---- build and demo end with what to do next

def test_build_ends_with_the_next_steps(stories, write_yaml, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_yaml({"base_model": str(stories), "num_experts": 2})
    result = runner.invoke(app, ["build", str(config), "my-moe"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[-2:] == [
        "next: moe-upcycle verify my-moe · moe-upcycle route my-moe --prompts FILE",
        "before uploading, edit the model card: my-moe/README.md"]
    quiet = runner.invoke(app, ["-q", "build", str(config), "quiet-moe"])
    assert quiet.exit_code == 0 and quiet.stderr == "" and "next:" not in quiet.stdout
    verified = runner.invoke(app, ["build", "--verify", str(config), str(tmp_path / "checked moe")])
    assert verified.exit_code == 0, verified.output
    assert verified.stderr.splitlines()[-2:] == [  # verify ran: not suggested again; a path with a space, quoted
        "next: moe-upcycle route 'checked moe' --prompts FILE",
        "before uploading, edit the model card: 'checked moe/README.md'"]


def test_demo_ends_with_the_next_steps_within_80_columns(tmp_path):
    run = subprocess.run(module_cmd("demo", "demo_out"), cwd=tmp_path, env={**module_env(), "COLUMNS": "80"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stderr.splitlines() == ["next: moe-upcycle verify demo_out/moe   (the checks to run on a build of yours)",
                                       "your own model: moe-upcycle plan experts.yaml (a recipe: README, Quick start)"]
    assert run.stdout.splitlines()[2] == ("   24 expert slots share 6 source tensors in memory, saving 589.8 KB "
                                          "(-v: more)")
    assert all(len(line) <= 80 for line in run.stdout.splitlines() + run.stderr.splitlines()), run.stdout
    quiet = subprocess.run(module_cmd("-q", "demo", "demo_out"), cwd=tmp_path, env=module_env(), capture_output=True,
                           text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_build_at_80_columns_piped_says_the_sharing_in_one_line(stories, write_yaml, tmp_path):
    """The duplicate-tensor paragraph (paths wrapped mid-name, "safetensors has no aliasing") printed on every build;
    now one line without paths, the full report with -v (and in plan)."""
    config = write_yaml({"base_model": str(stories), "num_experts": 4})
    env = {**module_env(), "COLUMNS": "80"}
    run = subprocess.run(module_cmd("build", config, tmp_path / "moe"), env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert "no aliasing" not in run.stderr and "Duplicate tensors" not in run.stderr
    said = [line for line in run.stderr.splitlines() if "expert slots" in line]
    assert len(said) == 1 and said[0].endswith("(-v: more)") and len(said[0]) <= 80, said
    assert all(len(line) <= 80 for line in run.stdout.splitlines()), run.stdout
    verbose = subprocess.run(module_cmd("-v", "build", config, tmp_path / "moe-v"), env=env, capture_output=True,
                             text=True, timeout=300)
    assert verbose.returncode == 0 and "safetensors has no aliasing" in _one_line(verbose.stderr)


# ---- Ctrl-C with --force: the previous folder is untouched, and said to be

def test_an_interrupted_forced_build_says_the_previous_folder_is_untouched(stories, write_yaml, tmp_path,
                                                                            monkeypatch):
    from moe_upcycle.checkpoint import writer

    config = write_yaml({"base_model": str(stories), "num_experts": 2})
    target = tmp_path / "moe"
    assert runner.invoke(app, ["build", str(config), str(target)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    write = writer.ShardedWriter.write

    def interrupted(self, name, tensor):  # Ctrl-C in the middle of writing the new model
        if "layers.1." in name:
            raise KeyboardInterrupt
        return write(self, name, tensor)

    monkeypatch.setattr(writer.ShardedWriter, "write", interrupted)
    result = runner.invoke(app, ["build", "--force", str(config), str(target)])
    assert result.exit_code == 130
    assert (f"interrupted (SIGINT): nothing was written under the output name; the previous {target} is untouched"
            in _one_line(result.stderr))
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before and leftovers(target) == ["moe"]
    fresh = runner.invoke(app, ["build", str(config), str(tmp_path / "new")])  # no previous folder: not said
    assert fresh.exit_code == 130 and "previous" not in fresh.stderr
    assert _one_line(fresh.stderr).endswith("interrupted (SIGINT): nothing was written under the output name")
