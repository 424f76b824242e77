"""The routing self-check of a prompt-routed build: each expert's wins among its own prompts, as `route --labeled`
counts them, computed here independently (transformers' own modules, hooks on post_attention_layernorm, the rows
read from the written safetensors file, top-1 and the majority over layers spelled out)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from moe_upcycle import upcycle
from moe_upcycle.check.route import route
from moe_upcycle.check.route_eval import routing_accuracy
from moe_upcycle.cli.app import app
from tests.routing_prompts import CODE, STORY

# `tales` is made to starve: its negative prompts are half of its own positive ones' kind
TALES_POS, TALES_NEG = STORY[6:], STORY[:6]


def recipe(base: Path, *, negatives: bool = True) -> dict:
    tales = {"source_model": str(base), "name": "tales", "positive_prompts": TALES_POS}
    if negatives:
        tales["negative_prompts"] = TALES_NEG
    return {"base_model": str(base), "gate_mode": "hidden", "experts_per_token": 1, "dtype": "float32",
            "device": "cpu", "experts": [{"source_model": str(base), "name": "code", "positive_prompts": CODE},
                                         {"source_model": str(base), "name": "story", "positive_prompts": STORY},
                                         tales]}


def router_rows(folder: Path) -> dict[int, torch.Tensor]:
    """layer -> (E, H) router weights, read straight from the written files."""
    rows = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                found = re.search(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$", key)
                if found:
                    rows[int(found.group(1))] = f.get_tensor(key).float()
    return rows


def independent_wins(base: Path, rows: dict[int, torch.Tensor], experts: list[list[str]]) -> list[list[int]]:
    """(E, E) confusion of each expert's own prompts: each prompt alone through the dense base, each layer's
    post_attention_layernorm output captured by a hook, special tokens dropped, top-1 per token, the prompt going to
    the expert with most top-1 picks over all layers (ties: lowest index)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(base))
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.post_attention_layernorm.register_forward_hook(
        lambda m, a, out, i=i: seen.__setitem__(i, out[0])) for i, layer in enumerate(model.model.layers)]
    n = len(experts)
    confusion = [[0] * n for _ in range(n)]
    try:
        for e, prompts in enumerate(experts):
            for prompt in prompts:
                enc = tok(prompt, return_tensors="pt", return_special_tokens_mask=True)
                real = enc.pop("special_tokens_mask")[0] == 0
                with torch.inference_mode():
                    model(**enc)
                picks = [0] * n
                for layer, w in rows.items():
                    for expert in (seen[layer][real] @ w.T).argmax(-1).tolist():
                        picks[expert] += 1
                confusion[e][picks.index(max(picks))] += 1
    finally:
        for h in handles:
            h.remove()
    return confusion


@pytest.fixture(scope="module")
def starved_build(stories, tmp_path_factory):
    return upcycle(recipe(stories), tmp_path_factory.mktemp("selfcheck") / "moe")


def test_self_check_counts_equal_an_independent_count_and_name_the_starved_expert(stories, starved_build):
    result = starved_build
    check = result.self_check
    assert check is not None and check.experts == ["code", "story", "tales"]
    want = independent_wins(stories, router_rows(result.output), [CODE, STORY, TALES_POS])
    assert check.confusion == want
    assert check.wins == [want[e][e] for e in range(3)]
    assert check.prompts == [12, 12, 6]
    # the scenario: tales loses most of its own prompts, the others keep theirs
    assert 2 * check.wins[2] < 6 and check.wins[0] == 12
    manifest = json.loads((result.output / "moe_upcycle.json").read_text())
    assert manifest["self_check"]["experts"] == {name: {"wins": want[e][e], "prompts": n}
                                                 for e, (name, n) in enumerate(zip(check.experts, [12, 12, 6]))}
    assert manifest["self_check"]["confusion"] == want
    assert list(manifest["self_check"]["starved"]) == ["tales"]
    card = (result.output / "README.md").read_text()
    assert "## Routing self-check" in card
    assert f"- tales wins {want[2][2]} of 6 of its own prompts" in card
    warned = [w for w in result.gate_warnings if "self-check" in w]
    assert len(warned) == 1 and f"expert `tales` wins {want[2][2]} of 6 of its own prompts" in warned[0]
    assert "negative_prompts pull its row away" in warned[0] and "experts[2].negative_prompts" in warned[0]


def test_self_check_agrees_with_route_labeled(starved_build):
    """The built MoE's experts are copies of the base: `route --labeled`'s confusion is the self-check's."""
    check = starved_build.self_check
    prompts = CODE + STORY + TALES_POS
    labels = ["code"] * 12 + ["story"] * 12 + ["tales"] * 6
    routed = route(starved_build.output, prompts, device="cpu", batch_size=4)
    score = routing_accuracy(routed.shares(), labels, routed.expert_names)
    assert score.confusion.tolist() == check.confusion


def test_without_the_negative_prompts_no_expert_starves(stories, tmp_path):
    result = upcycle(recipe(stories, negatives=False), tmp_path / "moe")
    check = result.self_check
    assert check.starved() == [] and not [w for w in result.gate_warnings if "self-check" in w]
    assert check.confusion == independent_wins(stories, router_rows(result.output), [CODE, STORY, TALES_POS])


