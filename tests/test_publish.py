"""Hub-ready output: reproducible bytes, recorded recipe, model card, untouched tokenizer files."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from moe_upcycle import __version__, load_config, upcycle
from moe_upcycle.publish.card import choose_license, read_license
from moe_upcycle.cli import app
from moe_upcycle.check.verify import verify

runner = CliRunner()
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}assistant:"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4:card.index("\n---\n", 4)])


@pytest.fixture
def licensed_base(tiny_llama, tmp_path) -> Path:
    """tiny_llama with a model card stating a license, a chat template and extra tokenizer files."""
    base = tmp_path / "licensed_base"
    shutil.copytree(tiny_llama, base)
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# a dense model\n")
    (base / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (base / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"}, indent=1))
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())
    tok_cfg.update(padding_side="left", pad_token="</s>")
    (base / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=3))
    (base / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.9}, indent=2))
    return base


def test_same_config_and_seed_give_identical_files(tiny_llama, tmp_path):
    cfg = {"base_model": str(tiny_llama), "gate_mode": "random", "seed": 7, "max_shard_size": 60_000,
           "experts": [{"source_model": str(tiny_llama), "noise_scale": 0.01} for _ in range(3)]}
    first, second = upcycle(cfg, tmp_path / "a"), upcycle(cfg, tmp_path / "b")
    assert len(first.shards) > 2 and first.shards == second.shards
    files = sorted(p.name for p in first.output.iterdir())
    assert files == sorted(p.name for p in second.output.iterdir())
    for name in files:  # every shard and every other file, the recipe included
        assert _sha(first.output / name) == _sha(second.output / name), name
    recipe = json.loads((first.output / "moe_upcycle.json").read_text())
    assert recipe["tool"] == "moe-upcycle" and recipe["version"] == __version__ and recipe["seed"] == 7
    # the recipe as built, its paths relative to the output (uploaded with it): read back, the same recipe
    from moe_upcycle.planning.replan import recorded_config

    assert recipe["config"]["base_model"].startswith("../") and recipe["paths_relative_to"] == "."
    assert load_config(recorded_config(recipe, first.output)).model_dump() == load_config(cfg).model_dump()
    assert recipe["sha256"] == {n: _sha(first.output / n) for n in files if n != "moe_upcycle.json"}
    assert set(first.sha256) == set(first.shards) and all(recipe["sha256"][k] == v for k, v in first.sha256.items())
    # the seed matters: shards holding routers or noisy experts change, copied tensors do not
    other = upcycle({**cfg, "seed": 8}, tmp_path / "c")
    index = json.loads((first.output / "model.safetensors.index.json").read_text())["weight_map"]
    seeded = {index[k] for k in index if ".block_sparse_moe." in k}
    assert seeded and all(_sha(other.output / s) != _sha(first.output / s) for s in seeded)


def test_model_card_front_matter_and_body(licensed_base, tmp_path):
    result = upcycle({"base_model": str(licensed_base), "num_experts": 4, "gate_mode": "random"}, tmp_path / "moe")
    card = (result.output / "README.md").read_text()
    assert _front_matter(card) == {  # a local base has no hub id: no base_model (the hub rejects paths)
        "base_model_relation": "merge", "library_name": "transformers",
        "pipeline_tag": "text-generation", "license": "apache-2.0",
        "tags": ["moe", "mixtral", "upcycling", "moe-upcycle"],
    }
    assert "| total | 260,416 (0.26M) |" in card and "| active per token | 162,112 (0.16M) |" in card
    assert "4 experts,\n2 active per token, gate mode `random`, dtype `float32`" in card
    assert f"| 3 | expert_3 | local model `{licensed_base.name}` | 0 | none |" in card and str(licensed_base) not in card
    assert f"```yaml\nbase_model: {licensed_base.name}\nexperts: []  # default\nnum_experts: 4\n" \
           "architecture: mixtral  # default: the output family for this base\ngate_mode: random\n" in card
    assert "Not run. Run `moe-upcycle verify <this folder>`" in card
    assert 'AutoModelForCausalLM.from_pretrained("path/to/this/folder")' in card
    assert "License:" not in card


def test_license_sources(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for folder in (a, b, c):
        folder.mkdir()
    (a / "README.md").write_text("---\nlicense: other\nlicense_name: llama2\nlicense_link: LICENSE\n---\ntext")
    (b / "config.json").write_text(json.dumps({"model_type": "llama", "license": "mit"}))
    assert read_license(a) == {"license": "other", "license_name": "llama2", "license_link": "LICENSE"}
    assert read_license(b) == {"license": "mit"} and read_license(c) is None
    assert choose_license([("A", a), ("C", c)]) == (read_license(a), "")  # an expert without one does not block it
    keys, note = choose_license([("C", c)])
    assert keys is None and "No license was found in the base model's README.md or config.json" in note
    keys, note = choose_license([("local model a", a), ("Org/b", b)])
    assert keys is None and "(local model a: other, Org/b: mit)" in note and str(tmp_path) not in note


@pytest.mark.parametrize("stated,expected", [
    ("Apache 2.0", "apache-2.0"), ("Apache License, Version 2.0", "apache-2.0"), ("Apache License 2.0", "apache-2.0"),
    ("MIT", "mit"), ("MIT License", "mit"), ("CC-BY-NC-4.0", "cc-by-nc-4.0"), ("Llama 3.1", "llama3.1"),
    ("llama3.3", "llama3.3"), ("llama-2", "llama2"), ("apache", None), ("some-new-id", None), ("[mit]", "mit"),
    ("my own terms", None),
    ("[apache-2.0, mit]", None), ("{id: mit}", None),
])
def test_a_license_is_written_as_the_hub_id_it_names_or_left_to_the_user(stated, expected, tiny_llama, tmp_path):
    """The hub takes one license id: 'Apache 2.0' in a base's card becomes apache-2.0; a value that names none
    is not copied, and the card's note quotes it, naming the source without its path."""
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    (base / "README.md").write_text(f"---\nlicense: {stated}\n---\n# a dense model\n")
    result = upcycle({"base_model": str(base), "num_experts": 2, "gate_mode": "random"}, tmp_path / "moe")
    text = (result.output / "README.md").read_text()
    assert ModelCard(text).data.to_dict().get("license") == expected
    if expected is None:
        assert "A source model states a license that is not one Hugging Face Hub license id (local model base: " in text
        assert str(tmp_path) not in text
    else:
        assert "License:" not in text


