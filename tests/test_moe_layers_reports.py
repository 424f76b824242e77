"""What the commands say about an interleaved build (``moe_layers:``) and about ``norm_topk_prob: false``.

`plan` names the MoE layers and the runtimes that cannot run them, `verify` checks the layers transformers
built against the recipe (and fails a folder whose config.json says other layers), `route` reports the MoE
layers only, by their own index, and the model card says where the experts are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moe_upcycle import upcycle
from moe_upcycle.check.route import route
from moe_upcycle.check.route_eval import routing_accuracy
from moe_upcycle.check.verify import verify
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.cli import app
from moe_upcycle.errors import PlanError
from moe_upcycle.planning.runtimes import EXACT, RUNS, compatibility
from moe_upcycle.recipe.resolve import check_params
from moe_upcycle.recipe.schema import load_config
from tf4_logits import tf5_logits
from tolerances import assert_close_rel

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer")
IDS = [1, 17, 42, 99, 5, 230, 7, 64, 128, 3, 250, 11]
runner = CliRunner()


@pytest.fixture(scope="module")
def qwen3_4l(tmp_path_factory) -> Path:
    return make_dense_model(tmp_path_factory.mktemp("dense") / "qwen3", family="qwen3", seed=50, num_hidden_layers=4,
                            random_norms_and_biases=True)


@pytest.fixture(scope="module")
def interleaved(qwen3_4l, tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, built folder): Qwen3 -> Qwen3-MoE with MoE in layers 1 and 3, prompts for every expert."""
    work = tmp_path_factory.mktemp("interleaved")
    recipe = work / "experts.yaml"
    experts = "\n".join(f"  - source_model: {qwen3_4l}\n    name: {name}\n    positive_prompts: [\"{prompt}\"]"
                        for name, prompt in (("story", "Once upon a time there was a dragon"),
                                             ("code", "def add(a, b): return a + b"),
                                             ("math", "The integral of x squared"),
                                             ("french", "Bonjour, comment allez-vous")))
    recipe.write_text(f"base_model: {qwen3_4l}\narchitecture: qwen3_moe\ngate_mode: cheap_embed\ndtype: float32\n"
                      f"moe_layers: {{every: 2}}\nexperts:\n{experts}\n", encoding="utf-8")
    out = work / "out"
    result = runner.invoke(app, ["build", str(recipe), str(out), "--no-lint"])
    assert result.exit_code == 0, result.output
    return recipe, out


def test_plan_names_the_moe_layers_and_the_runtimes(interleaved):
    recipe, _ = interleaved
    result = runner.invoke(app, ["plan", str(recipe)], env={"COLUMNS": "250"})
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    assert "MoE layers │ layers 1, 3 of 4 (dense MLP in 0, 2)" in text
    assert "moe_layers: {every: 2}: MoE in layers 1, 3 of 4; layers 0, 2 keep the dense MLP" in text
    data = json.loads(runner.invoke(app, ["plan", str(recipe), "--json"]).output)
    assert (data["moe_layers"], data["num_layers"], data["moe_layers_text"]) == ([1, 3], 4, "layers 1, 3 of 4")
    verdicts = {v["runtime"]: v["status"] for v in data["runtimes"]}
    assert verdicts == {"transformers 5": "exact", "transformers 4.x": "exact", "vLLM": "exact",
                        "llama.cpp": "will not load", "ExLlamaV2": "will not load"}
    routers = [c for c in data["components"] if c["kind"] == "router"]
    assert [c["count"] for c in routers] == [2]


def test_verify_passes_and_reports_the_layers_transformers_built(interleaved):
    _, out = interleaved
    result = verify(out, max_new_tokens=1)
    assert result.ok, result.problems
    assert (result.moe_layers, result.num_layers) == ([1, 3], 4)
    assert ("MoE layers", "layers 1, 3 of 4 (dense MLP in 0, 2)") in result.rows()
    assert result.comparison.top1_agreement == 1.0 and result.comparison.mean_kl < 1e-9  # copies: the dense model


