"""Classes of trouble found in real published mergekit-moe configs (round 2 of
tests/data/mergekit_configs/published): each refused with the field or line and the fix, or built quietly.

- Windows paths (``F:/7B/model``, ``D:\\models\\model``, ``models\\model``) from configs written on Windows:
  not found here, and the message says it is a Windows path and which POSIX path to write, showing the
  path as the user wrote it (backslashes not doubled).
- A line of plain text above the config (an editor's title bar such as ``GNU nano 6.2 file.yml``, a code
  block's ``yaml`` label, a model card heading copied from the rendered page), or a value with a second
  ``: ``: YAML stops at the next line's colon; the message names the stray line and says to delete it.
- The prompt lint (seconds of sentence-embedder work) runs only where the routers read the prompts, and
  not for a config the build is about to refuse for want of prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moe_upcycle.checkpoint.model_refs import resolve_model
from moe_upcycle.cli import app
from moe_upcycle.errors import SourceError, UpcycleError
from moe_upcycle.recipe.schema import load_config


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("ref, words", [
    ("F:/7B/Multi-Verse-RP", ["model 'F:/7B/Multi-Verse-RP' not found", "it is a Windows path (drive F:)",
                              "(under WSL drive F: is /mnt/f: /mnt/f/7B/Multi-Verse-RP)"]),
    ("D:\\models\\llama-3-cat-8B-instruct", ["model 'D:\\models\\llama-3-cat-8B-instruct' not found",
                                             "drive D:", "/mnt/d/models/llama-3-cat-8B-instruct)"]),
    ("c:\\Users\\me\\text-generation-webui\\models\\Mistral-7B\\",
     ["drive C:", "/mnt/c/Users/me/text-generation-webui/models/Mistral-7B)"]),
    ("E:/", ["drive E:", "/mnt/e/)"]),
    ("models\\WizardLM-2-7B", ["model 'models\\WizardLM-2-7B' not found",
                               "it separates folders with Windows backslashes, which are ordinary characters in a "
                               "name here: write forward slashes (models/WizardLM-2-7B)"]),
])
def test_windows_paths_say_what_to_write_here(ref, words, empty_cache):
    with pytest.raises(SourceError) as info:
        resolve_model(ref, "experts[0].source_model")
    text = str(info.value)
    assert text.startswith("experts[0].source_model: model '")
    assert "\\\\" not in text  # the path as written, not its Python repr
    for w in words:
        assert w in text, text


@pytest.mark.parametrize("ref, words", [
    ("./my-models/ft0", ["check the path: there is no folder my-models/ft0"]),  # not a Windows path: as before
    ("a'b", ["model \"a'b\" not found"]),
    ("bad\nname", ["model 'bad\\nname' not found"]),  # characters that do not print stay escaped
])
def test_other_missing_paths_keep_their_message(ref, words, empty_cache):
    with pytest.raises(SourceError) as info:
        resolve_model(ref, "base_model")
    assert "Windows" not in str(info.value)
    for w in words:
        assert w in str(info.value), str(info.value)


@pytest.mark.parametrize("ref, words", [
    ("mlabonne/AlphaMonarch-7B\u200b", ["it contains a hidden character (U+200B zero-width space), often copied from a web "
                                         "page; delete it: mlabonne/AlphaMonarch-7B"]),
    ("./my\u00a0model", ["(U+00A0 non-breaking space)", "replace it with a normal space: ./my model"]),
    ("\u201c./ft0\u201d", ["it is wrapped in curly quotes (\u201c \u201d), which YAML keeps as part of the name; "
                           "write straight quotes or none: './ft0'"]),
    ("\u2018org/model\u2019", ["curly quotes (\u2018 \u2019)", "'org/model'"]),
    ("$HOME/models/mistral", ["it names an environment variable, which a recipe does not expand",
                              "write the path itself: /home/tester/models/mistral"]),
    ("${UNSET_MODELS_DIR}/mistral", ["it names an environment variable", "write the path itself"]),
])
def test_characters_pasted_from_a_web_page_are_named(ref, words, empty_cache, monkeypatch):
    """A model reference copied from a rendered model card (or a shell script): before, "not found" with the
    path looking right."""
    monkeypatch.setenv("HOME", "/home/tester")
    monkeypatch.delenv("UNSET_MODELS_DIR", raising=False)
    with pytest.raises(SourceError) as info:
        resolve_model(ref, "base_model")
    for w in words:
        assert w in str(info.value), str(info.value)


@pytest.mark.parametrize("ref, meant", [
    ("./Models/Mistral-7B", "./models/mistral-7b"),  # written on macOS or Windows, whose file systems ignore case
    ("./models/MISTRAL-7B/", "./models/mistral-7b"),
    ("./modles/mistral-7b", "./models/mistral-7b"),  # a slip in a folder higher up
    ("./models/mitsral-7b", "./models/mistral-7b"),  # two letters swapped
    ("./models/cafe\u0301", "./models/caf\u00e9"),  # a name typed on macOS (NFD) for one saved elsewhere (NFC)
    ("Models/Mistral-7B", "the folder models/mistral-7b"),  # reads like a hub id
])
def test_a_path_that_differs_only_slightly_names_the_model_folder(ref, meant, empty_cache, tiny_llama):
    import shutil

    for folder in ("models/mistral-7b", "models/caf\u00e9"):
        shutil.copytree(tiny_llama, folder)
    (Path("models") / "notes").mkdir()  # a folder without config.json is never suggested
    with pytest.raises(SourceError) as info:
        resolve_model(ref, "base_model")
    assert f"did you mean {meant}?" in str(info.value), str(info.value)


def test_no_suggestion_without_a_near_model_folder(empty_cache, tiny_llama):
    import shutil

    shutil.copytree(tiny_llama, "models/mistral-7b")
    (Path("models") / "Notes").mkdir()
    for ref in ("./models/notes", "./models/llama-3-8b", "./elsewhere/mistral-7b"):
        with pytest.raises(SourceError) as info:
            resolve_model(ref, "base_model")
        assert "did you mean" not in str(info.value) and "check the path" in str(info.value), str(info.value)


CONFIG = "base_model: org/base\ngate_mode: random\nexperts:\n  - source_model: org/a\n  - source_model: org/b\n"


@pytest.mark.parametrize("text, words", [
    ("GNU nano 6.2 mergekit_moe_configfs.yml\n" + CONFIG,
     [":2:11: YAML syntax error: mapping values are not allowed here",
      "line 1 ('GNU nano 6.2 mergekit_moe_configfs.yml') is not a 'key: value' line, so YAML cannot read the "
      "config below it", "an editor's title bar", "delete line 1, or make it a comment with #"]),
    ("yaml\n" + CONFIG, ["line 1 ('yaml') is not a 'key: value' line", "a code block's language label"]),
    ("\U0001f9e9 Configuration\n\n" + CONFIG, [":3:11: YAML syntax error",
                                             "line 1 ('\U0001f9e9 Configuration') is not a 'key: value' line"]),
    ("Mergekit config\n# copied from the card\n" + CONFIG,
     [":3:1: YAML syntax error: expected '<document start>'", "line 1 ('Mergekit config') is not a 'key: value' line"]),
    (CONFIG.replace("org/base", "org/base: the chat one"),
     [":1:21: YAML syntax error", "line 1 has a second ': ' inside the value of base_model; put the value in quotes"]),
])
def test_text_above_the_config_is_named_with_the_fix(text, words, tmp_path):
    _refused_with(text, words, tmp_path)


def _refused_with(text: str, words: list[str], tmp_path) -> None:
    """The config `text` is refused with every one of `words`, in our wording (not pydantic's)."""
    path = tmp_path / "pasted.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UpcycleError) as info:
        load_config(path)
    said = str(info.value)
    assert "Input should be" not in said, said
    for w in words:
        assert w in said, said


@pytest.mark.parametrize("mode, prompts, refused", [
    ("random", [[""], [""]], False),  # random rows: the prompts are never read
    ("uniform_random", [["code"], ["code"]], False),
    ("hidden", [["chat"], None], True),  # refused for want of prompts: no lint before the refusal
    ("cheap_embed", [["chat"], ["chat"]], True),  # every expert the same prompts: refused
])
def test_prompt_lint_runs_only_where_the_routers_read_the_prompts(mode, prompts, refused, tiny_llama, tmp_path):
    import yaml

    experts = [{"source_model": str(tiny_llama), **({"positive_prompts": p} if p is not None else {})}
               for p in prompts]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"base_model": str(tiny_llama), "gate_mode": mode, "experts": experts}))
    result = CliRunner().invoke(app, ["build", str(path), str(tmp_path / "out"), "--no-checksums"])
    assert "prompt lint" not in result.output and "lint:" not in result.output, result.output
    assert result.exit_code == (1 if refused else 0), result.output
    assert (tmp_path / "out").exists() is not refused


