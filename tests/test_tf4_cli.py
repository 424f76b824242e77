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
import sys
moe = upcycle_model(AutoModelForCausalLM.from_config(LlamaConfig(**small)), num_experts=2, output_router_logits=True)
ids = torch.tensor([[1, 5, 9, 3, 7]])
out = moe(input_ids=ids, labels=ids)  # a training call: router logits and the aux loss
print("TRAINING AUX", out.aux_loss is not None, "CONFIG", moe.config.output_router_logits)
moe.eval()
steps = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)  # decoding steps past the first: no early eos
print("GENERATES", moe.generate(ids, **steps).shape[1])
moe.save_pretrained(sys.argv[1])
reloaded = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
padded = torch.tensor([[1, 5, 9, 3, 7], [0, 0, 1, 5, 9]])
print("RELOADED PADDED", tuple(reloaded.generate(padded, attention_mask=(padded != 0).long(), pad_token_id=0,
                                                 **steps).shape))
flagged = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_router_logits=True).eval()
try:
    flagged.generate(ids, **steps)
except RuntimeError as exc:
    print("FLAG IN CONFIG FAILS", str(exc).splitlines()[0])
"""


def test_upcycle_model_says_what_the_installed_transformers_4_cannot_run(tmp_path):
    """In memory the installed transformers is the runtime: its Qwen2-MoE refuses a head_dim other than
    hidden/heads (before: its own "hidden_size must be divisible by num_heads (64 and 4)") and slides every layer
    (before: silently other logits than the dense model's)."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO),
           "HOME": str(tmp_path)}
    run = subprocess.run([str(TF4_PYTHON), "-c", TF4_UPCYCLE_MODEL, str(tmp_path / "saved")], capture_output=True,
                         text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert ("REFUSED architecture: qwen2_moe cannot hold this dense model in transformers 4.57" in run.stdout
            and "its Qwen2-MoE needs head_dim = hidden_size / num_attention_heads (16), not 32; install "
                "transformers>=5, or pass another architecture=" in run.stdout), run.stdout
    assert ("Qwen2MoeForCausalLM run this MoE, but not as the dense model computes: its Qwen2-MoE applies "
            "sliding_window to every layer" in run.stdout), run.stdout
    # output_router_logits=True reaches the training calls only: the model generates in memory and saved, padded
    # batches too; the same folder with the flag in its config fails on one prompt in 4.57 (why it is not saved)
    assert "TRAINING AUX True CONFIG False" in run.stdout and "GENERATES 8" in run.stdout, run.stdout
    assert "RELOADED PADDED (2, 8)" in run.stdout, run.stdout
    assert "FLAG IN CONFIG FAILS The size of tensor a" in run.stdout, run.stdout
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["output_router_logits"] is False


TF4_README_RECIPE = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from moe_upcycle import upcycle_model
tok = AutoTokenizer.from_pretrained(sys.argv[1])
moe = upcycle_model(AutoModelForCausalLM.from_pretrained(sys.argv[1]), num_experts=4, experts_per_token=2,
                    gate="random", router_aux_loss_coef=0.01, output_router_logits=True, dtype="float32")
opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
for text in ["Once upon a time, there was a little girl", "The dog ran to the park and"]:
    batch = tok(text, return_tensors="pt")
    out = moe(**batch, labels=batch["input_ids"])
    assert out.aux_loss is not None
    out.loss.backward(); opt.step(); opt.zero_grad()
moe.save_pretrained(sys.argv[2]); tok.save_pretrained(sys.argv[2])
"""


def test_readme_training_recipe_publishes_a_model_verify_passes_in_transformers_4(stories, tmp_path):
    """The README recipe in transformers 4.57: trained with router logits, saved, and `verify` (which generates a
    padded batch) passes; before, 4.57 could not generate with the saved model at all."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO),
           "HOME": str(tmp_path)}
    folder = tmp_path / "my-moe-trained"
    run = subprocess.run([str(TF4_PYTHON), "-c", TF4_README_RECIPE, str(stories), str(folder)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads((folder / "config.json").read_text())["output_router_logits"] is False
    checked = tf4_cli("verify", folder, "--base", stories, "--max-new-tokens", "4", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "PASSED" in checked.stdout