def test_card_without_license_leaves_it_to_the_user(tiny_llama, tmp_path):
    result = upcycle({"base_model": str(tiny_llama), "num_experts": 2, "experts_per_token": 1,
                      "gate_mode": "uniform"}, tmp_path / "moe")
    card = (result.output / "README.md").read_text()
    assert "license" not in _front_matter(card)
    assert "# license: (set the base model's license here" in card
    assert "> **License:** No license was found" in card


def test_tokenizer_and_generation_files_are_copied_byte_for_byte(licensed_base, tmp_path):
    from transformers import AutoTokenizer

    result = upcycle({"base_model": str(licensed_base), "num_experts": 2, "gate_mode": "random"}, tmp_path / "moe")
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "generation_config.json")
    for name in names:
        assert (result.output / name).read_bytes() == (licensed_base / name).read_bytes(), name
    dense_tok, moe_tok = (AutoTokenizer.from_pretrained(str(p)) for p in (licensed_base, result.output))
    assert moe_tok.padding_side == "left" and moe_tok.pad_token == "</s>"  # nothing rewritten
    messages = [{"role": "user", "content": "What is 12 times 7?"}]
    rendered = moe_tok.apply_chat_template(messages, tokenize=False)
    assert rendered == dense_tok.apply_chat_template(messages, tokenize=False)
    assert rendered == "<s>user: What is 12 times 7?</s>\nassistant:"