@pytest.mark.parametrize("line, words", [
    ("experts_per_token: 2.5", "experts_per_token: 2.5 is not a whole number; write an integer such as 2"),
    ("num_experts: 1e3", "num_experts: '1e3' is text to YAML, which reads an exponent only with a dot (1.0e3); "
                         "write 1000"),
    ("num_experts: four", "num_experts: 'four' is not a number; write an integer such as 2"),
    ("gate_scale: high", "gate_scale: 'high' is not a number; write a number such as 0.5"),
    ("experts_per_token: 0", "experts_per_token: 0 is too small; write at least 1"),
    ("gate_scale: 1000", "gate_scale: 1000 is too large; write at most 100"),
])
def test_number_values_say_what_to_write(line, words, tmp_path):
    """A value where a number goes is named with the number to write, in our words (not pydantic's)."""
    key = line.split(":")[0]
    lines = ["base_model: org/x", "gate_mode: random", "num_experts: 4", line]
    _refused_with("\n".join(x for x in lines if x.split(":")[0] != key or x == line) + "\n", [words], tmp_path)


@pytest.mark.parametrize("written, size", [("1e9", 10**9), ("1E9", 10**9), ("2.5e9", 25 * 10**8), ("1.0e9", 10**9),
                                           ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30)])
def test_shard_size_with_an_exponent_is_read_as_written(written, size, tmp_path):
    """YAML 1.1 (and a shell) hands `1e9` over as text; it is the number of bytes it says."""
    path = tmp_path / "c.yaml"
    path.write_text(f"base_model: org/x\ngate_mode: random\nnum_experts: 4\nmax_shard_size: {written}\n")
    assert load_config(path).max_shard_size == size


