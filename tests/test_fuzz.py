"""Fuzzing (hypothesis): random and corrupted safetensors headers, random config YAML. Nothing may
end in anything but a clean `UpcycleError` or success — and a header we accept must also be
readable by the safetensors library, tensor by tensor (so it cannot fail later, mid-build)."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from moe_upcycle import UpcycleConfig, UpcycleError, load_config, upcycle
from moe_upcycle.checkpoint.headers import SAFETENSORS_DTYPES, read_safetensors_header

# derandomize: the same examples on every run (reproducible CI); database=None: no .hypothesis folder
FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# -- safetensors headers ------------------------------------------------------------------------

weird = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=5),
                  st.integers(-2**70, 2**70), st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
dims = st.integers(min_value=-2, max_value=6) | st.integers(min_value=2**31, max_value=2**64) | st.sampled_from([1.0, True, "3"])
dtype_names = st.sampled_from([*SAFETENSORS_DTYPES, "F8_E4M3", "Q4", "", "f32"]) | weird
entry = st.fixed_dictionaries(
    {"dtype": dtype_names, "shape": st.lists(dims, max_size=3) | weird,
     "data_offsets": st.lists(st.integers(min_value=-4, max_value=300), min_size=2, max_size=2) | st.lists(dims, max_size=3) | weird},
) | weird
headers = st.dictionaries(st.text(min_size=1, max_size=8), entry, max_size=4)
metadata = st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4) | st.integers(), max_size=2) | weird


def _consistent_entries(draw_sizes: list[tuple[str, list[int]]]) -> tuple[dict, int]:
    header, offset = {}, 0
    for name, shape in draw_sizes:
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    return header, offset


valid_like = st.lists(st.tuples(st.text(min_size=1, max_size=6), st.lists(st.integers(0, 4), max_size=2)),
                      max_size=4, unique_by=lambda t: t[0]).map(_consistent_entries)


def _write(folder: Path, header_bytes: bytes, data: bytes, length: int | None = None) -> Path:
    file = folder / "model.safetensors"
    n = len(header_bytes) if length is None else length
    file.write_bytes(struct.pack("<Q", n) + header_bytes + data)
    return file


def _check(file: Path) -> None:
    """Our reader either refuses cleanly, or accepts a file safetensors reads completely."""
    try:
        infos = read_safetensors_header(file)
    except UpcycleError as exc:
        event("refused")
        assert str(exc) and str(file) in str(exc)
        return
    event("accepted")
    with safe_open(str(file), framework="pt") as f:
        assert sorted(f.keys()) == sorted(infos)
        for key, info in infos.items():
            t = f.get_tensor(key)
            assert tuple(t.shape) == info.shape and t.dtype == info.dtype


@FUZZ
@given(header=headers, meta=metadata, data=st.binary(max_size=300), pad=st.integers(0, 3))
def test_fuzz_random_headers(header, meta, data, pad):
    if meta is not None:
        header = {**header, "__metadata__": meta}
    raw = json.dumps(header).encode() + b" " * pad
    with tempfile.TemporaryDirectory() as d:
        _check(_write(Path(d), raw, data))


@FUZZ
@given(entries=valid_like, data=st.data())
def test_fuzz_consistent_headers_then_one_lie(entries, data):
    """Start from a header that tiles its data exactly, then maybe change one number or the length."""
    header, size = entries
    body = bytes(size)
    if header and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(header)))
        field = data.draw(st.sampled_from(["shape", "data_offsets"]))
        if header[key][field]:
            i = data.draw(st.integers(0, len(header[key][field]) - 1))
            header[key][field][i] = data.draw(st.integers(-1, 2**64))
    body = body[:data.draw(st.integers(0, len(body)))] if data.draw(st.booleans()) else body
    raw = json.dumps(header).encode()
    length = data.draw(st.none() | st.integers(0, 2**64 - 1))
    with tempfile.TemporaryDirectory() as d:
        _check(_write(Path(d), raw, body, length))


@pytest.fixture(scope="module")
def small_file_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
               "c": torch.zeros(0, dtype=torch.int8)}, str(path), metadata={"format": "pt"})
    return path.read_bytes()


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255), st.sampled_from(["set", "insert", "delete"])),
                      min_size=1, max_size=4), cut=st.none() | st.integers(0, 400))
def test_fuzz_corrupted_bytes(small_file_bytes, edits, cut):
    raw = bytearray(small_file_bytes)
    for pos, value, op in edits:
        pos = min(pos, len(raw))
        if op == "set" and pos < len(raw):
            raw[pos] = value
        elif op == "insert":
            raw.insert(pos, value)
        elif op == "delete" and pos < len(raw):
            del raw[pos]
    if cut is not None:
        raw = raw[:cut]
    with tempfile.TemporaryDirectory() as d:
        file = Path(d) / "model.safetensors"
        file.write_bytes(bytes(raw))
        _check(file)


# -- config YAML --------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["5GB", "-1MB", "bf16", "fp8", "random", "uniform", "share",
                                                          "clone", "mixtral", "qwen", "  ", ""]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                      max_leaves=8)
# plausible values per key (so many configs get past the schema into plan, gates and writing), mixed with junk
PLAUSIBLE = {
    "num_experts": [1, 2, 3, 0, 2000, "2"], "experts_per_token": [1, 2, 3, 0], "seed": [0, 7, -1, 2**64],
    "gate_mode": ["random", "uniform", "uniform_random", "cheap_embed", "hidden", "kmeans", "Random"],
    "dtype": ["float32", "bf16", "float16", "fp8", None], "tensor_policy": ["share", "clone", "copy"],
    "max_shard_size": ["50KB", 1, "1B", 10**13, "0.1MB", "1 GiB", -1], "architecture": ["mixtral", "qwen", "deepseek", "gpt"],
    "router_init_std": [0.02, 0.0, 1e300, "NaN"], "gate_scale": [1.0, None, 0, "-inf"], "router_aux_loss_coef": [0.01, -1.0],
    "shared_experts": [[], [{"source_model": "{base}"}]], "output": [None, ""],
}
EXPERT_PLAUSIBLE = {"source_model": ["{base}", "{other}", "/no/such/model", ""], "name": ["a", "b", "", None],
                    "positive_prompts": [["once upon a time"], [], ["  "], ["x", "y"]],
                    "negative_prompts": [["the end"], []], "noise_scale": [0.01, 0.0, -1.0],
                    "residual_scale": [0.5, 1.0, None], "positve_prompts": [["typo"]]}
top_keys = st.one_of(*[st.sampled_from(sorted(UpcycleConfig.model_fields))] * 4, st.text(min_size=1, max_size=10))
expert_keys = st.sampled_from(sorted(EXPERT_PLAUSIBLE))
expert_keys = st.one_of(*[expert_keys.filter(lambda k: k != "positve_prompts")] * 4, expert_keys)


def _value_for(table: dict):
    # plausible three times out of four: most examples should get past the schema
    return lambda key: st.one_of(*[st.sampled_from(table[key])] * 3, values) if key in table else values


def _mapping(keys, table: dict, max_size: int):
    return st.lists(keys, max_size=max_size, unique=True).flatmap(
        lambda ks: st.fixed_dictionaries({k: _value_for(table)(k) for k in ks}))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_fuzz_random_yaml_text(text):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            load_config(path)
        except UpcycleError as exc:
            assert str(exc).startswith(str(path)) or str(path) in str(exc)


@pytest.fixture(scope="module")
def base_yaml(tiny_llama) -> dict:
    return {"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"}


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(changes=_mapping(top_keys, PLAUSIBLE, 3),
       experts=st.none() | st.lists(_mapping(expert_keys, EXPERT_PLAUSIBLE, 4), max_size=3),
       drop=st.lists(st.sampled_from(["base_model", "num_experts", "gate_mode"]), max_size=1))
def test_fuzz_config_mappings_build_or_fail_cleanly(base_yaml, tiny_llama, tiny_mistral, changes, experts, drop):
    """A valid config with random keys changed, then the whole build: clean error or a real output."""
    paths = {"{base}": str(tiny_llama), "{other}": str(tiny_mistral)}

    def fill(value):
        if isinstance(value, list):
            return [fill(v) for v in value]
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        return paths.get(value, value) if isinstance(value, str) else value

    cfg = {k: v for k, v in base_yaml.items() if k not in drop}
    cfg.update(fill(changes))
    if experts is not None:
        cfg.pop("num_experts", None)
        cfg["experts"] = fill(experts)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
        target = Path(d) / "out" / "moe"
        target.parent.mkdir()
        try:
            result = upcycle(path, target)
        except UpcycleError as exc:
            event(type(exc).__name__)
            assert str(exc)
            assert not target.exists() and not list(target.parent.iterdir())
            return
        event("built")
        index = json.loads((target / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == {s.name for s in result.plan.steps}
