"""The standard streams a command is started with: closed, unable to encode the text, zero columns wide.

Each once ended in a traceback or in silence after the work was done (`__main__.standard_streams`)."""

from __future__ import annotations

import subprocess

from failure_checks import module_cmd, module_env


def _run(shell: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    """`shell` with MOE standing for ``python -m moe_upcycle``, run by bash in `tmp_path`."""
    command = shell.replace("MOE", " ".join(module_cmd()))
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**module_env(), **env}, check=False)


def _recipe(stories, tmp_path, name: str = "coder") -> None:
    (tmp_path / "r.yaml").write_text(f"base_model: {stories}\ngate_mode: random\nexperts_per_token: 1\nexperts:\n"
                                     f"  - source_model: {stories}\n    name: {name}\n"
                                     f"  - source_model: {stories}\n", encoding="utf-8")


def test_closed_stdout_or_stderr_is_not_a_failure(stories, tmp_path):
    """`>&-` / `2>&-` (cron, daemons): before, the build finished and then exited 1 with three tracebacks from
    flushing a stream that was None."""
    _recipe(stories, tmp_path)
    run = _run("MOE build r.yaml out1 >&-", tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    run = _run("MOE build r.yaml out2 2>&-; echo rc=$?", tmp_path)
    assert run.stdout.strip().endswith("rc=0") and "Built" in run.stdout, run.stdout
    for out in ("out1", "out2"):
        assert sorted(p.name for p in (tmp_path / out).iterdir() if p.suffix == ".safetensors") == [
            "model-00001-of-00001.safetensors"]


def test_text_the_stream_cannot_encode_is_escaped(stories, tmp_path):
    """PYTHONIOENCODING=ascii: an expert named in Greek, and the tool's own Δ, were UnicodeEncodeError tracebacks."""
    _recipe(stories, tmp_path, name="λόγος")
    run = _run("MOE plan r.yaml", tmp_path, PYTHONIOENCODING="ascii")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "\\u03bb\\u03cc\\u03b3\\u03bf\\u03c2" in run.stdout  # λόγος, escaped


def test_zero_columns_still_prints_the_message(tmp_path):
    """COLUMNS=0 made rich print every message in zero columns: exit 1 and no word of why."""
    run = _run("MOE build missing.yaml out", tmp_path, COLUMNS="0")
    assert run.returncode == 1
    assert "config error: missing.yaml: config file not found" in " ".join(run.stderr.split()), run.stderr
