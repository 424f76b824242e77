"""Gate modes that need no forward pass: random, uniform_random, uniform, cheap_embed."""

from __future__ import annotations

import math

import pytest
import torch

from moe_upcycle.build import prepare
from moe_upcycle.gates.router import compute_gate_rows
from moe_upcycle.recipe.resolve import gate_params


def _gates(base, **cfg):
    config, sources, plan = prepare({"base_model": str(base), **cfg})
    return compute_gate_rows(gate_params(config), plan, sources[config.base_model]).routers


def test_random_gates_std_and_seed(tiny_llama):
    g = _gates(tiny_llama, num_experts=8, gate_mode="random", router_init_std=0.02, seed=1)
    assert set(g) == {0, 1} and g[0].shape == (8, 64)
    assert abs(torch.cat([g[0], g[1]]).std().item() - 0.02) < 0.002
    again = _gates(tiny_llama, num_experts=8, gate_mode="random", seed=1)
    other = _gates(tiny_llama, num_experts=8, gate_mode="random", seed=2)
    assert torch.equal(g[0], again[0]) and not torch.equal(g[0], other[0])
    assert not torch.equal(g[0], g[1])


def test_uniform_and_uniform_random(tiny_llama):
    zeros = _gates(tiny_llama, num_experts=4, gate_mode="uniform")
    assert all(torch.count_nonzero(t) == 0 for t in zeros.values())
    u = _gates(tiny_llama, num_experts=4, gate_mode="uniform_random")[0]
    bound = 1 / math.sqrt(64)
    assert u.abs().max() <= bound and u.abs().max() > 0.8 * bound


def test_cheap_embed_is_masked_mean_of_token_embeddings(stories):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    prompts = ["Once upon a time", "The dog ran to the park"]
    neg = ["Lily was sad"]
    g = _gates(stories, gate_mode="cheap_embed", gate_scale=3.0, experts=[
        {"source_model": str(stories), "positive_prompts": prompts, "negative_prompts": neg},
        {"source_model": str(stories), "positive_prompts": ["She ate a big red apple"]},
    ])
    tok = AutoTokenizer.from_pretrained(str(stories))
    with safe_open(str(stories / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")

    def mean(ps):
        return torch.stack([emb[tok(p, add_special_tokens=False)["input_ids"]].mean(0) for p in ps]).mean(0)

    want = mean(prompts) - mean(neg)
    torch.testing.assert_close(g[0][0], want / want.norm() * 3.0)
    assert torch.equal(g[0], g[4])  # same vector every layer


# ------------------------------------------------------------ router keys in the mode in use (issue 35)

LILY = "Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog."


def _similar_experts(base, *extra_experts) -> list[dict]:
    """Two experts whose prompts differ by three words: cheap_embed rows at cosine 0.991 on stories260K."""
    return [{"source_model": str(base), "name": "lily", "positive_prompts": [LILY]},
            {"source_model": str(base), "name": "lily_too", "positive_prompts": [LILY + " The end."]},
            *extra_experts]


def _warnings(base, tmp_path, name, **cfg):
    from moe_upcycle import upcycle

    return upcycle({"base_model": str(base), "gate_mode": "cheap_embed", **cfg}, tmp_path / name).gate_warnings


def test_gate_center_with_mergekit_is_refused_before_anything_is_written(stories, tmp_path):
    """Before, `gate_center: true` with --mergekit built shards byte-identical to those without it. mergekit mode
    promises mergekit-moe's rows, which are never centred: the key is refused, through the CLI, naming it, the
    reason and the two ways out; nothing is written."""
    import yaml
    from typer.testing import CliRunner

    from moe_upcycle.cli import app

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"base_model": str(stories), "gate_mode": "cheap_embed", "gate_center": True,
                                      "experts": _similar_experts(stories)}))
    run = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "moe"), "--mergekit", "--no-lint"])
    said = " ".join(run.output.split())
    assert run.exit_code == 1 and "Traceback" not in said, said
    assert (f"{recipe}: gate_center: true is not read with gate_source: mergekit (build --mergekit), which computes "
            "mergekit-moe 0.1.5's router rows exactly, and mergekit-moe does not centre its rows; the rows would be "
            "built as if it were not there — remove it, or build with gate_source: native (without --mergekit), "
            "which reads it with gate_mode cheap_embed") in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.mark.parametrize("cfg, words", [
    ({"gate_mode": "random", "gate_source": "mergekit", "num_experts": 2, "router_init_std": 0.5},
     "router_init_std: 0.5 is not read with gate_source: mergekit (build --mergekit), which computes mergekit-moe "
     "0.1.5's router rows exactly, and mergekit-moe draws its random rows with std 1.0"),
    ({"gate_mode": "random", "num_experts": 2, "gate_scale": 2.0},
     "gate_scale: 2 is read by gate_mode hidden, hidden_avg, hidden_last, kmeans or cheap_embed only, so gate_mode "
     "random would build the same routers without it; remove it, or use one of those modes"),
    ({"gate_mode": "uniform", "num_experts": 2, "router_init_std": 0.5},
     "router_init_std: 0.5 is read by gate_mode random only, so gate_mode uniform would build the same routers "
     "without it; remove it, or use that mode"),
    ({"gate_mode": "random", "num_experts": 2, "gate_center": True},
     "gate_center: true is read by gate_mode hidden, hidden_avg, hidden_last, kmeans or cheap_embed only"),
    ({"gate_mode": "hidden", "num_experts": 2, "calibration_text": "docs.txt"},
     "calibration_text: 'docs.txt' is read by gate_mode kmeans only"),
])
def test_a_router_key_the_mode_does_not_read_is_refused(cfg, words):
    """The same class: a router key given a value the gate mode (or mergekit mode) never reads; its default passes."""
    from moe_upcycle.errors import ConfigError
    from moe_upcycle.recipe.gate_keys import INERT
    from moe_upcycle.recipe.schema import load_config

    with pytest.raises(ConfigError) as err:
        load_config({"base_model": "some/model", **cfg})
    assert any(words in p for p in err.value.problems), err.value.problems
    key = next(k for k in INERT if k in cfg)
    load_config({"base_model": "some/model", **cfg, key: INERT[key]})  # written at its default: nothing to refuse


