"""Expert inits and the storage policy against formulas written here, on a source whose matrices are far from
zero-mean (a zero-mean source cannot tell "re-drawn around the mean" from "re-drawn around 0") and in bf16 as
well as fp32 (the transforms run in fp32 and round once to the output dtype)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model

W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
SHIFT = {"gate_proj": 0.5, "up_proj": -0.75, "down_proj": 1.25}  # a mean far from 0, different per matrix


@pytest.fixture(scope="module")
def shifted(tmp_path_factory) -> Path:
    """A tiny Llama (intermediate 128) whose FFN matrices have means of several standard deviations."""
    folder = make_dense_model(tmp_path_factory.mktemp("shifted") / "llama", family="llama", seed=3)
    tensors = load_file(str(folder / "model.safetensors"))
    for key in tensors:
        for proj, shift in SHIFT.items():
            if key.endswith(f"mlp.{proj}.weight"):
                tensors[key] = tensors[key] + shift
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _read(folder: Path, key: str) -> torch.Tensor:
    index = folder / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][key] if index.is_file() else "model.safetensors"
    with safe_open(str(folder / shard), "pt") as f:
        return f.get_tensor(key)


def _build(base: Path, out: Path, init: dict, dtype: str = "float32", **extra):
    return upcycle({"base_model": str(base), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                    "expert_init": init, "dtype": dtype, "report_init_drift": False, "seed": 5, **extra}, out).output


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drop_redraws_around_the_source_matrix_mean_and_std(shifted, tmp_path, dtype):
    out = _build(shifted, tmp_path / "moe", {"method": "drop", "ratio": 0.5}, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    for proj, shift in SHIFT.items():
        src = _read(shifted, f"model.layers.1.mlp.{proj}.weight")  # fp32 (I, H) or (H, I) for down
        got = _read(out, f"model.layers.1.block_sparse_moe.experts.2.{W[proj]}.weight").float()
        axis = 0 if proj == "down_proj" else 1  # neurons are columns of down, rows of gate/up
        differs = (got != src.to(torch_dtype).float()).any(dim=axis)
        assert int(differs.sum()) == 64  # round_half_up(0.5 * 128)
        fresh = got[:, differs] if proj == "down_proj" else got[differs]
        n = fresh.numel()
        mean, std = float(src.mean()), float(src.std())
        assert abs(mean - shift) < 0.2 * abs(shift)  # the source really is far from zero-mean
        # N(mean, std^2) draws: the sample mean is within 5 standard errors, the sample std within 5 %
        assert abs(float(fresh.mean()) - mean) < 5 * std / n ** 0.5, (proj, float(fresh.mean()), mean)
        assert abs(float(fresh.std()) / std - 1) < 0.05, (proj, float(fresh.std()), std)


def test_drop_gate_up_and_down_drop_the_same_neurons(shifted, tmp_path):
    out = _build(shifted, tmp_path / "moe", {"method": "drop", "ratio": 0.25})
    for layer in (0, 1):
        for e in range(4):
            sets = {}
            for proj in SHIFT:
                src = _read(shifted, f"model.layers.{layer}.mlp.{proj}.weight")
                got = _read(out, f"model.layers.{layer}.block_sparse_moe.experts.{e}.{W[proj]}.weight")
                axis = 0 if proj == "down_proj" else 1
                sets[proj] = torch.nonzero((got != src).any(dim=axis)).flatten().tolist()
            assert len(sets["gate_proj"]) == 32  # round_half_up(0.25 * 128)
            assert sets["gate_proj"] == sets["up_proj"] == sets["down_proj"], (layer, e)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_relative_noise_has_scale_times_each_matrix_std(shifted, tmp_path, dtype):
    scale = 0.05
    out = _build(shifted, tmp_path / "moe", {"method": "noise", "scale": scale}, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    for proj in SHIFT:
        src = _read(shifted, f"model.layers.0.mlp.{proj}.weight")
        for e in range(4):
            got = _read(out, f"model.layers.0.block_sparse_moe.experts.{e}.{W[proj]}.weight")
            assert got.dtype == torch_dtype
            delta = got.float() - src  # noise plus the output dtype's rounding of src + noise
            sigma = scale * float(src.std())
            # the output dtype rounds src + noise once: that rounding's spread, simulated here with draws of our own
            z = src + torch.randn(src.shape, generator=torch.Generator().manual_seed(e)) * sigma
            rounding = float((z.to(torch_dtype).float() - z).std())
            expected = (sigma ** 2 + rounding ** 2) ** 0.5
            assert abs(float(delta.std()) / expected - 1) < 0.06, (proj, e, float(delta.std()), expected)
            assert abs(float(delta.mean())) < 5 * expected / delta.numel() ** 0.5


def _slot_storages(base: Path, policy: str) -> dict[str, list[int]]:
    """data_ptr of every expert slot the executor yields, grouped by the dense tensor it copies."""
    from moe_upcycle.build import prepare
    from moe_upcycle.planning.execute import iter_tensors

    config, sources, plan = prepare({"base_model": str(base), "num_experts": 4, "experts_per_token": 2,
                                     "gate_mode": "uniform", "tensor_policy": policy})
    try:
        gates = {layer: torch.zeros(4, 64) for layer in plan.moe_layers}
        ptrs: dict[str, list[int]] = {}
        alive = []  # held, so that a freed slot's memory is not handed to the next one (same data_ptr)
        for step, tensor in iter_tensors(plan, sources, gates, policy=policy):
            if step.kind == "expert":
                alive.append(tensor)
                ptrs.setdefault(step.source[1], []).append(tensor.untyped_storage().data_ptr())
        return ptrs
    finally:
        for source in sources.values():
            close = getattr(source, "close", None)
            if close:
                close()


def test_clone_policy_gives_every_slot_its_own_storage_and_share_one(shifted):
    cloned = _slot_storages(shifted, "clone")
    shared = _slot_storages(shifted, "share")
    assert set(cloned) == set(shared) and len(cloned) == 2 * 3  # 2 layers x gate/up/down
    for name in cloned:
        assert len(cloned[name]) == 4 and len(set(cloned[name])) == 4, name  # four slots, four storages
        assert len(shared[name]) == 4 and len(set(shared[name])) == 1, name  # four slots, one storage
