"""The README's quick start, run line by line as a user would, prints no error and no stray warning.

Nothing is downloaded: the hub model the quick start names is stood in for by the vendored
stories260K, put into a Hugging Face cache under that hub id (what ``hf download`` leaves behind);
the ``hf download`` lines themselves are the only ones not run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STORIES = Path(__file__).resolve().parent / "data" / "stories260K"
NOISE = ("Traceback", "Warning", "warning:", "error", "Loading weights", "it/s]")


def quick_start() -> tuple[str, list[str]]:
    """The quick start's YAML and its command lines (comments stripped)."""
    section = ROOT.joinpath("README.md").read_text(encoding="utf-8").split("## Quick start", 1)[1].split("\n## ", 1)[0]
    config = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in commands.splitlines() if line.strip()]
    return config, lines


def test_readme_quick_start_runs_clean(tmp_path):
    config, lines = quick_start()
    data = yaml.safe_load(config)
    assert [shlex.split(line)[0] for line in lines] == ["hf", "moe-upcycle", "moe-upcycle", "moe-upcycle"]
    repo = tmp_path / "hf_cache" / f"models--{data['base_model'].replace('/', '--')}"
    shutil.copytree(STORIES, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    work = tmp_path / "work"
    work.mkdir()
    (work / "experts.yaml").write_text(config)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "80",
           "MOE_UPCYCLE_PROGRESS_SECONDS": "0"}  # a progress line for every stage, however short
    stages = set()
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "hf":
            continue  # the download: the cache above stands in for it
        run = subprocess.run([sys.executable, "-m", "moe_upcycle", *argv[1:]], cwd=work, env=env,
                             capture_output=True, text=True)
        assert run.returncode == 0, (line, run.stdout, run.stderr)
        for noise in NOISE:
            assert noise not in run.stderr, (line, run.stderr)
        assert max(map(len, run.stdout.splitlines())) <= 80, (line, run.stdout)
        stages |= {m.group(1) for m in re.finditer(r"^([a-z -]+): done ", run.stderr, re.M)}
    assert {"read headers", "plan", "gates", "write", "verify"} <= stages
    assert (work / data["output"] / "README.md").is_file()