def test_verify_fails_a_config_that_says_other_layers(interleaved, tmp_path):
    import shutil

    _, out = interleaved
    copy = tmp_path / "edited"
    shutil.copytree(out, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(decoder_sparse_step=1, mlp_only_layers=[])  # every layer an MoE layer, as the build did not write
    (copy / "config.json").write_text(json.dumps(cfg))
    result = verify(copy, hashes=False, max_new_tokens=1)
    assert not result.ok
    assert any("transformers built MoE blocks in layers 0, 1, 2, 3, but the recipe makes layers 1, 3 of 4 MoE "
               "layers" in p for p in result.problems), result.problems


def test_route_reports_the_moe_layers_by_their_index(interleaved):
    _, out = interleaved
    prompts = ["Once upon a time there was a dragon", "def add(a, b): return a + b"]
    result = route(out, prompts, device="cpu")
    assert result.layers == [1, 3] and result.top1.shape == (2, 2, 4)
    data = result.to_dict()
    assert [row["layer"] for row in data["layers"]] == [1, 3]
    score = routing_accuracy(result.shares(), ["story", "code"], result.expert_names, result.layers)
    assert score.layer_indices == [1, 3] and score.to_dict()["layers"] == [1, 3]
    cli = runner.invoke(app, ["route", str(out), "--prompts", str(_prompt_file(out.parent, prompts)), "--device",
                              "cpu"], env={"COLUMNS": "200"})
    rows = [line.split("│")[1].strip() for line in cli.output.splitlines()
            if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    assert cli.exit_code == 0 and rows == ["1", "3"], cli.output


def _prompt_file(folder: Path, prompts: list[str]) -> Path:
    path = folder / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return path


def test_model_card_says_where_the_experts_are(interleaved):
    _, out = interleaved
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "MoE in layers 1, 3 of 4; layers 0, 2 keep the dense MLP." in card
    assert "| llama.cpp | will not load | dense layers between MoE layers (moe_layers)" in card
    assert "moe_layers:\n  every: 2" in card  # the recipe as used


def test_norm_topk_prob_false_is_qwen15s_setting_and_the_plan_says_what_it_costs(tmp_path):
    base = make_dense_model(tmp_path / "qwen2", family="qwen2", seed=51, random_norms_and_biases=True)
    fields = {"base_model": str(base), "architecture": "qwen2_moe", "num_experts": 4, "gate_mode": "random",
              "dtype": "float32", "norm_topk_prob": False}
    out = tmp_path / "norm_false"
    result = upcycle(fields, out)
    assert json.loads((out / "config.json").read_text())["norm_topk_prob"] is False
    assert any("norm_topk_prob: false" in c and "does not start as the dense model" in c for c in result.plan.inexact)
    assert not check_params(load_config(fields)).function_preserving
    verdicts = {v.runtime: v for v in compatibility(result.plan)}
    assert verdicts["llama.cpp"].status == EXACT  # llama.cpp's qwen2moe never renormalises either
    assert "not renormalised, as in transformers with norm_topk_prob: false" in verdicts["llama.cpp"].why
    dense = tf5_logits(base, IDS)
    moe = tf5_logits(out, IDS)
    assert float((moe - dense).abs().max()) > 1e-3 * float(dense.abs().max())  # each layer scaled by its top-2 mass
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": True}))
    assert_close_rel(tf5_logits(out, IDS), dense)  # the weights are the copies; only the renormalisation differed


def test_norm_topk_prob_false_with_every_expert_active_changes_nothing(tmp_path):
    base = make_dense_model(tmp_path / "qwen2", family="qwen2", seed=52, random_norms_and_biases=True)
    out = tmp_path / "all_active"
    result = upcycle({"base_model": str(base), "architecture": "qwen2_moe", "num_experts": 4, "experts_per_token": 4,
                      "gate_mode": "random", "dtype": "float32", "norm_topk_prob": False}, out)
    assert result.plan.inexact == () and any("changes nothing at init" in n for n in result.plan.notes)
    assert_close_rel(tf5_logits(out, IDS), tf5_logits(base, IDS))


def test_norm_topk_prob_false_is_refused_for_mixtral_and_runs_not_exact_in_llamacpp_qwen3(qwen3_4l, tmp_path):
    llama = make_dense_model(tmp_path / "llama", family="llama", seed=53)
    with pytest.raises(PlanError) as err:
        upcycle({"base_model": str(llama), "architecture": "mixtral", "num_experts": 4, "gate_mode": "random",
                 "norm_topk_prob": False}, dry_run=True)
    assert "architecture: mixtral: Mixtral always renormalises the top-k router weights (it has no norm_topk_prob), " \
           "but norm_topk_prob: false is set → use architecture: qwen2_moe" in str(err.value)
    plan = upcycle({"base_model": str(qwen3_4l), "num_experts": 4, "gate_mode": "random", "norm_topk_prob": False},
                   dry_run=True).plan
    verdict = next(v for v in compatibility(plan) if v.runtime == "llama.cpp")
    assert verdict.status == RUNS and "always renormalises" in verdict.why
