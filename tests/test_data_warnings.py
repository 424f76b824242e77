"""NaN/Inf in source weights and mixed dtypes across sources: the build goes on, with a warning
naming the tensor (and the CLI prints it), and the documented cast."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from failure_checks import cli
from moe_upcycle import UpcycleWarning, upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model

UP = "model.layers.0.mlp.up_proj.weight"


def _poison(src: Path, dst: Path, key: str, values: dict[tuple[int, int], float]) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for (i, j), v in values.items():
        state[key][i, j] = v
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _build(base: Path, out: Path, **extra):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = upcycle({"base_model": str(base), "num_experts": 3, "gate_mode": "random", **extra}, out)
    return result, [str(w.message) for w in caught if issubclass(w.category, UpcycleWarning)]


def test_nan_inf_warned_once_naming_tensor(tiny_llama, tmp_path):
    model = _poison(tiny_llama, tmp_path / "m", UP, {(0, 0): float("nan"), (1, 1): float("inf"), (2, 2): float("-inf")})
    result, warned = _build(model, tmp_path / "moe")
    # read once, placed in 3 expert slots: one warning, with the file, the tensor and the counts
    assert warned == [f"{model}/model.safetensors: tensor '{UP}' holds 1 NaN and 2 Inf value(s) out of 8192; "
                      f"they are copied into the output unchanged — check the source checkpoint"]
    with safe_open(str(result.output / result.shards[0]), "pt") as f:
        w3 = f.get_tensor("model.layers.0.block_sparse_moe.experts.2.w3.weight")
    assert torch.isnan(w3[0, 0]) and torch.isinf(w3[1, 1]) and int(torch.isfinite(w3).sum()) == 8192 - 3


def test_clean_model_gives_no_warning(tiny_llama, tmp_path):
    assert _build(tiny_llama, tmp_path / "moe")[1] == []


def test_overflow_in_cast_is_named(tiny_llama, tmp_path):
    model = _poison(tiny_llama, tmp_path / "m", UP, {(3, 4): 1e6, (5, 6): -7e4})
    _, warned = _build(model, tmp_path / "moe", dtype="float16")
    assert warned == [f"{model}/model.safetensors: tensor '{UP}' has 2 value(s) beyond the range of float16 that "
                      f"become Inf in the cast from float32; set dtype: bfloat16 or float32"]


def test_cli_prints_nan_warning_and_succeeds(tiny_llama, tmp_path):
    model = _poison(tiny_llama, tmp_path / "m", UP, {(0, 0): float("nan")})
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"base_model: {model}\nnum_experts: 2\ngate_mode: random\n")
    code, output = cli("build", cfg, tmp_path / "moe")
    assert code == 0, output
    assert f"warning: {model}/model.safetensors: tensor '{UP}' holds 1 NaN and 0 Inf" in " ".join(output.split())


@pytest.fixture(scope="module")
def bf16_finetune(tmp_path_factory, tiny_llama) -> Path:
    """The tiny Llama's weights stored in bfloat16 (a same-shape 'fine-tune' in another dtype)."""
    return make_dense_model(tmp_path_factory.mktemp("bf16") / "llama", family="llama", seed=0, dtype=torch.bfloat16)


def test_mixed_dtypes_cast_to_output_dtype_with_warning(tiny_llama, bf16_finetune, tmp_path):
    cfg = {"base_model": str(tiny_llama), "gate_mode": "random",
           "experts": [{"source_model": str(tiny_llama)}, {"source_model": str(bf16_finetune)}]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = upcycle(cfg, tmp_path / "moe")
    warned = [str(w.message) for w in caught if issubclass(w.category, UpcycleWarning)]
    assert len(warned) == 1
    assert warned[0].startswith("the sources store different dtypes (")
    assert f"{tiny_llama}: 21 float32 tensor(s)" in warned[0] and f"{bf16_finetune}: 6 bfloat16 tensor(s)" in warned[0]
    assert warned[0].endswith("every tensor is cast to float32, the output dtype — set dtype: in the config to choose another")
    cfg_out = json.loads((result.output / "config.json").read_text())
    assert cfg_out["dtype"] == "float32"
    with safe_open(str(result.output / result.shards[0]), "pt") as f:
        w1 = f.get_tensor("model.layers.1.block_sparse_moe.experts.1.w1.weight")
    dense = load_file(str(bf16_finetune / "model.safetensors"))["model.layers.1.mlp.gate_proj.weight"]
    assert w1.dtype == torch.float32 and torch.equal(w1, dense.float())  # bf16 -> fp32 is exact


def test_mixed_dtypes_warning_in_cli(tiny_llama, bf16_finetune, tmp_path):
    cfg = tmp_path / "e.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\ngate_mode: random\ndtype: bfloat16\nexperts:\n"
                   f"  - source_model: {tiny_llama}\n  - source_model: {bf16_finetune}\n")
    code, output = cli("build", cfg, tmp_path / "moe")
    flat = " ".join(output.split())
    assert code == 0, output
    assert "warning: the sources store different dtypes" in flat and "every tensor is cast to bfloat16" in flat