def test_what_is_not_a_recipe_says_what_to_give(tiny_llama, tmp_path):
    """A model folder, its config.json, or '-' where the recipe goes: each says what to write instead."""
    for given, words in [
        (tiny_llama, [f"{tiny_llama}: is a folder, not a config file (a model folder: write a recipe that names it, "
                      f"e.g. base_model: {tiny_llama}"]),
        (tiny_llama / "config.json", [f"{tiny_llama / 'config.json'}: this is a model's config.json (model_type "
                                      f"'llama'), not a recipe", f"e.g. base_model: {tiny_llama}, num_experts: 4"]),
        ("-", ["-: the recipe is read from a file, not from standard input"]),
    ]:
        result = CliRunner().invoke(app, ["build", str(given), str(tmp_path / "out")])
        text = " ".join(result.output.split())
        assert result.exit_code == 1 and "Traceback" not in text, text
        for word in words:
            assert word in text, (word, text)
        assert not (tmp_path / "out").exists()


MERGE_CONFIGS = {  # mergekit-yaml (dense merge) configs, as model cards print them
    "slerp": ("slices:\n  - sources:\n      - model: org/a\n        layer_range: [0, 32]\n      - model: org/b\n"
              "        layer_range: [0, 32]\nmerge_method: slerp\nbase_model: org/a\nparameters:\n  t:\n"
              "    - value: 0.5\ndtype: bfloat16\n", ["(merge_method: 'slerp'), with merge_method and slices but no experts:"]),
    "dare_ties": ("models:\n  - model: org/a\n  - model: org/b\n    parameters:\n      density: 0.53\n"
                  "merge_method: dare_ties\nbase_model: org/a\ndtype: bfloat16\n",
                  ["(merge_method: 'dare_ties'), with merge_method and models but no experts:"]),
    "passthrough_slices_only": ("slices:\n  - sources:\n    - model: org/a\n      layer_range: [0, 24]\n",
                                ["this is a mergekit-yaml merge config, with slices but no experts:"]),
}