@pytest.fixture
def named_templates(tiny_llama, tmp_path) -> Path:
    """A base whose tokenizer has named chat templates (transformers saves them in additional_chat_templates/)."""
    from transformers import AutoTokenizer

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.chat_template = {"default": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                               "tool_use": "TOOLS: {{ tools }} {% for m in messages %}{{ m['content'] }}{% endfor %}"}
    tokenizer.save_pretrained(str(base))
    assert (base / "additional_chat_templates" / "tool_use.jinja").is_file()
    return base


def test_named_chat_templates_are_copied_and_owned(named_templates, tmp_path):
    """Before, the MoE lost every chat template but the default one (tool_use, rag...)."""
    from transformers import AutoTokenizer

    out = upcycle({"base_model": str(named_templates), "num_experts": 2, "gate_mode": "random"}, tmp_path / "moe").output
    name = "additional_chat_templates/tool_use.jinja"
    assert (out / name).read_bytes() == (named_templates / name).read_bytes()
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == \
        AutoTokenizer.from_pretrained(str(named_templates)).chat_template
    recipe = json.loads((out / "moe_upcycle.json").read_text())
    assert recipe["sha256"][name] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    assert verify(out).ok
    # the folder is the build's own: --force replaces it ...
    assert upcycle({"base_model": str(named_templates), "num_experts": 2, "gate_mode": "random"}, out,
                   force=True).output == out
    # ... but not with a template the user added or edited there, which verify also names
    (out / name).write_text("edited")
    result = verify(out)
    assert not result.ok and any(p.startswith(f"{name}: differs from the base's") for p in result.problems)
    (out / "additional_chat_templates" / "mine.jinja").write_text("user's own")
    code = runner.invoke(app, ["build", "--force", str(_recipe_file(tmp_path, named_templates)), str(out)])
    assert code.exit_code == 1
    assert "additional_chat_templates/mine.jinja" in code.output and f"{name} (changed since the build)" in code.output
    assert (out / "additional_chat_templates" / "mine.jinja").read_text() == "user's own"