def test_parallel_router_advice_works_in_the_mode_in_use(stories, tmp_path):
    """The warning for nearly parallel rows advises what the mode in use has, and following it clears the warning:
    natively gate_center (now applied to cheap_embed rows too: two centred rows point opposite ways), in mergekit
    mode negative prompts, with the native mode's centring named as the way out of mergekit's computation."""
    native = _warnings(stories, tmp_path, "a", experts=_similar_experts(stories))
    assert native == ["routing: gate vectors of experts `lily` and `lily_too` are nearly parallel (cosine > 0.95, up "
                      "to 0.991) in layer(s) 0-4: your prompts for `lily` and `lily_too` are too similar for the "
                      "router to tell apart; make them more distinct, add negative_prompts, or set gate_center: true"]
    assert _warnings(stories, tmp_path, "b", experts=_similar_experts(stories), gate_center=True) == []

    mergekit = _warnings(stories, tmp_path, "c", experts=_similar_experts(stories), gate_source="mergekit")
    assert len(mergekit) == 1 and mergekit[0].endswith(
        "make them more distinct or add negative_prompts (mergekit-moe's rows, which gate_source: mergekit reproduces, "
        "have no centring; gate_source: native with gate_center: true removes what all prompts share)")
    crossed = _similar_experts(stories)
    crossed[0]["negative_prompts"], crossed[1]["negative_prompts"] = [LILY + " The end."], [LILY]
    assert _warnings(stories, tmp_path, "d", experts=crossed, gate_source="mergekit") == []

    # with a third, different expert the two stay parallel after centring: the advice no longer offers it
    third = {"source_model": str(stories), "name": "tom", "positive_prompts": ["Tom"]}
    centred = _warnings(stories, tmp_path, "e", experts=_similar_experts(stories, third), gate_center=True)
    assert len(centred) == 1 and centred[0].endswith(
        "make them more distinct or add negative_prompts (gate_center is on already)"), centred


def test_gate_center_centres_cheap_embed_rows(stories):
    """gate_center subtracts the mean over experts from the cheap_embed directions before they are normalised, as
    for hidden-state rows (before, the key was ignored in this mode)."""
    from moe_upcycle.gates.router import cheap_embed_rows

    experts = _similar_experts(stories, {"source_model": str(stories), "name": "tom", "positive_prompts": ["Tom"]})
    plain = _gates(stories, gate_mode="cheap_embed", gate_scale=1.0, experts=experts)[0]  # (3, H) unit rows
    centred = _gates(stories, gate_mode="cheap_embed", gate_scale=1.0, gate_center=True, experts=experts)[0]
    config, sources, _ = prepare({"base_model": str(stories), "gate_mode": "cheap_embed", "experts": experts})
    means = cheap_embed_rows(gate_params(config).experts, sources[config.base_model])  # (3, H)
    torch.testing.assert_close(plain, torch.nn.functional.normalize(means, dim=-1))
    torch.testing.assert_close(centred, torch.nn.functional.normalize(means - means.mean(0, keepdim=True), dim=-1))