def test_build_json_is_one_object_with_the_self_check(stories, write_yaml, tmp_path):
    path = write_yaml(recipe(stories))
    res = CliRunner().invoke(app, ["build", str(path), str(tmp_path / "moe"), "--json", "--no-lint"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # stdout holds the JSON object and nothing else
    assert set(data) == {"output", "shards", "bytes", "seconds", "experts", "gates", "self_check", "notes",
                         "sharing", "drift", "verify"}
    assert data["output"] == str(tmp_path / "moe")
    assert data["shards"] == sorted(p.name for p in (tmp_path / "moe").glob("*.safetensors"))
    assert data["bytes"] == sum(t.numel() * t.element_size() for t in _tensors(tmp_path / "moe"))
    assert data["gates"]["mode"] == "hidden" and data["gates"]["layers"] == [0, 1, 2, 3, 4]
    manifest = json.loads((tmp_path / "moe" / "moe_upcycle.json").read_text())
    assert data["self_check"] == manifest["self_check"]
    assert list(data["self_check"]["starved"]) == ["tales"]
    assert "expert `tales` wins" in res.stderr


def test_build_prints_each_experts_wins(stories, write_yaml, tmp_path):
    path = write_yaml(recipe(stories))
    res = CliRunner().invoke(app, ["build", str(path), str(tmp_path / "moe"), "--no-lint"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((tmp_path / "moe" / "moe_upcycle.json").read_text())
    for name, got in manifest["self_check"]["experts"].items():
        assert f"{name} wins {got['wins']} of {got['prompts']} of its own prompts" in res.stdout
    assert "warning:" in res.stderr and "expert `tales` wins" in res.stderr


def _tensors(folder: Path):
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                yield f.get_tensor(key)


def mean_router_inputs(base: Path, prompts: list[str]) -> torch.Tensor:
    """(L, H) mean over the prompts of each prompt's mean router input over its real tokens (hooks, one prompt at a
    time)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(base))
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.post_attention_layernorm.register_forward_hook(
        lambda m, a, out, i=i: seen.__setitem__(i, out[0])) for i, layer in enumerate(model.model.layers)]
    per_prompt = []
    try:
        for prompt in prompts:
            enc = tok(prompt, return_tensors="pt", return_special_tokens_mask=True)
            real = enc.pop("special_tokens_mask")[0] == 0
            with torch.inference_mode():
                model(**enc)
            per_prompt.append(torch.stack([seen[i][real].mean(0) for i in range(len(seen))]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(per_prompt).mean(0)


def test_gate_center_takes_the_shared_mean_from_both_means(stories, tmp_path):
    """gate_center with negative prompts (the shipped frankenMoE recipe's shape: math takes code's prompts as
    negatives): the mean of the experts' positive means is taken from an expert's positive *and* negative mean before
    the subtraction. Centring after the subtraction took it from an expert whose negatives had removed it already:
    its row pointed away from what every prompt shares, and on SmolLM2-135M the math expert won 0 of its 30 prompts
    (scripts/starving_experts.py: 30 of 30 now)."""
    config = recipe(stories, negatives=False)
    config["gate_center"] = True
    config["experts"][2]["negative_prompts"] = CODE
    result = upcycle(config, tmp_path / "moe")
    own = torch.stack([mean_router_inputs(stories, p) for p in (CODE, STORY, TALES_POS)], dim=1)  # (L, E, H)
    shared = own.mean(dim=1)  # (L, H)
    negative = mean_router_inputs(stories, CODE)
    want = own - shared[:, None]
    want[:, 2] = own[:, 2] - negative  # (own - shared) - (negative - shared)
    rows = router_rows(result.output)
    for layer, written in rows.items():
        cosine = torch.nn.functional.cosine_similarity(written, want[layer], dim=-1)
        assert bool((cosine > 1 - 1e-5).all()), (layer, cosine)
    assert result.self_check.confusion == independent_wins(stories, rows, [CODE, STORY, TALES_POS])


def test_over_the_memory_bound_each_prompts_mean_is_counted(stories, tmp_path, monkeypatch):
    """Token router inputs beyond `SELF_CHECK_BYTES`: each prompt's mean router input picks one expert per layer, the
    prompt going to the expert most layers pick; the warning says it was counted so."""
    import moe_upcycle.gates.hidden_gates as hg

    monkeypatch.setattr(hg, "SELF_CHECK_BYTES", 0)
    result = upcycle(recipe(stories), tmp_path / "moe")
    rows = router_rows(result.output)
    want = [[0] * 3 for _ in range(3)]
    for e, prompts in enumerate([CODE, STORY, TALES_POS]):
        for prompt in prompts:
            means = mean_router_inputs(stories, [prompt])  # (L, H)
            votes = [0, 0, 0]
            for layer, w in rows.items():
                votes[int((w @ means[layer]).argmax())] += 1
            want[e][votes.index(max(votes))] += 1
    assert not result.self_check.per_token and result.self_check.confusion == want
    assert any("(counted on each prompt's mean router input)" in w for w in result.gate_warnings) == bool(
        result.self_check.starved())
