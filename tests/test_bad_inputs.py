"""Every bad input gets one clear message naming the field/file/tensor, exit code 1, no traceback,
and no output folder (nor lock or staging leftovers) — through the real CLI."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from failure_checks import assert_clean_failure, cli, leftovers, run_module
from moe_upcycle.cli import app

GOOD = "base_model: {base}\nnum_experts: 2\ngate_mode: random\n"
EXPERTS = ("base_model: {base}\ngate_mode: random\nexperts:\n"
           "  - source_model: {base}\n    name: a\n  - source_model: {base}\n    name: b\n")

# (id, YAML text with {base} for the model folder, extra CLI args, words the message must contain)
CONFIG_CASES = [
    ("yaml-syntax", "base_model: {base}\nexperts: [\n  - a: 1\nnum_experts: 2\n", [],
     ["experts.yaml:3:3:", "YAML syntax error"]),
    ("yaml-bad-indent", "base_model: {base}\n  num_experts: 2\n", [], ["experts.yaml:2:", "YAML syntax error"]),
    ("yaml-python-tag", "base_model: !!python/object/apply:os.system ['touch {base}/PWNED']\nnum_experts: 2\n",
     [], ["experts.yaml:1:", "YAML syntax error", "python/object/apply"]),
    ("not-a-mapping", "- base_model\n- num_experts\n", [], ["must be a YAML mapping", "got a list"]),
    ("empty-file", "", [], ["must be a YAML mapping", "it is empty (or holds only comments or null)"]),
    ("not-utf8", b"base_model: \xff\xfe\n", [], ["experts.yaml", "not a UTF-8 text file", "re-save it as UTF-8"]),
    ("wrong-type-int", GOOD.replace("num_experts: 2", "num_experts: four"), [], ["num_experts: 'four' is not a number; write an integer such as 2"]),
    ("wrong-type-list", "base_model: {base}\nexperts: 5\n", [], ["experts: 5 is not a list of experts", "one '- source_model: ...' line per expert"]),
    ("wrong-type-prompt", EXPERTS.replace("name: a", "name: a\n    positive_prompts: [[1, 2]]"), [],
     ["experts[0].positive_prompts: prompt 0 is a list", "put the prompt in quotes"]),
    # route's JSON keyed both experts expert_1 and one share overwrote the other
    ("name-is-another-experts-default", EXPERTS.replace("name: a", "name: expert_1").replace("    name: b\n", ""), [],
     ["experts[1] has no name, so it is called expert_1, the name another expert is given", "name experts[1]"]),
    ("unknown-key-top", GOOD.replace("gate_mode", "gate_mdoe"), [], ["gate_mdoe: unknown key", "did you mean gate_mode?"]),
    ("unknown-key-nested", EXPERTS.replace("name: a", "name: a\n    positve_prompts: [x]"), [],
     ["experts[0].positve_prompts: unknown key", "did you mean positive_prompts?"]),
    ("unknown-key-no-match", GOOD + "zzz: 1\n", [], ["zzz: unknown key", "valid keys:", "base_model"]),
    ("unknown-key-odd", GOOD + "'[x]': 1\n", [], ["[x]: unknown key", "valid keys:"]),
    ("missing-base-model", "num_experts: 2\n", [], ["base_model: required key is missing"]),
    ("empty-experts", "base_model: {base}\nexperts: []\n", [], ["no experts", "num_experts"]),
    # empty prompts ([""], mergekit's "default expert") are accepted: tests/test_mergekit_configs.py
    ("duplicate-names", EXPERTS.replace("name: b", "name: a"), [], ["experts:", "duplicate expert names ['a']"]),
    ("experts-per-token-0", GOOD + "experts_per_token: 0\n", [], ["experts_per_token:", "0 is too small; write at least 1"]),
    ("experts-per-token-too-many", GOOD + "experts_per_token: 3\n", [],
     ["experts_per_token is 3 but there are only 2 experts"]),
    ("num-experts-and-experts", EXPERTS + "num_experts: 2\n", [], ["num_experts and experts are both given"]),
    ("shard-size-negative", GOOD + "max_shard_size: -5\n", [], ["max_shard_size:", "must be positive"]),
    ("shard-size-negative-unit", GOOD + "max_shard_size: -5GB\n", [], ["max_shard_size:", "'-5GB' is not a size"]),
    ("shard-size-huge", GOOD + "max_shard_size: 5PB\n", [], ["max_shard_size:", "'5PB' is not a size"]),
    ("shard-size-huge-int", GOOD + "max_shard_size: 100000000000000000\n", [], ["max_shard_size:", "larger than 1 TiB"]),
    ("shard-size-inf", GOOD + "max_shard_size: .inf\n", [], ["max_shard_size:", "inf is not a size"]),
    ("shard-size-cli", GOOD, ["--max-shard-size", "-1"], ["option max_shard_size (--max-shard-size):", "'-1' is not a size"]),
    ("dtype-unknown", GOOD + "dtype: fp8\n", [], ["dtype:", "'fp8' is not allowed", "'bfloat16'"]),
    ("gate-mode-unknown", GOOD.replace("random", "smart"), [], ["gate_mode:", "'smart' is not allowed"]),
    ("noise-inf", EXPERTS.replace("name: a", "name: a\n    noise_scale: .inf"), [],
     ["experts[0].noise_scale", "finite number"]),
    ("seed-huge", GOOD + f"seed: {2**70}\n", [], ["seed:", "is too large; write at most 18446744073709551615"]),
    ("seed-negative", GOOD + "seed: -1\n", [], ["seed:", "-1 is too small; write at least 0"]),
    ("base-missing", GOOD.replace("{base}", "{base}/nowhere"), [], ["base_model:", "nowhere", "not found"]),
    ("expert-missing", EXPERTS.replace("  - source_model: {base}\n    name: b", "  - source_model: /no/such/model\n    name: b"),
     [], ["experts[1].source_model:", "'/no/such/model' not found"]),
    ("prompts-needed", "base_model: {base}\nnum_experts: 2\ngate_mode: cheap_embed\n", [],
     ["gate_mode: cheap_embed needs prompts"]),
]


@pytest.mark.parametrize("case_id,text,args,words", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_fails_cleanly(case_id, text, args, words, tiny_llama, tmp_path):
    cfg = tmp_path / "experts.yaml"
    if isinstance(text, bytes):
        cfg.write_bytes(text)
    else:
        cfg.write_text(text.replace("{base}", str(tiny_llama)), encoding="utf-8")
    target = tmp_path / "out" / "moe"
    target.parent.mkdir()
    code, output = cli("build", cfg, target, *args)
    assert_clean_failure(code, output, target, words)
    assert not (tiny_llama / "PWNED").exists()


def test_missing_config_file(tmp_path):
    code, output = cli("build", tmp_path / "nope.yaml", tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", ["nope.yaml: config file not found"])


def test_no_output_given(tiny_llama, tmp_path):
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(GOOD.replace("{base}", str(tiny_llama)))
    code, output = cli("build", cfg)
    assert code == 1 and "output: no output folder given" in output and "Traceback" not in output


# ---------------------------------------------------------------------------------------------
# Broken checkpoints: each case breaks a copy of a tiny model in one way.


def _rewrite_header(file: Path, edit) -> None:
    """Apply `edit(header_dict)` to a safetensors file's JSON header, keeping the data bytes."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _first_key(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _last_key(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _shards(m: Path) -> list[str]:
    return sorted(set(json.loads((m / "model.safetensors.index.json").read_text())["weight_map"].values()))


