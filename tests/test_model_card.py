"""The model card a publisher uploads as is: parsed by huggingface_hub, tables rendered as markdown."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants
from huggingface_hub.utils import validate_repo_id
from markdown_it import MarkdownIt
from typer.testing import CliRunner

from moe_upcycle import upcycle
from moe_upcycle.publish.card_facts import code_span, cell, readable_count
from moe_upcycle.terminal.hints import is_hub_id
from moe_upcycle.cli import app
from moe_upcycle.recipe.schema import load_config

runner = CliRunner()


def hub_cache(cache: Path, repo_id: str, folder: Path) -> None:
    """Put `folder` into a Hugging Face cache layout as `repo_id` (what a download leaves behind)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "hf_cache"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def named_copy(src: Path, dst: Path, name_or_path: str) -> Path:
    """A copy of a local model whose config.json records the hub id it was fine-tuned from/saved as."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["_name_or_path"] = name_or_path
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def tables(markdown: str) -> list[list[list[str]]]:
    """Every table of the rendered markdown, as rows of cell texts (header row first)."""
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    found, row = [], None
    for tok in tokens:
        if tok.type == "table_open":
            found.append([])
        elif tok.type == "tr_open":
            row = []
        elif tok.type == "inline" and row is not None:
            row.append(tok.content)
        elif tok.type == "tr_close":
            found[-1].append(row)
            row = None
    return found


def test_hub_ids_local_models_and_shared_experts_in_base_model(tiny_qwen2, models, cache, tmp_path):
    hub_cache(cache, "TinyOrg/qwen2-base", tiny_qwen2)
    coder = named_copy(tiny_qwen2, tmp_path / "coder", "TinyOrg/qwen2-coder")  # a local folder that names its hub id
    helper = named_copy(tiny_qwen2, tmp_path / "helper", str(tmp_path / "somewhere"))  # a local path: no hub id
    result = upcycle({"base_model": "TinyOrg/qwen2-base", "architecture": "qwen2_moe", "gate_mode": "random",
                      "experts": [{"source_model": "TinyOrg/qwen2-base", "name": "plain | base"},
                                  {"source_model": str(coder), "name": "code"}],
                      "experts_per_token": 1,
                      "shared_experts": [{"source_model": str(helper), "name": "helper"}]}, tmp_path / "moe")
    text = (result.output / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.base_model == ["TinyOrg/qwen2-base", "TinyOrg/qwen2-coder"]
    for repo in card.data.base_model:
        validate_repo_id(repo)
    assert card.data.base_model_relation == "merge" and card.data.library_name == "transformers"
    assert str(tmp_path) not in text  # no local path anywhere a publisher would upload
    assert "local model `helper`" in text
    assert "pypi.org" not in text

    experts = next(t for t in tables(card.content) if t[0][:3] == ["#", "name", "source model"])
    assert [len(r) for r in experts] == [5] * 4  # header + 2 routed + 1 shared, 5 cells each
    assert experts[1][1] == "plain | base"  # a pipe in a name stays inside its cell (escaped in the source)
    assert experts[1][2] == "[TinyOrg/qwen2-base](https://huggingface.co/TinyOrg/qwen2-base)"
    assert experts[2][2] == "[TinyOrg/qwen2-coder](https://huggingface.co/TinyOrg/qwen2-coder)"
    assert experts[3][:3] == ["shared 0", "helper", "local model `helper`"]


def test_a_hub_model_pinned_at_a_revision_is_a_hub_model(tiny_llama, cache, tmp_path):
    """mergekit's org/name@revision names the hub model org/name at that revision, not a local folder."""
    hub_cache(cache, "TinyOrg/llama-base", tiny_llama)
    hub_cache(cache, "TinyOrg/llama-ft", tiny_llama)
    result = upcycle({"base_model": "TinyOrg/llama-base", "gate_mode": "random", "experts_per_token": 1,
                      "experts": [{"source_model": "TinyOrg/llama-ft@main"}, {"source_model": "TinyOrg/llama-base"}]},
                     tmp_path / "moe")
    text = (result.output / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.base_model == ["TinyOrg/llama-base", "TinyOrg/llama-ft"]
    assert "local model" not in text and "no hub id" not in text
    experts = next(t for t in tables(card.content) if t[0][:3] == ["#", "name", "source model"])
    assert experts[1][2] == "[TinyOrg/llama-ft@main](https://huggingface.co/TinyOrg/llama-ft/tree/main)"
    assert "- source_model: TinyOrg/llama-ft@main" in text  # the card's recipe still pins the revision


def test_parameter_table_is_readable_and_closed(stories, tmp_path):
    # stories260K ties its embeddings: the sentence about it must not become a row of the table
    result = upcycle({"base_model": str(stories), "num_experts": 4, "gate_mode": "random"}, tmp_path / "moe")
    card = ModelCard((result.output / "README.md").read_text())
    params = next(t for t in tables(card.content) if t[0] == ["parameters", "count"])
    total, active = readable_count(result.summary.total_params), readable_count(result.summary.active_params)
    assert params == [["parameters", "count"], ["total", total], ["active per token", active]]
    assert total.endswith("M)") and "(0.00B)" not in card.content
    assert "The input and output embeddings are tied" in card.content
    assert "base_model" not in card.data.to_dict()  # local only: nothing the hub would reject
    assert "Made from 1 local model(s) with no hub id (local model `stories260K`)" in card.content


def test_card_says_how_experts_and_routers_were_made_and_keeps_verify_figures(stories, tmp_path):
    config = tmp_path / "experts.yaml"
    config.write_text(f"""\
base_model: {stories}
gate_mode: hidden
device: cpu
experts:
  - source_model: {stories}
    name: kids
    positive_prompts_from: creative
  - source_model: {stories}
    name: numbers
    positive_prompts: ["One, two, three.", "She counted to ten."]
    negative_prompts: ["Once upon a time"]
""")
    result = runner.invoke(app, ["-q", "build", "--no-lint", "--verify", str(config), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    card = ModelCard((tmp_path / "moe" / "README.md").read_text())
    how = card.content.split("## How the experts were made")[1].split("##")[0]
    assert "- Experts: exact copies of the source FFN." in how
    assert "- Router (gate mode `hidden`): the base model's router inputs (post_attention_layernorm outputs, " \
           "mean over real tokens) on each expert's prompts, positive minus negative, length set per layer." in how
    creative = len(load_config(config).expert_list()[0].positive_prompts)
    assert f"  - `kids`: {creative} positive prompts (set `creative`)" in how
    assert "  - `numbers`: 2 positive prompts, 1 negative" in how
    verification = card.content.split("## Verification")[1].split("## Usage")[0]
    checks = next(t for t in tables(verification) if t[0] == ["check", "result"])
    rows = dict(checks[1:])
    assert rows["result"] == "PASSED" and rows["dense base"] == "local model stories260K"
    assert rows["top-1 agreement"].startswith("100.0% of ")
    assert str(stories) not in card.content


def test_init_in_words():
    from moe_upcycle.publish.card_facts import init_text
    from moe_upcycle.recipe.schema import ExpertInit

    assert init_text(ExpertInit(method="noise", scale=0.01)) == \
        "copies plus seeded Gaussian noise (std relative to each matrix 0.01)"
    assert init_text(ExpertInit(method="drop", ratio=0.25)) == \
        "Drop-Upcycling: a seeded 25% of each expert's neurons re-initialised"
    assert init_text(ExpertInit(method="drop")) == "Drop-Upcycling: a seeded 50% of each expert's neurons re-initialised"


def test_readable_count_and_cells():
    assert readable_count(591_232) == "591,232 (0.59M)"
    assert readable_count(1_100_048_384) == "1,100,048,384 (1.10B)"
    assert cell("a|b\n c") == "a\\|b c"
    # outside a table a pipe is shown as written (the escape showed as a backslash); backticks get a longer fence
    assert code_span("récit|story") == "`récit|story`" and code_span("the `x`\nexpert") == "`` the `x` expert ``"
    assert is_hub_id("meta-llama/Llama-3.2-1B") and not is_hub_id("/abs/path")
    assert not is_hub_id("../x/y") and not is_hub_id("a/b/c") and not is_hub_id("./ft0")


def test_names_with_pipes_and_backticks_keep_the_card_readable(stories, tmp_path):
    """A local folder named `a|b` split the experts table's row; outside the table the escape showed as `\\|`."""
    import shutil

    from moe_upcycle import upcycle

    odd = tmp_path / "pi|pe"
    shutil.copytree(stories, odd)
    out = upcycle({"base_model": str(stories), "gate_mode": "hidden", "experts": [
        {"source_model": str(odd), "name": "code|`x`", "positive_prompts": ["def f(x): return x"]},
        {"source_model": str(stories), "positive_prompts": ["Once upon a time"]}]}, tmp_path / "moe").output
    card = (out / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| 0 |"))
    assert row == "| 0 | code\\|`x` | local model `pi\\|pe` | 1 | none |"  # GFM: an escaped pipe inside the cell
    assert "local model `pi|pe`" in card and "  - `` code|`x` ``: 1 positive prompts" in card
