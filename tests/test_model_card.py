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


# ---------------------------------------------------------------- the whole recipe, and what the build said (issue 35)

CHEAP_EMBED_RECIPE = """\
base_model: stories260K
experts:
- source_model: stories260K
  name: kids
  positive_prompts_from: creative
- source_model: stories260K
  name: expert_1
  positive_prompts:
  - One, two, three.
  residual_scale: 0.5
num_experts: null  # default
architecture: mixtral  # default: the output family for this base
gate_mode: cheap_embed
gate_source: native  # default
dtype: float32  # default: the base's
experts_per_token: 2  # default
shared_experts: []  # default
tensor_policy: share  # default
seed: 0  # default
max_shard_size: 5000000000  # default
checksums: true  # default
router_aux_loss_coef: 0.001  # default: Mixtral's
router_init_std: 0.02  # default; not read by gate_mode cheap_embed
gate_scale: null  # default: 16/sqrt(hidden) = 2
expert_init:
  method: drop
  ratio: 0.5
router_jitter_noise: 0.0  # default
output_router_logits: false  # default
report_init_drift: true  # default: measured for non-copy inits of outputs up to 2 GB
layout: per_expert  # default
attention_from: base  # default
shared_expert_gate: null  # default
gate_center: true
calibration_text: null  # default; not read by gate_mode cheap_embed
batch_size: 8  # default; not read by gate_mode cheap_embed, which runs no model
device: auto  # default
gate_dtype: null  # default; not read by gate_mode cheap_embed, which runs no model
quantize: null  # default; not read by gate_mode cheap_embed, which runs no model
moe_layers: null  # default: all 5 layers
norm_topk_prob: null  # default"""


def _section(card: str, title: str) -> str:
    return card.split(f"## {title}\n")[1].split("\n## ")[0]


def test_the_recipe_block_shows_every_key_with_the_value_built(stories, tmp_path):
    """Before, the block left out every key at its default (exclude_defaults): a reader could not tell the dtype,
    architecture, aux loss or drop ratio the model was built with. Now every key is there, a default says what it
    resolved to, a router key the mode does not read says so, and local paths are names."""
    result = upcycle({"base_model": str(stories), "gate_mode": "cheap_embed", "gate_center": True,
                      "expert_init": {"method": "drop"}, "output": str(tmp_path / "moe"),
                      "experts": [{"source_model": str(stories), "name": "kids", "positive_prompts_from": "creative"},
                                  {"source_model": str(stories), "positive_prompts": ["One, two, three."],
                                   "residual_scale": 0.5}]})
    card = (result.output / "README.md").read_text()
    recipe = _section(card, "Recipe")
    assert recipe.split("```yaml\n")[1].split("\n```")[0] == CHEAP_EMBED_RECIPE
    assert str(tmp_path) not in card and str(stories) not in card
    how = _section(card, "How the experts were made").strip().splitlines()
    assert how[:2] == [
        "- Experts: Drop-Upcycling: a seeded 50% of each expert's neurons re-initialised.",
        "- Router (gate mode `cheap_embed`): the mean token embedding of each expert's positive prompts (minus its "
        "negative prompts), no forward pass, centred over experts, rows of length 16/sqrt(hidden)."]
    assert _section(card, "Notes from the build").strip().splitlines() == [
        "- expert_init drop on expert(s) [0, 1]: Drop-Upcycling, 86 of 172 neurons per expert re-initialised "
        "(ratio 0.5)"]


def test_a_copy_upcycle_card_says_the_experts_are_one_ffn_until_trained(stories, tmp_path):
    result = upcycle({"base_model": str(stories), "num_experts": 4, "gate_mode": "random"}, tmp_path / "moe")
    card = (result.output / "README.md").read_text()
    assert _section(card, "How the experts were made").strip().splitlines() == [
        "- Experts: exact copies of the source FFN.",
        "- All 4 experts are the same FFN, the dense model's, so whichever experts the router picks the MoE computes "
        "what the dense model computes, until it is trained.",
        "- Router (gate mode `random`): random rows, normal(0, 0.02) (seed 0)."]
    recipe = _section(card, "Recipe")
    for line in ("num_experts: 4", "experts: []  # default", "gate_scale: null  # default; not read by gate_mode random",
                 "report_init_drift: false  # default: measured for non-copy inits of outputs up to 2 GB",
                 "expert_init:  # default\n  method: copy"):
        assert f"\n{line}\n" in recipe, line
    assert "Notes from the build" not in card  # the plan said nothing more


def test_a_mergekit_build_card_describes_mergekit_rows_and_what_the_build_said(stories, tmp_path):
    """gate_source: mergekit computes mergekit-moe's rows: the card said our native computation (post-attention
    norm outputs, rows scaled per layer); and a prompt recipe of identical experts carries the build's caution."""
    same = [{"source_model": str(stories), "positive_prompts": [p]} for p in ("Once upon a time", "The cat sat")]
    result = upcycle({"base_model": str(stories), "gate_mode": "cheap_embed", "gate_source": "mergekit",
                      "experts": same}, tmp_path / "moe")
    card = (result.output / "README.md").read_text()
    how = _section(card, "How the experts were made").strip().splitlines()
    assert how[2] == ("- Router (gate mode `cheap_embed`): mergekit-moe 0.1.5's computation: the summed token "
                      "embeddings (BOS included) of each expert's positive prompts, unit length, minus its negative "
                      "prompts', unit rows.")
    assert how[1] == "- All 2 experts are the same FFN, the dense model's, so whichever experts the router picks " \
                     "the MoE computes what the dense model computes, until it is trained."
    notes = _section(card, "Notes from the build")
    assert "- every expert is local model stories260K, unchanged: the 2 experts compute the same FFN" in notes
    assert "\ngate_source: mergekit\n" in _section(card, "Recipe")
    assert "gate_scale: null  # default: unit rows, as mergekit-moe writes them" in card
    assert str(stories) not in card