@pytest.mark.parametrize("name", sorted(MERGE_CONFIGS))
@pytest.mark.parametrize("allow", [False, True])
def test_a_mergekit_yaml_merge_config_gets_one_headline(name, allow, tmp_path):
    """A dense-merge config (slerp, dare_ties, passthrough) given to build: one message that says what it is
    and what to write instead — not a line per key with advice to ignore them (--allow-unknown-keys or not)."""
    text, words = MERGE_CONFIGS[name]
    path = tmp_path / "merge.yaml"
    path.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(app, ["build", str(path), str(tmp_path / "out"),
                                      *(["--allow-unknown-keys"] if allow else [])])
    out = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in out, out
    for word in [f"{path}: this is a mergekit-yaml merge config", *words, "mergekit-yaml's job",
                 "base_model: plus experts:", "gate_configs/mergekit_style.yaml"]:
        assert word in out, (word, out)
    assert "unknown key" not in out and out.count("config error") == 1, out
    assert not (tmp_path / "out").exists()


def test_a_missing_model_is_reported_before_any_lint(tiny_llama, tmp_path, monkeypatch):
    """Good prompts, but an expert's folder is missing: the build says so at once (no lint advice first)."""
    import yaml

    import moe_upcycle.prompts.lint as lint

    monkeypatch.setattr(lint, "quick_lint", lambda *a, **k: pytest.fail("lint ran before the refusal"))
    missing = tmp_path / "no-such-model"
    experts = [{"source_model": str(tiny_llama), "positive_prompts": ["write python code"]},
               {"source_model": str(missing), "positive_prompts": ["tell a bedtime story"]}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"base_model": str(tiny_llama), "gate_mode": "hidden", "experts": experts}))
    result = CliRunner().invoke(app, ["build", str(path), str(tmp_path / "out"), "--no-checksums"])
    assert result.exit_code == 1, result.output
    assert str(missing) in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where, force, words", [
    ("file", False, ["exists and is a file; choose another output path"]),
    ("recipe", True, ["exists and is a file"]),
    ("nonempty", False, ["already exists and is not empty; choose another folder or pass --force"]),
    ("project", True, ["was not written by moe-upcycle", "--force only replaces a previous moe-upcycle output"]),
])
def test_a_refused_output_is_reported_before_any_lint(where, force, words, tiny_llama, tmp_path, monkeypatch):
    """Good prompts, but the build will refuse OUT: it says so at once, not after seconds of lint advice, and
    the output (a file, the recipe itself, a user's folder) is left byte for byte."""
    import yaml

    import moe_upcycle.prompts.lint as lint

    monkeypatch.setattr(lint, "quick_lint", lambda *a, **k: pytest.fail("lint ran before the refusal"))
    experts = [{"source_model": str(tiny_llama), "positive_prompts": ["write python code"]},
               {"source_model": str(tiny_llama), "positive_prompts": ["tell a bedtime story"]}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"base_model": str(tiny_llama), "gate_mode": "hidden", "experts": experts}))
    out = {"file": tmp_path / "notes.txt", "recipe": path}.get(where, tmp_path / "out")
    if where == "file":
        out.write_text("mine")
    elif where in ("nonempty", "project"):
        out.mkdir()
        (out / "train.py").write_text("print('mine')")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["build", str(path), str(out), "--no-checksums", *(["--force"] if force else [])])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in text, text
    for word in words:
        assert word in text, (word, text)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_the_lint_still_runs_when_force_replaces_a_previous_output(tiny_llama, tmp_path, monkeypatch):
    """--force over our own previous output is no refusal: the lint runs, and the build replaces the folder."""
    import yaml

    import moe_upcycle.prompts.lint as lint

    calls = []
    monkeypatch.setattr(lint, "quick_lint", lambda prompts: calls.append(prompts) or ["stand-in advice"])
    experts = [{"source_model": str(tiny_llama), "positive_prompts": ["write python code"]},
               {"source_model": str(tiny_llama), "positive_prompts": ["tell a bedtime story"]}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"base_model": str(tiny_llama), "gate_mode": "hidden", "experts": experts}))
    args = ["build", str(path), str(tmp_path / "out"), "--no-checksums"]
    assert CliRunner().invoke(app, args).exit_code == 0
    result = CliRunner().invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert len(calls) == 2 and "lint: stand-in advice" in result.output, result.output


