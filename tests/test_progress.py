"""Progress on every long stage: plain lines when piped, rich bars on a terminal, nothing with -q."""

from __future__ import annotations

import io
import re
import time
import warnings

import pytest
from rich.console import Console
from typer.testing import CliRunner

from moe_upcycle.terminal import progress
from moe_upcycle.cli import app
from moe_upcycle.terminal.progress import LineReporter, RichReporter, Stage, describe, reporting, stage

runner = CliRunner()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_line_reporter_is_silent_for_short_stages_and_regular_for_long_ones():
    lines: list[str] = []
    clock = Clock()
    reporter = LineReporter(lambda text, **_: lines.append(text), interval=5.0, first=2.0, clock=clock)
    with reporting(reporter):
        with stage("plan", total=1) as st:
            clock.now += 0.5
            st.advance()
        assert lines == []  # under two seconds: no line at all
        with stage("write", total=4e9, unit="bytes") as st:
            for _ in range(8):  # 8 chunks of 0.5 GB, one every 1.5 s
                clock.now += 1.5
                st.advance(0.5e9, note="model-00001-of-00002.safetensors")
    assert lines == [
        # first line once 2 s have passed (t=3.0), then every 5 s (t=9.0), then the end (t=12.0)
        "write: 1.0 GB of 4.0 GB (25%), 333.3 MB/s, about 9s left — model-00001-of-00002.safetensors",
        "write: 3.0 GB of 4.0 GB (75%), 333.3 MB/s, about 3s left — model-00001-of-00002.safetensors",
        "write: done 4.0 GB in 12s — model-00001-of-00002.safetensors",
    ]


def test_describe_counts_units_and_unknown_totals():
    st = Stage("router inputs", 480, "prompts×layers", progress.Reporter(), completed=120, started=0.0)
    assert describe(st, now=4.0) == "router inputs: 120 of 480 prompts×layers (25%), 30.0 prompts×layers/s, about 12s left"
    st = Stage("load base model", None, "steps", progress.Reporter(), started=0.0, note="/m")
    assert describe(st, now=7.0) == "load base model: running for 7s — /m"


def test_rich_reporter_shows_bytes_of_total_not_question_marks():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100, color_system=None)
    with reporting(RichReporter(console)):
        with stage("write", total=2_000_000, unit="bytes") as st:
            st.advance(2_000_000, note="model.norm.weight")
    text = buffer.getvalue()
    assert "0 B/2.0 MB" in text and "2.0 MB/2.0 MB" in text and "model.norm.weight" in text
    assert "/?" not in text


