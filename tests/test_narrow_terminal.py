"""Output on an 80-column terminal: tables fit (fewer columns, or one block per row), nothing is cut."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_upcycle import upcycle
from moe_upcycle.terminal.tables import fit

ROOT = Path(__file__).resolve().parents[1]


def render(renderable, width: int) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)
    console.print(renderable)
    return console.export_text()


def wide_table() -> Table:
    table = Table(title="output tensors")
    for col in ("name", "count", "kind", "source", "params", "bytes"):
        table.add_column(col)
    for i in range(3):
        name = f"model.layers.{{layer}}.block_sparse_moe.experts.{{expert}}.w{i + 1}.weight"
        table.add_row(name, "10", "expert", name.replace("block_sparse_moe.experts.{expert}", "mlp"), "110,080",
                      "440.3 KB")
    return table


def test_fitting_table_is_kept():
    table = Table()
    table.add_column("a")
    table.add_row("1")
    assert fit(table, Console(width=80)) is table


def test_optional_columns_go_first_then_rows_become_blocks():
    table = wide_table()
    assert fit(table, Console(width=150), optional=("source", "params")) is table  # 143 columns wide
    narrowed = fit(table, Console(width=120), optional=("source", "params"))
    assert [c.header for c in narrowed.columns] == ["name", "count", "kind", "params", "bytes"]
    narrowed = fit(table, Console(width=100), optional=("source", "params"))
    assert [c.header for c in narrowed.columns] == ["name", "count", "kind", "bytes"]
    text = render(fit(table, Console(width=80), optional=("source", "params")), 80)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    assert lines[0] == "output tensors"
    assert lines[1] == "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight"
    assert lines[2] == "  count: 10   kind: expert   bytes: 440.3 KB"
    assert "…" not in text and "source:" not in text


def test_blocks_wrap_between_pairs_only():
    table = wide_table()
    text = render(fit(table, Console(width=70)), 70)
    block = text.splitlines()[1:5]
    assert block == ["model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
                     "  count: 10   kind: expert",
                     "  source: model.layers.{layer}.mlp.w1.weight   params: 110,080",
                     "  bytes: 440.3 KB"]


def _run(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "moe_upcycle", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def test_plan_and_route_fit_80_columns(tiny_llama, write_yaml, tmp_path):
    config = write_yaml({"base_model": str(tiny_llama), "num_experts": 8, "gate_mode": "random"})
    plan = _run("plan", str(config))
    assert plan.returncode == 0, plan.stderr
    assert max(map(len, plan.stdout.splitlines())) <= 80
    assert "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight" in plan.stdout  # whole, not cut
    assert "…" not in plan.stdout

    moe = upcycle(str(config), tmp_path / "moe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time there was a cat\nThe dog ran home\n")
    route = _run("route", str(moe.output), "--prompts", str(prompts), "--device", "cpu")
    assert route.returncode == 0, route.stderr
    lines = route.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    assert "Once upon a time there was a cat" in lines  # a prompt is one line, not a word per line
    for noise in ("Warning", "Loading weights", "it/s]"):  # no library warnings or loading bars
        assert noise not in route.stderr
