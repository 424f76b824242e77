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


TF4_UPCYCLE_MODEL = r"""
import warnings, torch
torch.manual_seed(0)  # the random models below are the same in every run
from transformers import AutoModelForCausalLM, Qwen2Config
from moe_upcycle import upcycle_model
from moe_upcycle.errors import ConfigError
small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)
try:
    upcycle_model(AutoModelForCausalLM.from_config(Qwen2Config(**small, head_dim=32)), num_experts=2)
except ConfigError as exc:
    print("REFUSED", exc)
dense = AutoModelForCausalLM.from_config(Qwen2Config(**small, use_sliding_window=True, sliding_window=4,
                                                     max_window_layers=1))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    upcycle_model(dense, num_experts=2)
print("WARNED", [str(w.message) for w in caught if w.category.__name__ == "UpcycleWarning"])
from transformers import LlamaConfig
moe = upcycle_model(AutoModelForCausalLM.from_config(LlamaConfig(**small)), num_experts=2,
                    output_router_logits=True).eval()
ids = torch.tensor([[1, 5, 9, 3, 7]])
steps = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)  # decoding steps past the first: no early eos
try:
    moe.generate(ids, **steps)
except RuntimeError as exc:
    print("GENERATE FAILS", str(exc).splitlines()[0])
print("WORKAROUND", moe.generate(ids, **steps, output_router_logits=False).shape[1])
"""


def test_upcycle_model_says_what_the_installed_transformers_4_cannot_run(tmp_path):
    """In memory the installed transformers is the runtime: its Qwen2-MoE refuses a head_dim other than
    hidden/heads (before: its own "hidden_size must be divisible by num_heads (64 and 4)") and slides every layer
    (before: silently other logits than the dense model's)."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO),
           "HOME": str(tmp_path)}
    run = subprocess.run([str(TF4_PYTHON), "-c", TF4_UPCYCLE_MODEL], capture_output=True, text=True, timeout=600,
                         env=env, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ("REFUSED architecture: qwen2_moe cannot hold this dense model in transformers 4.57" in run.stdout
            and "its Qwen2-MoE needs head_dim = hidden_size / num_attention_heads (16), not 32; install "
                "transformers>=5, or pass another architecture=" in run.stdout), run.stdout
    assert ("Qwen2MoeForCausalLM run this MoE, but not as the dense model computes: its Qwen2-MoE applies "
            "sliding_window to every layer" in run.stdout), run.stdout
    # the README's advice for 4.57: a model saved with output_router_logits=True generates with it turned off
    assert "GENERATE FAILS The size of tensor a" in run.stdout and "WORKAROUND 8" in run.stdout, run.stdout