@pytest.mark.parametrize("text, words", [
    # a key glued to its value: YAML reads 'key:value' as text (mergekit-moe fails on it too)
    ("base_model:org/x\ngate_mode: random\n", [":2:10: YAML syntax error",
                                             "line 1 has no space after 'base_model:', so YAML reads "
                                             "'base_model:org/x' as text, not a key; write base_model: org/x"]),
    ("base_model: org/x\ngate_mode:random\nexperts: []\n",
     [":3:1: YAML syntax error: could not find expected ':'", "write gate_mode: random"]),
    ("base_model: org/x\nexperts:\n  - source_model: a/b\n    positive_prompts:[\"a\"]\n  - source_model: c/d\n",
     ["line 4 has no space after 'positive_prompts:'", "write positive_prompts: [\"a\"]"]),
    ("base_model: org/x\ngate_mode: random\nexperts:\n  - source_model:a/b\n  - source_model: c/d\n",
     ["experts[0]: 'source_model:a/b' has no space after the colon, so YAML reads it as one string, not a key; "
      "write - source_model: a/b"]),
    # `key:` with nothing after it (GK-MoE-0.1's first card had `base_model:` empty)
    ("base_model:\nexperts:\n  - source_model: a/b\n  - source_model: c/d\n",
     ["base_model: empty (nothing after 'base_model:'); write the model: org/name (a hub id) or a folder"]),
    ("base_model: org/x\nexperts:\n  - source_model:\n  - source_model: c/d\n",
     ["experts[0].source_model: empty (nothing after 'source_model:'); write the model"]),
    ("base_model: org/x\ngate_mode:\nexperts:\n  - source_model: a/b\n  - source_model: c/d\n",
     ["gate_mode: empty (nothing after 'gate_mode:'); write one of 'hidden'", "or delete the line"]),
    ("base_model: org/x\nexperts_per_token:\ngate_mode: random\nexperts:\n  - source_model: a/b\n  - source_model: c/d\n",
     ["experts_per_token: empty (nothing after 'experts_per_token:'); write a value, or delete the line"]),
])
def test_glued_and_empty_values_are_named_with_the_fix(text, words, tmp_path):
    _refused_with(text, words, tmp_path)


def test_hub_id_without_a_model_name(empty_cache):
    """An early aegolius-acadicus-24b config named `ibivibiv/` (the model name not yet typed)."""
    with pytest.raises(SourceError) as info:
        resolve_model("ibivibiv/", "experts[0].source_model")
    assert "there is no model name after 'ibivibiv/': write ibivibiv/name (the hub id), or give a folder" in str(
        info.value)


EXPERTS = ("base_model: org/x\ngate_mode: cheap_embed\nexperts:\n  - source_model: a/b\n    positive_prompts:\n"
           "    - chat\n  - source_model: c/d\n{indent}positive_prompts:\n    - code\n")


@pytest.mark.parametrize("text, words", [
    # an expert's key indented out of line with source_model: (less, or more: read as part of its value)
    (EXPERTS.format(indent="  "), [":8:3: YAML syntax error", "line 8 is indented 2 spaces, but the key above it "
                                   "('source_model', line 7) is indented 4 spaces", "indent it by 4 spaces"]),
    (EXPERTS.format(indent="   "), [":8:4: YAML syntax error", "line 8 is indented 3 spaces", "indent it by 4 spaces"]),
    (EXPERTS.format(indent="      "), [":8:23: YAML syntax error: mapping values are not allowed here",
                                      "line 8 is indented 6 spaces", "indent it by 4 spaces"]),
    ("base_model: org/x\n gate_mode: random\n", ["line 2 is indented 1 space, but the key above it ('base_model', "
                                                 "line 1) is indented 0 spaces", "remove its indentation"]),
    # Lumosia's card as rendered: the code block's `yaml` label glued to the first key
    ("yamlbase_model: org/x\ngate_mode: random\nexperts:\n  - source_model: a/b\n  - source_model: c/d\n",
     ["yamlbase_model: unknown key — the code block's 'yaml' label is glued to base_model; write base_model:"]),
])
def test_layout_slips_are_named_with_the_fix(text, words, tmp_path):
    _refused_with(text, words, tmp_path)


def test_prompt_that_starts_with_a_hash_is_a_comment(tmp_path):
    """`- #hashtags` (or a Markdown heading as a prompt) is a '-' line and a comment to YAML: a null prompt."""
    path = tmp_path / "c.yaml"
    path.write_text("base_model: org/x\ngate_mode: hidden\nexperts:\n  - source_model: a/b\n    positive_prompts:\n"
                    "      - #hashtags\n      - chat\n  - source_model: c/d\n    positive_prompts: [code]\n")
    with pytest.raises(UpcycleError) as info:
        load_config(path)
    assert ("experts[0].positive_prompts: prompt 0 is empty (a bare '-' line, which YAML reads as null)"
            in str(info.value))
    assert "a prompt that starts with # goes in quotes (YAML reads '- #...' as a '-' line and a comment)" in str(
        info.value)