def _recipe_file(tmp_path: Path, base: Path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n")
    return path


def test_build_verify_puts_results_in_card_and_recipe(licensed_base, tmp_path, write_yaml):
    cfg = write_yaml({"base_model": str(licensed_base), "num_experts": 4, "gate_mode": "random"})
    out = tmp_path / "moe"
    res = runner.invoke(app, ["build", str(cfg), str(out), "--verify"])
    assert res.exit_code == 0, res.output
    card = (out / "README.md").read_text(encoding="utf-8")  # the card is UTF-8 whatever the locale
    assert "Checked with `moe-upcycle verify`" in card and "**passed**" in card
    assert "| top-1 agreement | 100.0% of" in card and "| mean KL(dense‖moe) |" in card
    assert f"| dense base | local model {licensed_base.name} |" in card
    recipe = json.loads((out / "moe_upcycle.json").read_text())
    assert recipe["verify"]["ok"] is True and recipe["verify"]["comparison"]["max_abs_diff"] < 1e-4  # stories logits reach ~20: 5e-6 of them
    assert "folder" not in recipe["verify"] and recipe["sha256"]["README.md"] == _sha(out / "README.md")
    again = verify(out, max_new_tokens=2)  # the published folder checks out, hashes included
    assert again.ok and again.notes == []


@pytest.mark.parametrize("front,expected", [
    ("license: [apache-2.0, mit]\n", None),  # a list: the hub's license is one id
    ("license: {id: mit}\n", None),
    ("a: &a [x, x, x]\nb: &b [*a, *a, *a]\nlicense: *b\n", None),  # aliases: copied, they made a card of anchors
    ("license: other\nlicense_name: [a]\nlicense_link: https://example.com/LICENSE\n",
     {"license": "other", "license_link": "https://example.com/LICENSE"}),
    ("license: '   '\n", None),
])
def test_a_license_that_is_not_text_is_not_copied_into_the_card(front, expected, tiny_llama, tmp_path):
    """Before, whatever the base card's front matter held under license: went into the MoE's card, so a list or a
    YAML alias tree made a card the hub does not accept; now only text is taken, else the card says to set it."""
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    (base / "README.md").write_text(f"---\n{front}---\n# a dense model\n")
    assert read_license(base) == expected
    result = upcycle({"base_model": str(base), "num_experts": 2, "gate_mode": "random"}, tmp_path / "moe")
    card = ModelCard.load(result.output / "README.md")
    got = card.data.to_dict().get("license")
    assert got == (expected or {}).get("license") and (got is None or isinstance(got, str))


# ------------------------------------------------------------------ safe to upload as it is (issue 35)


def _machine_words() -> list[str]:
    import getpass
    import os

    home = str(Path.home())
    return [w for w in (home if home != "/" else None, os.environ.get("HOME"), getpass.getuser()) if w]


def test_a_built_folder_names_no_path_of_the_machine_and_verify_and_route_still_find_everything(
        tiny_llama, tmp_path, monkeypatch):
    """Before, moe_upcycle.json recorded the recipe's absolute paths (home folders, user names) and was uploaded
    with the folder. Every byte of every file the build writes is scanned for the build folder's path, $HOME and
    the user name; the files it copies are the base's own bytes. Then, from another working folder, verify finds
    the base and the plan, and route --label-by embedding finds the prompt files, through the recorded paths."""
    import re

    project = tmp_path / "project"
    shutil.copytree(tiny_llama, project / "models" / "base")
    (project / "prompts").mkdir()
    (project / "prompts" / "story.txt").write_text("Once upon a time there was a cat\nThe dog ran home\n")
    (project / "prompts" / "code.txt").write_text("def add(a, b): return a + b\nimport numpy as np\n")
    out = project / "out" / "moe"
    recipe = project / "r.yaml"
    recipe.write_text(yaml.safe_dump({  # absolute paths throughout, and the output named in the recipe
        "base_model": str(project / "models" / "base"), "gate_mode": "hidden", "output": str(out),
        "experts": [{"source_model": str(project / "models" / "base"), "name": "story",
                     "positive_prompts_from": str(project / "prompts" / "story.txt")},
                    {"source_model": "models/base", "name": "code", "positive_prompts_from": "prompts/code.txt"}]}))
    monkeypatch.chdir(project)
    run = CliRunner().invoke(app, ["build", str(recipe), "--verify", "--no-lint"])
    assert run.exit_code == 0, run.output

    manifest = json.loads((out / "moe_upcycle.json").read_text())
    config = manifest["config"]
    assert (config["base_model"], config["output"], manifest["paths_relative_to"]) == ("../../models/base", None, ".")
    assert [(e["source_model"], e["positive_prompts_from"]) for e in config["experts"]] == [
        ("../../models/base", "../../prompts/story.txt"), ("../../models/base", "../../prompts/code.txt")]
    assert manifest["verify"]["base"] == "../../models/base" and manifest["verify"]["ok"] is True

    copied = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}
    looked_for = [str(tmp_path), *_machine_words()]
    for file in sorted(out.iterdir()):
        if file.suffix == ".safetensors":
            continue
        data = file.read_bytes()
        if file.name in copied:  # the base's own file, byte for byte: nothing of ours in it
            assert data == (project / "models" / "base" / file.name).read_bytes(), file.name
            continue
        text = data.decode("utf-8")
        for word in looked_for:
            found = re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w.-])", text) if "/" not in word else \
                (word in text and word)
            assert not found, f"{file.name} names {word!r}"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    got = verify(out, device="cpu", max_new_tokens=2)
    assert got.ok and got.comparison is not None and got.planned_tensors > 0, (got.problems, got.notes)
    assert got.base == str(project / "models" / "base")
    labeled = elsewhere / "labeled.jsonl"
    labeled.write_text('{"text": "Once upon a time"}\n{"text": "def f(): pass", "expert": "code"}\n')
    routed = CliRunner().invoke(app, ["route", str(out), "--labeled", str(labeled), "--label-by", "embedding",
                                      "--json", "--device", "cpu"])
    assert routed.exit_code == 0, routed.output
    assert json.loads(routed.stdout)["experts"] == ["story", "code"]


