"""The command line under transformers 4.57 (pyproject allows transformers>=4.46), in the `.venv-tf4` that .ci/run
makes: the build's own checks load models with the installed transformers, so they must not pass 5.x-only options,
and a layout only transformers 5 reads is refused before any work."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tf4_logits import NO_TF4, REPO, TF4_PYTHON

pytestmark = pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)


def tf4_cli(*args: object, cwd: Path) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": str(REPO), "COLUMNS": "200", "HOME": str(cwd)}
    return subprocess.run([str(TF4_PYTHON), "-m", "moe_upcycle", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd, check=False)


def test_random_init_build_measures_its_drift_in_transformers_4(stories, tmp_path):
    """Before: "MixtralForCausalLM.__init__() got an unexpected keyword argument 'experts_implementation'" from the
    init-drift check, after the whole build."""
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"base_model: {stories}\nnum_experts: 2\ngate_mode: random\n"
                   f"expert_init: {{method: drop, ratio: 0.25}}\n")
    run = tf4_cli("build", cfg, tmp_path / "moe", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    manifest = json.loads((tmp_path / "moe" / "moe_upcycle.json").read_text())
    assert manifest["config"]["expert_init"]["method"] == "drop"
    said = " ".join((run.stdout + run.stderr).split())
    assert "init drift from the dense model: mean KL" in said and "top-1 agreement" in said, said


def test_demo_reruns_in_its_own_folder_in_transformers_4(tmp_path):
    """transformers 4 writes special_tokens_map.json into the demo's dense/; before, a second demo refused the
    demo's own folder ("dense/ also holds special_tokens_map.json")."""
    for _ in range(2):
        run = tf4_cli("demo", tmp_path / "demo_out", cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "MoE reproduces the dense model" in " ".join(run.stdout.split())
    assert "special_tokens_map.json" in json.loads((tmp_path / "demo_out" / "moe_upcycle.json").read_text())[
        "dense_files"]


def test_fused_layout_refused_before_any_work_in_transformers_4(stories, tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"base_model: {stories}\nnum_experts: 2\ngate_mode: random\nlayout: fused\n")
    run = tf4_cli("build", cfg, tmp_path / "moe", cwd=tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stdout + run.stderr
    said = " ".join((run.stdout + run.stderr).split())
    assert "layout: fused writes expert tensors only transformers 5 loads, and this environment has transformers 4.57" \
        in said and "use layout: per_expert" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]
