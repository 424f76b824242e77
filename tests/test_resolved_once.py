"""One resolved recipe (issue #39): a build resolves its validated recipe once, and the planner, the architecture
choice, the plan report, the gates and the model card all read that one `Resolved`; the wording of where the
experts are is one helper's, spelled out here for one, several and no dense layers."""

from __future__ import annotations

import pytest

from moe_upcycle import upcycle
from moe_upcycle.recipe import resolved as resolved_module
from moe_upcycle.recipe.layer_words import moe_and_dense_said, moe_layers_row, moe_layers_said
from moe_upcycle.recipe.schema import load_config


@pytest.fixture
def resolutions(monkeypatch) -> list:
    """Every config `resolved` had to resolve (a memo hit is not one)."""
    made = []
    real = resolved_module._resolve

    def counted(config):
        made.append(config)
        return real(config)

    monkeypatch.setattr(resolved_module, "_resolve", counted)
    return made


def test_a_build_resolves_its_recipe_once(tiny_qwen3, resolutions, tmp_path):
    result = upcycle({"base_model": str(tiny_qwen3), "num_experts": 4, "gate_mode": "random", "dtype": "float32",
                      "moe_layers": [1]}, tmp_path / "moe")
    assert len(resolutions) == 1 and resolutions[0] is result.config
    card = (tmp_path / "moe" / "README.md").read_text()
    assert "MoE in layer 1 of 2; layer 0 keeps the dense MLP." in card  # one MoE layer, one dense: singular both
    assert result.plan.dense_layers == (0,) and result.summary.moe_layers == (1,)


def test_a_dry_run_resolves_once_and_the_summary_reads_it(tiny_llama, resolutions):
    result = upcycle({"base_model": str(tiny_llama), "num_experts": 4}, dry_run=True)
    assert len(resolutions) == 1
    r = resolved_module.resolved(result.config)
    assert len(resolutions) == 1  # the same object again, not a second resolution
    assert r.gate_mode_said == "random (the default for copies without prompts)"
    assert result.summary.gate_mode_default == "the default for copies without prompts"


def test_the_same_config_is_the_same_resolution_and_another_is_its_own(resolutions):
    a = load_config({"base_model": "org/m", "num_experts": 4, "gate_mode": "random", "moe_layers": {"every": 2}})
    b = load_config({"base_model": "org/m", "num_experts": 4, "gate_mode": "random", "dtype": "bfloat16"})
    ra, rb = resolved_module.resolved(a), resolved_module.resolved(b)
    assert ra is resolved_module.resolved(a) and rb is not ra and len(resolutions) == 2
    assert (ra.moe_layers.layers(6), rb.moe_layers.layers(3)) == ((1, 3, 5), (0, 1, 2))
    assert (str(ra.dtype), str(rb.dtype)) == ("None", "torch.bfloat16")


@pytest.mark.parametrize("moe, n, said, row, sentence", [
    ((1, 3), 4, "layers 1, 3 of 4", "layers 1, 3 of 4 (dense MLP in 0, 2)",
     "MoE in layers 1, 3 of 4; layers 0, 2 keep the dense MLP"),
    ((2,), 3, "layer 2 of 3", "layer 2 of 3 (dense MLP in 0, 1)", "MoE in layer 2 of 3; layers 0, 1 keep the dense MLP"),
    ((0, 1, 3), 4, "layers 0, 1, 3 of 4", "layers 0, 1, 3 of 4 (dense MLP in 2)",
     "MoE in layers 0, 1, 3 of 4; layer 2 keeps the dense MLP"),
    ((0, 1), 2, "all 2 layers", "all 2 layers", "MoE in all 2 layers"),
])
def test_where_the_experts_are_is_worded_one_way(moe, n, said, row, sentence):
    assert (moe_layers_said(moe, n), moe_layers_row(moe, n), moe_and_dense_said(moe, n)) == (said, row, sentence)