def test_hub_models_are_recorded_by_id_and_commit_and_home_paths_with_a_tilde(tiny_llama, tmp_path, monkeypatch):
    """A model read from the Hugging Face cache is recorded as org/name@<the commit read>, whatever spelling the
    recipe used (the id, or the snapshot's folder); a folder reached from the output only through the home folder
    is recorded ~/..., never /home/<user>/...; verify reads both back."""
    import huggingface_hub.constants as constants

    from moe_upcycle.publish.manifest import PortableRefs

    COMMIT = hashlib.sha1(b"acme/tiny-llama").hexdigest()  # a commit, as the hub names snapshots

    home, cache = tmp_path / "home" / "someone", tmp_path / "home" / "someone" / ".cache" / "hub"
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text(COMMIT)
    for f in tiny_llama.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    shutil.copytree(tiny_llama, home / "models" / "ft")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    out = tmp_path / "srv" / "out"
    refs = PortableRefs(out)
    assert refs.ref("acme/tiny-llama") == f"acme/tiny-llama@{COMMIT}"
    assert refs.ref(str(snapshot)) == f"acme/tiny-llama@{COMMIT}"
    assert refs.ref(str(home / "models" / "ft")) == "~/models/ft"  # not ../../home/someone/models/ft
    assert refs.ref("org/not-cached") == "org/not-cached" and not refs.relative

    result = upcycle({"base_model": "acme/tiny-llama", "gate_mode": "random", "experts": [
        {"source_model": "acme/tiny-llama"}, {"source_model": str(home / "models" / "ft")}]}, out)
    config = json.loads((result.output / "moe_upcycle.json").read_text())["config"]
    assert config["base_model"] == f"acme/tiny-llama@{COMMIT}"
    assert [e["source_model"] for e in config["experts"]] == [f"acme/tiny-llama@{COMMIT}", "~/models/ft"]
    got = verify(out, device="cpu", max_new_tokens=2)
    assert got.ok and got.comparison is not None and got.planned_tensors, (got.problems, got.notes)


def test_a_folder_every_path_to_which_names_the_user_is_recorded_by_name_and_said(tiny_llama, tmp_path, monkeypatch):
    """/data/<user>/model from an output elsewhere: no spelling leaves the user name out, so the manifest records the
    folder's name alone and the build says that verify will need --base."""
    from moe_upcycle.publish import manifest

    monkeypatch.setattr(manifest, "_user", lambda: "someone")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shutil.copytree(tiny_llama, tmp_path / "data" / "someone" / "llama")
    result = upcycle({"base_model": str(tmp_path / "data" / "someone" / "llama"), "num_experts": 2,
                      "gate_mode": "random"}, tmp_path / "out" / "moe")
    recorded = json.loads((result.output / "moe_upcycle.json").read_text())
    assert recorded["config"]["base_model"] == "llama" and "paths_relative_to" not in recorded
    assert result.notes[-1] == (f"moe_upcycle.json records {tmp_path / 'data' / 'someone' / 'llama'} by its folder "
                                f"name, 'llama', alone: every path to it from the output names your user name, and "
                                f"the manifest is uploaded with the folder; `moe-upcycle verify` of the output will "
                                f"need --base")
    assert "someone" not in (result.output / "moe_upcycle.json").read_text()