@pytest.mark.parametrize("reporter", ["rich", "lines"])
def test_paths_in_notes_are_printed_as_written(reporter):
    """A note names a path or a tensor: on a terminal, a "[/]" in it was a MarkupError traceback from the
    progress display (a build from such a folder crashed), and an escape sequence reached the terminal."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120, color_system=None)
    clock = Clock()
    shown = RichReporter(console) if reporter == "rich" else LineReporter(console.print, interval=0, first=0,
                                                                          clock=clock)
    with reporting(shown):
        with stage("load [/]base\x07", total=2, note="/data/o[/]x\x1b[2J") as st:
            clock.now += 1
            st.advance(1)
            clock.now += 1
            st.advance(1)
    text = buffer.getvalue()
    assert "load [/]base\\x07" in text and "/data/o[/]x\\x1b[2J" in text, text
    assert "\x1b[2J" not in text and "\x07" not in text, text


def test_no_reporter_means_no_output(capsys):
    with stage("write", total=10, unit="bytes") as st:
        st.advance(10)
    assert capsys.readouterr() == ("", "")


def test_staged_function_advances_its_stage():
    seen: list[tuple[float, str]] = []

    class Record(progress.Reporter):
        def changed(self, st):
            seen.append((st.completed, st.note))

    @progress.staged("check", total=2)
    def check():
        progress.advance("check", note="files")
        progress.advance("check", note="model")

    with reporting(Record()):
        check()
    progress.advance("check")  # outside the stage: nothing happens
    assert seen == [(1, "files"), (2, "model")]


@pytest.fixture
def every_change(monkeypatch):
    monkeypatch.setenv("MOE_UPCYCLE_PROGRESS_SECONDS", "0")


def _stages(stderr: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in stderr.splitlines():
        m = re.match(r"([a-z -]+): (.*)", line)
        if m:
            found.setdefault(m.group(1), []).append(m.group(2))
    return found


def test_piped_build_prints_a_line_per_stage_with_bytes_of_total(tiny_llama, write_yaml, tmp_path, every_change):
    config = write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random"})
    result = runner.invoke(app, ["build", str(config), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    stages = _stages(result.stderr)
    assert {"read headers", "plan", "gates", "write"} <= set(stages)
    total = re.search(r"of ([\d.]+ [kMG]?B) \(", stages["write"][0]).group(1)
    assert all(f"of {total} (" in line for line in stages["write"][:-1])
    assert stages["write"][-1].startswith(f"done {total} in ")
    assert "?" not in "".join(stages["write"])
    assert "Built" in result.stdout


def test_quiet_build_prints_no_progress(tiny_llama, write_yaml, tmp_path, every_change):
    config = write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random"})
    result = runner.invoke(app, ["-q", "build", str(config), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert result.stdout.startswith("Built ")


def test_hidden_gates_report_prompts_times_layers(stories, write_yaml, tmp_path, every_change):
    config = write_yaml({"base_model": str(stories), "gate_mode": "hidden", "device": "cpu", "batch_size": 2,
                         "experts": [{"source_model": str(stories), "positive_prompts": ["Lily saw a cat.", "The dog ran."]},
                                     {"source_model": str(stories), "positive_prompts": ["Tom ate cake."]}]})
    result = runner.invoke(app, ["build", "--no-lint", str(config), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    stages = _stages(result.stderr)
    assert "open base model" in stages and "load base model" not in stages  # streamed: its weights never load whole
    # 3 prompts x 5 layers of stories260K, advanced per batch (2 prompts, then 1) and layer
    assert stages["router inputs"][-1].startswith("done 15 prompts×layers in ")
    assert "15 of 15 prompts×layers (100%)" in stages["router inputs"][-2]


def test_kmeans_reports_runs_per_layer(stories, write_yaml, tmp_path, every_change):
    text = tmp_path / "calibration.txt"
    text.write_text("Lily went to the park with her mom. They saw a big red ball.\n\n"
                    "Tom had a little dog. The dog liked to run and play in the sun.\n", encoding="utf-8")
    config = write_yaml({"base_model": str(stories), "num_experts": 2, "gate_mode": "kmeans", "device": "cpu",
                         "calibration_text": str(text)})
    result = runner.invoke(app, ["build", str(config), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    kmeans = _stages(result.stderr)["k-means"]
    assert kmeans[-1].startswith("done 20 runs in ")  # 5 layers x 4 restarts
    assert re.search(r"20 of 20 runs \(100%\).* — layer 4: \d+ iterations, \d+ tokens", kmeans[-2])


def test_verify_reports_its_steps_and_hash_bytes(tiny_llama, write_yaml, tmp_path, every_change):
    config = write_yaml({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"})
    assert runner.invoke(app, ["-q", "build", str(config), str(tmp_path / "moe")]).exit_code == 0
    result = runner.invoke(app, ["verify", str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    stages = _stages(result.stderr)
    assert stages["verify"][-1].startswith("done 5 steps in ")
    assert any("of 5 steps" in line and "loading the MoE with transformers" in line for line in stages["verify"])
    assert stages["hash"][-1].startswith("done ")


def test_library_noise_is_silenced_inside_commands_only():
    from moe_upcycle.terminal.quiet import libraries_quiet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with libraries_quiet():
            warnings.warn("Initializing zero-element tensors is a no-op", UserWarning)
            warnings.warn("something else", UserWarning)
        warnings.warn("Initializing zero-element tensors is a no-op", UserWarning)
    assert [str(w.message) for w in caught] == ["something else", "Initializing zero-element tensors is a no-op"]


def test_transformers_bars_are_off_inside_and_restored():
    from transformers.utils import logging as tf_logging

    from moe_upcycle.terminal.quiet import libraries_quiet

    tf_logging.enable_progress_bar()
    with libraries_quiet():
        assert not tf_logging.is_progress_bar_enabled()
    assert tf_logging.is_progress_bar_enabled()


def test_qwen_build_output_holds_only_our_lines(tiny_qwen2, write_yaml, tmp_path):
    """transformers' "Loading weights" bars and torch's zero-element warning (drift check of a
    qwen2_moe without shared expert) do not reach the user."""
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as tf_logging

    tf_logging.enable_progress_bar()
    enable_progress_bars()
    config = write_yaml({"base_model": str(tiny_qwen2), "num_experts": 4, "gate_mode": "random",
                         "architecture": "qwen2_moe", "expert_init": {"method": "drop", "ratio": 0.5}})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        result = runner.invoke(app, ["build", str(config), str(tmp_path / "moe")])
    assert result.exit_code == 0, result.output
    assert "init drift from the dense model" in result.stdout  # the drift check did load both models
    for noise in ("Loading weights", "zero-element", "UserWarning", "it/s"):
        assert noise not in result.stderr


def test_heartbeat_reports_a_silent_stage():
    lines: list[str] = []
    reporter = LineReporter(lambda text, **_: lines.append(text), interval=0.2, first=0.2, heartbeat=True)
    with reporting(reporter):
        with stage("load embedder", note="all-MiniLM-L6-v2"):
            time.sleep(0.9)  # never advances, like loading a model
    running = [line for line in lines if line.startswith("load embedder: running for ")]
    assert len(running) >= 2 and all(line.endswith(" — all-MiniLM-L6-v2") for line in running)
    assert re.fullmatch(r"load embedder: done in \d+s — all-MiniLM-L6-v2", lines[-1])


def _screens(text: str) -> list[str]:
    """The lines a terminal shows of a rich live display: each redraw's lines, without cursor codes."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", text.replace("\r", "\n"))
    return [line for line in plain.splitlines() if line.strip()]


