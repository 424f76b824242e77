"""Helpers for the robustness tests: run the CLI (in-process or as a real subprocess) and check
that a failed build left nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from moe_upcycle.cli import app

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> tuple[int, str]:
    """Run ``moe-upcycle ARGS`` in-process; return (exit code, stdout+stderr)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def module_env() -> dict:
    """Environment for ``python -m moe_upcycle`` that imports this worktree's package."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("COLUMNS", None)
    return env


def module_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_upcycle", *[str(a) for a in args]]


def run_module(*args: str, timeout: float = 120) -> tuple[int, str]:
    """Run ``python -m moe_upcycle ARGS`` as a subprocess; return (exit code, stdout+stderr)."""
    proc = subprocess.run(module_cmd(*args), cwd=REPO, env=module_env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def leftovers(target: Path) -> list[str]:
    """Names beside `target` that a build makes: the target itself, its lock, staging and swap folders."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    return sorted(p.name for p in target.parent.iterdir()
                  if p.name == target.name or p.name.startswith(f".{target.name}."))


def assert_clean_failure(code: int, output: str, target: Path, words: list[str], expected_code: int = 1) -> None:
    """The build failed with `expected_code`, said every word in `words`, printed no traceback, wrote nothing."""
    assert code == expected_code, f"exit code {code}, output:\n{output}"
    flat = " ".join(output.split())  # rich may wrap long paths
    for word in words:
        assert word in flat, f"{word!r} not in:\n{output}"
    assert "Traceback" not in output, output
    assert leftovers(target) == [], f"left behind: {leftovers(target)}"


def previous_build(folder: Path, files: dict[str, str]) -> Path:
    """A stand-in for an earlier build's output: `files` plus a manifest recording their sha256."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    digests = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}
    (folder / "moe_upcycle.json").write_text(json.dumps({"tool": "moe-upcycle", "sha256": digests}))
    return folder