@pytest.mark.parametrize("value, guess", [
    ("Random", "random"), ("HIDDEN", "hidden"), ("cheap-embed", "cheap_embed"), ("cheap embed", "cheap_embed"),
    ("Cheap_Embed", "cheap_embed"), ("hidden_state", "hidden"), ("hidden_states", "hidden"),
    ("random_uniform", "uniform_random"), ("hiden", "hidden"), ("banana", None),
])
def test_gate_mode_spellings_get_the_value_meant(value, guess, tmp_path):
    """mergekit-moe fails late on these (a TypeError in its router, after loading); we name the value meant."""
    with pytest.raises(UpcycleError) as info:
        load_config({"base_model": "org/x", "gate_mode": value,
                     "experts": [{"source_model": "a/b", "positive_prompts": ["a"]},
                                 {"source_model": "c/d", "positive_prompts": ["b"]}]})
    text = str(info.value)
    assert f"gate_mode: {value!r} is not allowed; " in text and "expected 'hidden'" in text
    assert (f"did you mean {guess}? " in text) if guess else ("did you mean" not in text), text


@pytest.mark.parametrize("ref, words", [
    ("hf.co/mistralai/Mistral-7B-v0.1", ["write the hub id, not its web address: mistralai/Mistral-7B-v0.1"]),
    ("huggingface.co/mistralai/Mistral-7B-v0.1", ["write the hub id, not its web address: mistralai/Mistral-7B-v0.1"]),
    ("mistralai/Mistral-7B-v0.1 ", ["it has spaces at its start or end (inside quotes); remove them: "
                                    "mistralai/Mistral-7B-v0.1"]),
])
def test_other_pasted_reference_forms(ref, words, empty_cache):
    with pytest.raises(SourceError) as info:
        resolve_model(ref, "base_model")
    for w in words:
        assert w in str(info.value), str(info.value)