def test_time_left_is_never_cut_at_80_columns():
    """At 80 columns a stage counted in prompts×layers pushed the time-left column down to ``0:0…``."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=80, color_system=None)
    with reporting(RichReporter(console)):
        with stage("gates", total=30, unit="layers"):
            with stage("router inputs", total=48_000, unit="prompts×layers", note="batch 3 of 40") as st:
                for _ in range(4):
                    time.sleep(0.2)
                    st.advance(1000)
    rows = [line for line in _screens(buffer.getvalue()) if line.startswith("router inputs")]
    assert rows and all(len(line) <= 80 for line in rows)
    assert all(re.search(r" \d+:\d\d:\d\d |-:--:--", line) for line in rows), rows
    assert any("4,000/48,000 prompts×layers" in line for line in rows)


def test_an_interrupted_stage_keeps_its_bar_where_it_stopped():
    """After Ctrl-C the gates bar jumped to full (30/30 layers) as if the stage had finished."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100, color_system=None)
    with pytest.raises(KeyboardInterrupt), reporting(RichReporter(console)):
        with stage("gates", total=30, unit="layers"):  # the gates advance once, at the end: 0 until then
            raise KeyboardInterrupt
    last = [line for line in _screens(buffer.getvalue()) if line.startswith("gates")][-1]
    assert "0/30 layers" in last and "30/30" not in last
    unknown = io.StringIO()  # no total: the count stays what it was, not "1/1"
    with pytest.raises(KeyboardInterrupt), reporting(RichReporter(Console(file=unknown, force_terminal=True,
                                                                          width=100, color_system=None))):
        with stage("load base model"):
            raise KeyboardInterrupt
    assert "1/1" not in unknown.getvalue() and "stopped" in _screens(unknown.getvalue())[-1]


def test_piped_a_parent_stage_speaks_only_when_it_changes():
    """Piped, `gates: 0 of 30 layers (0%)` came every interval while its router inputs advanced beneath it."""
    lines: list[str] = []
    reporter = LineReporter(lambda text, **_: lines.append(text), interval=0.1, first=0.1, heartbeat=True)
    with reporting(reporter):
        with stage("gates", total=30, unit="layers") as gates:
            with stage("router inputs", total=100, unit="prompts×layers") as st:
                for _ in range(10):
                    time.sleep(0.1)
                    st.advance(10)
            after = time.monotonic()
            time.sleep(0.35)  # the child is done: the parent, now innermost, has a heartbeat again
            after = time.monotonic() - after
            gates.advance(30)
    parent = [line for line in lines if line.startswith("gates:")]
    first_child = next(i for i, line in enumerate(lines) if line.startswith("router inputs:"))
    child_done = next(i for i, line in enumerate(lines) if line.startswith("router inputs: done"))
    assert sum(line.startswith("gates:") for line in lines[:first_child]) <= 1, lines  # before its child began
    assert not any(line.startswith("gates:") for line in lines[first_child:child_done]), lines  # silent beneath it
    # after the child: a heartbeat at most once an interval (the wait, timed, however slow a loaded machine makes it)
    assert sum(line.startswith("gates: 0 of 30 layers") for line in lines[child_done:]) <= after / 0.1 + 1, lines
    assert parent[-1].startswith("gates: done 30 layers in ")
    assert len([line for line in lines if line.startswith("router inputs:")]) >= 5