def _missing_shard(m: Path) -> None:
    (m / _shards(m)[1]).unlink()


def _index_wrong_shard(m: Path) -> None:
    index = json.loads((m / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = _shards(m)[0]
    (m / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_escapes_folder(m: Path) -> None:
    index = json.loads((m / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../etc/passwd"
    (m / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_not_json(m: Path) -> None:
    (m / "model.safetensors.index.json").write_text("{weight_map: oops")


def _truncated(m: Path) -> None:
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])


def _truncated_in_header(m: Path) -> None:
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def _empty(m: Path) -> None:
    (m / "model.safetensors").write_bytes(b"")


def _header_length_absurd(m: Path) -> None:
    f = m / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2**62) + f.read_bytes()[8:])


def _offsets_past_end(m: Path) -> None:
    def edit(h):
        k = _last_key(h)
        s, e = h[k]["data_offsets"]
        h[k]["data_offsets"] = [s + 8, e + 8]
    _rewrite_header(m / "model.safetensors", edit)


def _offsets_beyond_file(m: Path) -> None:
    def edit(h):
        k = _last_key(h)
        h[k]["shape"] = [h[k]["shape"][0] * 1000]
        h[k]["data_offsets"][1] = h[k]["data_offsets"][0] + 4 * h[k]["shape"][0]
    _rewrite_header(m / "model.safetensors", edit)


def _extra_bytes(m: Path) -> None:
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 16)


def _offsets_overlap(m: Path) -> None:
    def edit(h):
        k = _last_key(h)
        s, e = h[k]["data_offsets"]
        h[k]["data_offsets"] = [s - 4, e - 4]
    _rewrite_header(m / "model.safetensors", edit)


def _absurd_shape(m: Path) -> None:
    def edit(h):
        h[_first_key(h)]["shape"] = [10**12, 10**12]
    _rewrite_header(m / "model.safetensors", edit)


def _negative_shape(m: Path) -> None:
    def edit(h):
        h[_first_key(h)]["shape"] = [-1, 64]
    _rewrite_header(m / "model.safetensors", edit)


def _unknown_dtype(m: Path) -> None:
    def edit(h):
        h[_first_key(h)]["dtype"] = "Q4_K"
    _rewrite_header(m / "model.safetensors", edit)


def _header_not_json(m: Path) -> None:
    f = m / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(raw[:8] + b"#" * n + raw[8 + n:])


def _config_not_json(m: Path) -> None:
    (m / "config.json").write_text("{'model_type': 'llama',")


def _config_missing_fields(m: Path) -> None:
    cfg = json.loads((m / "config.json").read_text())
    del cfg["hidden_size"], cfg["vocab_size"]
    (m / "config.json").write_text(json.dumps(cfg))


def _config_wrong_type(m: Path) -> None:
    cfg = json.loads((m / "config.json").read_text())
    cfg["num_hidden_layers"] = "two"
    (m / "config.json").write_text(json.dumps(cfg))


def _config_unknown_model_type(m: Path) -> None:
    cfg = json.loads((m / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (m / "config.json").write_text(json.dumps(cfg))


def _no_config(m: Path) -> None:
    (m / "config.json").unlink()


def _no_weights(m: Path) -> None:
    (m / "model.safetensors").unlink()


def _only_native_weights(m: Path) -> None:
    (m / "model.safetensors").rename(m / "consolidated.safetensors")


def _only_a_variant(m: Path) -> None:
    (m / "model.safetensors").rename(m / "model.fp16.safetensors")


def _only_flax_weights(m: Path) -> None:
    (m / "model.safetensors").rename(m / "flax_model.msgpack")


def _broken_tokenizer_link(m: Path) -> None:  # a copied HF-cache snapshot without its blobs
    (m / "tokenizer.json").unlink()
    (m / "tokenizer.json").symlink_to("../../blobs/0123abcd")


def _broken_config_link(m: Path) -> None:
    (m / "config.json").unlink()
    (m / "config.json").symlink_to("../../blobs/4567cdef")


def _int_weights(m: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(m / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.int32)
    save_file(state, str(m / "model.safetensors"), metadata={"format": "pt"})


def _missing_tensor(m: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(m / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(m / "model.safetensors"), metadata={"format": "pt"})


class _RunsCode:
    """Unpickling this would run a shell command; weights_only loading must refuse it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _malicious_bin(m: Path) -> None:
    (m / "model.safetensors").unlink()
    state = {"model.embed_tokens.weight": torch.zeros(3), "evil": _RunsCode(m / "PWNED")}
    torch.save(state, m / "pytorch_model.bin")


def _malicious_legacy_bin(m: Path) -> None:
    (m / "model.safetensors").unlink()
    (m / "pytorch_model.bin").write_bytes(pickle.dumps({"evil": _RunsCode(m / "PWNED")}, protocol=2))


def _bin_not_tensors(m: Path) -> None:
    (m / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": [1.0, 2.0]}, m / "pytorch_model.bin")


def _bin_not_torch(m: Path) -> None:
    (m / "model.safetensors").unlink()
    (m / "pytorch_model.bin").write_bytes(b"\x80\x04 this is not a checkpoint" * 10)


def _bin_plain_pickle(m: Path) -> None:
    (m / "model.safetensors").unlink()
    (m / "pytorch_model.bin").write_bytes(pickle.dumps({"a": [1, 2, 3]}))


# (id, fixture to copy, how to break it, words the message must contain; "{m}" is the model folder)
CHECKPOINT_CASES = [
    ("missing-shard", "tiny_mistral", _missing_shard,
     ["{m}/{shard2}: shard file is missing", "the index model.safetensors.index.json lists"]),
    ("index-tensor-not-in-shard", "tiny_mistral", _index_wrong_shard,
     ["model.safetensors.index.json: lists 'model.norm.weight' in {shard1}",
      "does not contain it"]),
    ("index-escapes-folder", "tiny_mistral", _index_escapes_folder,
     ["model.safetensors.index.json: tensor 'model.norm.weight' is mapped to '../../etc/passwd'", "not a file name"]),
    ("index-not-json", "tiny_mistral", _index_not_json, ["model.safetensors.index.json: not a valid index"]),
    ("truncated", "tiny_llama", _truncated,
     ["{m}/model.safetensors: truncated: the header describes", "data bytes but the file holds", "re-download"]),
    ("truncated-in-header", "tiny_llama", _truncated_in_header, ["{m}/model.safetensors:", "header claims", "truncated"]),
    ("empty-file", "tiny_llama", _empty, ["{m}/model.safetensors: empty or truncated safetensors file (0 bytes)"]),
    ("header-length-absurd", "tiny_llama", _header_length_absurd, ["{m}/model.safetensors:", "header claims 4611686018427387904 bytes"]),
    ("offsets-past-end", "tiny_llama", _offsets_past_end,
     ["{m}/model.safetensors: the header leaves bytes", "unaccounted for"]),
    ("offsets-beyond-file", "tiny_llama", _offsets_beyond_file, ["{m}/model.safetensors: truncated", "re-download"]),
    ("extra-bytes", "tiny_llama", _extra_bytes, ["{m}/model.safetensors: 16 bytes after the last tensor"]),
    ("offsets-overlap", "tiny_llama", _offsets_overlap, ["{m}/model.safetensors: tensors", "overlap"]),
    ("absurd-shape", "tiny_llama", _absurd_shape,
     ["{m}/model.safetensors: tensor", "shape [1000000000000, 1000000000000] of F32 needs 4000000000000000000000000 bytes"]),
    ("negative-shape", "tiny_llama", _negative_shape, ["{m}/model.safetensors: tensor", "malformed header entry"]),
    ("unknown-dtype", "tiny_llama", _unknown_dtype, ["{m}/model.safetensors: tensor", "dtype 'Q4_K'"]),
    ("header-not-json", "tiny_llama", _header_not_json, ["{m}/model.safetensors: safetensors header is not valid JSON"]),
    ("config-not-json", "tiny_llama", _config_not_json, ["{m}/config.json: not valid JSON"]),
    ("config-missing-fields", "tiny_llama", _config_missing_fields,
     ["{m}/config.json: missing required field(s) hidden_size, vocab_size"]),
    ("config-wrong-type", "tiny_llama", _config_wrong_type, ["{m}/config.json: num_hidden_layers must be a positive integer, got 'two'"]),
    ("config-unknown-model-type", "tiny_llama", _config_unknown_model_type, ["model_type 'gpt2' is not supported", "LlamaForCausalLM"]),
    ("no-config", "tiny_llama", _no_config, ["base_model: {m} has no config.json"]),
    ("no-weights", "tiny_llama", _no_weights, ["base_model: {m} has no model.safetensors"]),
    # a folder with config.json whose weights transformers would not load from it: what it holds, and what to do
    ("only-native-weights", "tiny_llama", _only_native_weights,
     ["base_model: {m} has no model.safetensors", "it holds Meta/Mistral's native format (consolidated.safetensors)",
      "convert_mistral_weights_to_hf.py"]),
    ("broken-tokenizer-link", "tiny_llama", _broken_tokenizer_link,  # before: built, with no tokenizer.json
     ["{m}/tokenizer.json: a link to ../../blobs/0123abcd, which does not exist", "the MoE would have no tokenizer.json"]),
    ("broken-config-link", "tiny_llama", _broken_config_link,  # before: "has no config.json"
     ["base_model: {m}/config.json is a link to ../../blobs/4567cdef, which does not exist"]),
    ("only-a-variant", "tiny_llama", _only_a_variant,
     ["it holds model.fp16.safetensors, a variant that transformers loads only when asked",
      "rename the files without the variant, e.g. model.safetensors"]),
    ("only-flax-weights", "tiny_llama", _only_flax_weights,
     ["it holds flax_model.msgpack (TensorFlow/Flax weights)", "save_pretrained"]),
    ("int-weights", "tiny_llama", _int_weights,
     ["{m}/model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' is int32", "floating point"]),
    ("missing-tensor", "tiny_llama", _missing_tensor, ["'model.layers.1.self_attn.k_proj.weight' is missing from {m}"]),
    ("bin-runs-code", "tiny_llama", _malicious_bin,
     ["{m}/pytorch_model.bin: refused to load (Trying to load unsupported GLOBAL posix.system", "weights_only",
      "could run code"]),
    ("bin-runs-code-legacy", "tiny_llama", _malicious_legacy_bin,
     ["{m}/pytorch_model.bin: refused to load (Trying to load unsupported GLOBAL posix.system", "weights_only"]),
    ("bin-not-torch", "tiny_llama", _bin_not_torch, ["{m}/pytorch_model.bin: refused to load (Unsupported operand"]),
    ("bin-plain-pickle", "tiny_llama", _bin_plain_pickle, ["{m}/pytorch_model.bin: refused to load"]),
    ("bin-not-tensors", "tiny_llama", _bin_not_tensors, ["{m}/pytorch_model.bin: expected a dict of tensors"]),
]


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the junk .bin cases
@pytest.mark.parametrize("case_id,fixture,breaker,words", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_broken_checkpoint_fails_cleanly(case_id, fixture, breaker, words, request, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), model)
    shards = _shards(model) if (model / "model.safetensors.index.json").is_file() else ["", ""]
    breaker(model)
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(GOOD.replace("{base}", str(model)))
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target)
    words = [w.replace("{m}", str(model)).replace("{shard1}", shards[0]).replace("{shard2}", shards[1]) for w in words]
    assert_clean_failure(code, output, target, words)
    assert not (model / "PWNED").exists(), "unpickling ran code from the checkpoint"


def test_legacy_format_bin_still_loads(tiny_llama, tmp_path):
    """Pre-zip torch.save files cannot be memory-mapped; they are still read (safely) and built."""
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    state = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save(state, model / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(GOOD.replace("{base}", str(model)))
    code, output = cli("build", cfg, tmp_path / "moe")
    assert code == 0, output
    from safetensors import safe_open

    with safe_open(str(tmp_path / "moe" / "model-00001-of-00001.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.1.block_sparse_moe.experts.1.w2.weight"),
                           state["model.layers.1.mlp.down_proj.weight"])


def test_broken_expert_named_with_its_field(tiny_llama, tmp_path):
    """A broken expert (not the base) is reported with its experts[i] field; all problems at once."""
    bad1, bad2 = tmp_path / "bad1", tmp_path / "bad2"
    for bad in (bad1, bad2):
        shutil.copytree(tiny_llama, bad)
        (bad / "config.json").unlink()
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n"
                   f"  - source_model: {tiny_llama}\n  - source_model: {bad1}\n  - source_model: {bad2}\n")
    code, output = cli("build", cfg, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe",
                         [f"experts[1].source_model: {bad1} has no config.json",
                          f"experts[2].source_model: {bad2} has no config.json"])


def test_debug_shows_traceback(tiny_llama, tmp_path):
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(GOOD.replace("{base}", str(tiny_llama)) + "dtype: fp8\n")
    result = CliRunner().invoke(app, ["--debug", "build", str(cfg), str(tmp_path / "moe")])
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "ConfigError" and "dtype" in str(result.exception)


@pytest.mark.parametrize("case_id", ["unknown-key-nested", "bin-runs-code"])
def test_real_process_prints_no_traceback(case_id, tiny_llama, tmp_path):
    """The same failures through a real ``python -m moe_upcycle build`` process."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    if case_id == "bin-runs-code":
        _malicious_bin(model)
        text, words = GOOD, [f"{model}/pytorch_model.bin: refused to load", "weights_only"]
    else:
        text = dict((c[0], c[1]) for c in CONFIG_CASES)[case_id]
        words = ["experts[0].positve_prompts: unknown key", "did you mean positive_prompts?"]
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(text.replace("{base}", str(model)))
    target = tmp_path / "moe"
    code, output = run_module("build", cfg, target)
    assert_clean_failure(code, output, target, words)
    assert not (model / "PWNED").exists()
    assert leftovers(target) == []