def test_hub_id_with_a_trailing_slash_is_found_in_the_cache(tmp_path, monkeypatch, tiny_llama):
    """`org/name/` (a folder's spelling of a hub id) finds the cached `org/name`, at a revision too."""
    from huggingface_hub import constants

    from fake_hub import build_hub_cache

    cache = build_hub_cache(tmp_path / "cache", {"llama": [tiny_llama]}, {"Abhaykoul/SER"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    found = resolve_model("Abhaykoul/SER", "base_model")
    assert resolve_model("Abhaykoul/SER/", "base_model") == found
    assert resolve_model("Abhaykoul/SER/@main", "base_model") == found


@pytest.mark.parametrize("added", [1, 2, 1024])
def test_experts_with_added_tokens_build_on_the_base_vocabulary(added, tiny_llama, tmp_path):
    """Beyonder-4x7B-v3's experts (openchat-3.5-0106, CodeNinja: 32002 tokens) next to a 32000-token base:
    mergekit-moe builds it with the base's embeddings, and so do we, saying so; the output loads."""
    import json

    from conftest import model_logits
    from moe_upcycle.build import upcycle
    from moe_upcycle.checkpoint.tiny import make_dense_model

    base_vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    chatml = make_dense_model(tmp_path / "chatml", family="llama", seed=11, vocab_size=base_vocab + added)
    result = upcycle({"base_model": str(tiny_llama), "gate_mode": "cheap_embed", "dtype": "float32",
                      "experts": [{"source_model": str(tiny_llama), "positive_prompts": ["chat"]},
                                  {"source_model": str(chatml), "positive_prompts": ["code"]}]},
                     tmp_path / "out", checksums=False)
    said = [n for n in result.plan.notes if n.startswith("vocab_size differs")]
    assert said and f"experts[1] ({chatml}): {base_vocab + added}" in said[0] and "base_model's embeddings" in said[0]
    assert json.loads((result.output / "config.json").read_text())["vocab_size"] == base_vocab
    assert torch.isfinite(model_logits(result.output)).all()


def test_a_base_with_added_tokens_is_said_to_keep_them(tiny_llama, tmp_path):
    """The other way round: the base is the chat model with 2 added tokens, the experts have the original 300.
    The note says the MoE keeps all the base's tokens (before, it said the added tokens were not in its vocabulary,
    which was backwards)."""
    import json

    from moe_upcycle.build import upcycle
    from moe_upcycle.checkpoint.tiny import make_dense_model

    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    chatml = make_dense_model(tmp_path / "chatml", family="llama", seed=11, vocab_size=vocab + 2)
    result = upcycle({"base_model": str(chatml), "gate_mode": "random",
                      "experts": [{"source_model": str(tiny_llama)}, {"source_model": str(tiny_llama)}]},
                     tmp_path / "out", checksums=False)
    said = [n for n in result.plan.notes if n.startswith("vocab_size differs")]
    assert said == [f"vocab_size differs from base_model's {vocab + 2} (experts[0] ({tiny_llama}): {vocab}): "
                    f"base_model has tokens these experts were not trained with; the MoE keeps base_model's embeddings "
                    f"and tokenizer (as mergekit-moe does), all {vocab + 2} tokens"]
    assert json.loads((result.output / "config.json").read_text())["vocab_size"] == vocab + 2


def test_an_expert_from_another_pretraining_is_refused(tiny_llama, tmp_path):
    from moe_upcycle.build import upcycle
    from moe_upcycle.checkpoint.tiny import make_dense_model
    from moe_upcycle.errors import PlanError

    other = make_dense_model(tmp_path / "other", family="llama", seed=12, vocab_size=2000)
    with pytest.raises(PlanError) as info:
        upcycle({"base_model": str(tiny_llama), "gate_mode": "random",
                 "experts": [{"source_model": str(tiny_llama)}, {"source_model": str(other)}]}, tmp_path / "out")
    assert f"experts[1] ({other}): vocab_size is 2000 but base_model {tiny_llama} has 300" in str(info.value)
    assert "a model from another pretraining" in str(info.value) and not (tmp_path / "out").exists()


def test_mistral_v02_base_with_a_v01_expert_plans_from_the_published_configs(tmp_path, monkeypatch):
    """shuvom/my-mixtral-2x7B and jsfs11's 2x7B pair Mistral-7B-Instruct-v0.2 (rope_theta 1e6) with v0.1 fine-tunes
    (1e4), and mergekit-moe builds them; with the models' published config.json the plan goes through, saying
    that the MoE runs the base's attention."""
    import shutil
    from pathlib import Path

    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    for name in ("mistralai--Mistral-7B-Instruct-v0.2", "mistralai--Mistral-7B-v0.1"):
        repo = cache / f"models--{name}"
        shutil.copytree(Path(__file__).parent / "data" / "hub_configs" / name, repo / "snapshots" / ("0" * 40))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    path = tmp_path / "mix.yaml"
    path.write_text("base_model: mistralai/Mistral-7B-Instruct-v0.2\ngate_mode: cheap_embed\nexperts:\n"
                    "  - source_model: mistralai/Mistral-7B-Instruct-v0.2\n    positive_prompts: [chat]\n"
                    "  - source_model: mistralai/Mistral-7B-v0.1\n    positive_prompts: [code]\n")
    result = CliRunner().invoke(app, ["plan", "--from-config", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert ("experts[1] (mistralai/Mistral-7B-v0.1): rope settings is rope_theta=10000.0, scaling: none, base_model "
            "mistralai/Mistral-7B-Instruct-v0.2 has rope_theta=1000000.0") in text
    assert "runs base_model's attention and norms with the base's value" in text


def test_a_model_cached_only_at_a_commit_names_the_revisions(tmp_path, monkeypatch, tiny_llama):
    """`hf download org/name --revision <commit>` leaves no refs/main: transformers, and moe-upcycle, find no
    `org/name`; before, the message said to download what is already there."""
    import shutil

    from huggingface_hub import constants

    cache = tmp_path / "cache"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_llama, cache / "models--Org--Tiny" / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as info:
        resolve_model("org/tiny", "base_model")
    text = str(info.value)
    assert "model 'org/tiny' not found at its main revision" in text
    assert f"the cache holds it only at other revisions, downloaded by commit; name one, as transformers would need: " \
           f"org/tiny@{commit}" in text
    assert resolve_model(f"org/tiny@{commit}", "base_model").name == commit  # what the message says to write
