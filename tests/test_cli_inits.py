"""CLI: plan shows split shapes and exactness; build prints the init drift; bad init exits 1 naming the field."""

from __future__ import annotations

from typer.testing import CliRunner

from moe_upcycle.cli import app

runner = CliRunner()


def test_plan_shows_split_shapes_and_exactness(tiny_llama, write_yaml):
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 8, "experts_per_token": 3, "gate_mode": "random",
                      "expert_init": {"method": "split", "granularity": 2}})
    result = runner.invoke(app, ["plan", str(cfg)])
    assert result.exit_code == 0, result.output
    assert "64x64" in result.output  # w1/w3 (I/G, H) = (64, 64)
    text = " ".join(result.output.split())
    assert "8 experts of intermediate size 64 (dense 128 / granularity 2)" in text
    assert "NOT function-preserving at init: experts_per_token 3 is not a multiple of granularity 2" in text


def test_build_prints_init_drift(tiny_llama, write_yaml, tmp_path):
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random",
                      "expert_init": {"method": "drop", "ratio": 0.25}})
    result = runner.invoke(app, ["build", str(cfg), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    assert "init drift from the dense model: mean KL" in result.output and "top-1 agreement" in result.output


def test_bad_expert_init_exits_1_and_names_the_field(tiny_llama, write_yaml, tmp_path):
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "expert_init": {"method": "drop", "ratoi": 0.2}})
    result = runner.invoke(app, ["build", str(cfg), str(tmp_path / "moe")])
    assert result.exit_code == 1
    assert "expert_init.ratoi: unknown key — did you mean ratio?" in " ".join(result.output.split())
    assert not (tmp_path / "moe").exists()
