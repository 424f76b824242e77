"""Never build from the wrong bytes (issue 13): a source folder is read exactly as transformers reads
it, and a tensor stored twice is refused, naming it and both files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from failure_checks import assert_clean_failure, cli
from moe_upcycle.checkpoint.tiny import make_dense_model

EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def stale_shards(tmp_path_factory) -> Path:
    """A different Llama of the same shape, saved as index + shards (the 'stale' download)."""
    return make_dense_model(tmp_path_factory.mktemp("stale") / "llama", family="llama", seed=7, max_shard_size="40KB")


def _recipe(tmp_path: Path, base: Path) -> Path:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n")
    return cfg


def _output_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in folder.glob("*.safetensors"):
        out.update(load_file(str(shard)))
    return out


def test_stale_index_beside_single_file_reads_what_transformers_reads(tiny_llama, stale_shards, tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    for f in stale_shards.glob("model*.safetensors*"):  # index + shards of another model
        shutil.copy(f, base / f.name)
    assert (base / "model.safetensors.index.json").is_file() and (base / "model.safetensors").is_file()
    code, output = cli("build", _recipe(tmp_path, base), tmp_path / "moe")
    assert code == 0, output
    flat = " ".join(output.split())
    assert "warning:" in flat and "ignoring the index" in flat and "model.safetensors.index.json" in flat
    dense = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).state_dict()
    built = _output_tensors(tmp_path / "moe")
    wanted = load_file(str(tiny_llama / "model.safetensors"))
    for key in (EMBED, "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"):
        assert torch.equal(built[key], wanted[key]) and torch.equal(built[key], dense[key]), key
    w1 = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    assert torch.equal(built[w1], wanted["model.layers.0.mlp.gate_proj.weight"])


def test_stale_bin_beside_safetensors_is_not_read(tiny_llama, tmp_path):
    """transformers prefers safetensors to pytorch_model.bin: so do we (the .bin here is another model)."""
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    other = {k: torch.zeros_like(v) for k, v in load_file(str(base / "model.safetensors")).items()}
    torch.save(other, base / "pytorch_model.bin")
    code, output = cli("build", _recipe(tmp_path, base), tmp_path / "moe")
    assert code == 0, output
    built = _output_tensors(tmp_path / "moe")
    assert torch.equal(built[EMBED], load_file(str(tiny_llama / "model.safetensors"))[EMBED])


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


@pytest.mark.parametrize("in_index", [True, False], ids=["index-names-one", "only-in-shards"])
def test_tensor_in_two_shards_refused(in_index, stale_shards, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(stale_shards, base)
    first, last = _shards(base)[0], _shards(base)[-1]
    moved = next(iter(load_file(str(first))))
    if not in_index:  # a key the index does not list at all, in two shards
        moved = "model.layers.0.extra_buffer"
        extra = load_file(str(first))
        extra[moved] = torch.ones(3)
        save_file(extra, str(first), metadata={"format": "pt"})
    state = load_file(str(last))
    state[moved] = torch.full_like(load_file(str(first))[moved], 7.0)  # a stale, different copy
    save_file(state, str(last), metadata={"format": "pt"})
    target = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, base), target)
    assert_clean_failure(code, output, target, [f"tensor {moved!r} is stored in 2 shards", first.name, last.name,
                                                "ambiguous"])
    if in_index:
        assert f"names {first.name}" in " ".join(output.split())


def test_tensor_in_two_bin_shards_refused(tiny_llama, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(tiny_llama / "config.json", base / "config.json")
    state = load_file(str(tiny_llama / "model.safetensors"))
    keys = sorted(state)
    half = len(keys) // 2
    torch.save({k: state[k] for k in keys[:half]}, base / "pytorch_model-00001-of-00002.bin")
    torch.save({k: state[k] for k in keys[half:]} | {keys[0]: state[keys[0]] * 2}, base / "pytorch_model-00002-of-00002.bin")
    index = {"weight_map": {k: f"pytorch_model-0000{1 if i < half else 2}-of-00002.bin" for i, k in enumerate(keys)}}
    (base / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    target = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, base), target)
    assert_clean_failure(code, output, target, [f"tensor {keys[0]!r} is stored in 2 shards", "ambiguous"])


def test_tensors_outside_the_layers_that_the_loader_skips_are_named(tiny_llama, tmp_path):
    """A value head or a stray tensor beside the decoder (transformers skips it when it loads the dense model) was
    left out without a word; the build now says which tensors it did not copy, and the MoE still equals the dense
    model."""
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    weights = load_file(base / "model.safetensors")
    weights["v_head.summary.weight"] = torch.ones(1, weights["model.norm.weight"].shape[0])
    weights["lm_head.bias"] = torch.full((weights["model.embed_tokens.weight"].shape[0],), 3.0)
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {base}\nnum_experts: 2\nexperts_per_token: 2\ngate_mode: random\n")
    code, output = cli("build", cfg, tmp_path / "moe")
    assert code == 0, output
    flat = " ".join(output.split())
    assert ("base_model: 2 tensor(s) outside the decoder layers, which transformers does not load into a llama model "
            "either, are not copied: lm_head.bias, v_head.summary.weight") in flat, output
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)


def _resave(folder: Path, seed: int) -> None:
    """What `save_pretrained` of a fine-tune into the same folder does to its weight files: new bytes, new layout."""
    for shard in sorted(folder.glob("*.safetensors")):
        state = load_file(str(shard))
        generator = torch.Generator().manual_seed(seed)
        changed = {k: torch.randn(v.shape, generator=generator).to(v.dtype) for k, v in reversed(state.items())}
        save_file(changed, str(shard), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_source_resaved_during_the_build_is_never_published_from(layout, tiny_llama, stale_shards, tmp_path):
    """A model folder re-saved while a build reads it used to give an MoE of two models' tensors (the
    bytes mapped before the change and after), published as if it were one."""
    from moe_upcycle import upcycle
    from moe_upcycle.errors import SourceError

    base = tmp_path / "base"
    shutil.copytree(tiny_llama if layout == "single" else stale_shards, base)
    seen = []

    def resave_once(step, plan):
        if not seen:
            seen.append(step.name)
            _resave(base, seed=11)

    target = tmp_path / "moe"
    with pytest.raises(SourceError) as info:
        upcycle(_recipe(tmp_path, base), target, on_step=resave_once)
    text = str(info.value)
    assert "the file changed on disk after the build read its header" in text and str(base) in text
    assert "nothing was written — run the build again once nothing is writing to" in text
    assert not target.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert (base / "config.json").is_file()  # the user's re-saved model is left as it is
    # and the same folder, left alone, builds
    assert upcycle(_recipe(tmp_path, base), target).output == target


def test_source_replaced_after_its_header_was_read_is_not_read(tiny_llama, tmp_path):
    """The bytes at the planned offsets of a file replaced since: another tensor, or another dtype's bytes."""
    from moe_upcycle.checkpoint.source import open_checkpoint
    from moe_upcycle.errors import SourceError

    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    model = open_checkpoint(str(base), "base_model")
    key = "model.layers.0.mlp.gate_proj.weight"
    original = load_file(str(base / "model.safetensors"))[key]
    _resave(base, seed=3)
    with pytest.raises(SourceError, match="the file changed on disk after the build read its header"):
        model.read(key)
    fresh = open_checkpoint(str(base), "base_model")
    assert not torch.equal(fresh.read(key), original)  # the new model, read whole and consistent
    (base / "model.safetensors").unlink()
    with pytest.raises(SourceError, match="the file is gone or unreadable since the build read its header"):
        fresh.check_unchanged()
