"""Hostile or broken files around a build: what ``--force`` may replace, and checkpoint files that
lie about what transformers would load. Each case asserts the exit code, the message naming the
file or entry, and that every file a user owns survives byte for byte."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import model_logits
from failure_checks import assert_clean_failure, cli, leftovers, previous_build
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.headers import read_safetensors_header
from moe_upcycle.errors import OutputError, SourceError
from moe_upcycle.planning.windows import dense_windows
from moe_upcycle.recipe.rewrite import write_grown_config
from tolerances import assert_close_rel

GOOD = "base_model: {base}\nnum_experts: 2\ngate_mode: random\n"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _flat(output: str) -> str:
    return " ".join(output.split())


def _recipe(folder: Path, base: Path) -> Path:
    cfg = folder / "cfg.yaml"
    cfg.write_text(GOOD.replace("{base}", str(base)))
    return cfg


# ---------------------------------------------------------------------------------------------
# --force over a previous build: only a folder holding nothing but that build's files is replaced.


@pytest.fixture(scope="module", params=["checksums", "no-checksums"])
def previous(request, tiny_llama, tmp_path_factory) -> Path:
    """A real earlier build (with and without shard checksums in its manifest)."""
    folder = tmp_path_factory.mktemp("previous")
    args = ["--no-checksums"] if request.param == "no-checksums" else []
    code, output = cli("build", _recipe(folder, tiny_llama), folder / "out", *args)
    assert code == 0, output
    return folder / "out"


def _add_file(out: Path) -> str:
    (out / "notes.txt").write_text("three weeks of notes")
    return "notes.txt"


def _add_folder(out: Path) -> str:
    (out / "checkpoint-500").mkdir()
    (out / "checkpoint-500" / "optimizer.pt").write_bytes(b"state")
    return "checkpoint-500/"


def _add_git(out: Path) -> str:
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return ".git/"


def _add_link(out: Path) -> str:
    (out / "data").symlink_to(out.parent, target_is_directory=True)
    return "data"


def _edit_config(out: Path) -> str:
    (out / "config.json").write_text((out / "config.json").read_text().replace("{", '{\n  "my_edit": 1,', 1))
    return "config.json (changed since the build)"


def _edit_card(out: Path) -> str:
    with open(out / "README.md", "a") as fh:
        fh.write("\nMy evaluation notes.\n")
    return "README.md (changed since the build)"


def _fine_tuned_over_it(out: Path) -> str:
    """save_pretrained of a fine-tuned model into the folder rewrites the config and the shards."""
    shard = next(out.glob("model-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-4:] = b"\x01\x02\x03\x04"
    shard.write_bytes(bytes(raw))
    (out / "config.json").write_text((out / "config.json").read_text() + " ")
    return "config.json (changed since the build)"


def _old_card_copied_over(out: Path) -> str:
    """cp -p / rsync -a / tar x keep a file's old modification time: the card was replaced without a trace there
    (only files newer than the manifest were hashed)."""
    mine = out.parent / "my-card.md"
    mine.write_text("my precious card\n")
    os.utime(mine, (1577836800, 1577836800))  # 2020-01-01
    shutil.copy2(mine, out / "README.md")
    return "README.md (changed since the build)"


def _old_config_moved_over(out: Path) -> str:
    mine = out.parent / "my-config.json"
    mine.write_text((out / "config.json").read_text().replace("{", '{"mine": 1, ', 1))
    os.utime(mine, (1577836800, 1577836800))
    os.replace(mine, out / "config.json")
    return "config.json (changed since the build)"


@pytest.mark.parametrize("change", [_add_file, _add_folder, _add_git, _add_link, _edit_config, _edit_card,
                                    _fine_tuned_over_it, _old_card_copied_over, _old_config_moved_over],
                         ids=lambda f: f.__name__.strip("_"))
def test_force_keeps_previous_build_holding_user_files(change, previous, tiny_llama, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(previous, out, symlinks=True)
    named = change(out)
    before = _snapshot(out)
    code, output = cli("build", _recipe(tmp_path, tiny_llama), out, "--force")
    flat = _flat(output)
    assert code == 1, output
    assert "is a previous moe-upcycle output, but it also holds what that build did not write" in flat, output
    assert named in flat and "Move these away" in flat and "Traceback" not in output
    assert _snapshot(out) == before and leftovers(out) == ["out"]


def test_force_replaces_previous_build_copied_elsewhere(previous, tiny_llama, tmp_path):
    """A copied folder has new mtimes in any order: the files are hashed, found unchanged, and replaced."""
    out = tmp_path / "out"
    shutil.copytree(previous, out, copy_function=shutil.copyfile)  # no mtimes kept
    (out / "moe_upcycle.json").touch()
    for path in out.iterdir():
        path.touch()
    code, output = cli("build", _recipe(tmp_path, tiny_llama), out, "--force")
    assert code == 0, output
    assert leftovers(out) == ["out"]


# ---------------------------------------------------------------------------------------------
# safetensors headers that Python's json reads but the safetensors library (so transformers) refuses.

_A = '"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
_B = '"b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}'
_M = '"__metadata__": {"format": "pt"}'
_PLAIN = "{" + f"{_M}, {_A}, {_B}" + "}"

# (id, header bytes, words our message must contain; None: safetensors reads it, and so must we)
HEADERS = [
    ("utf8-bom", b"\xef\xbb\xbf" + _PLAIN.encode(), ["not valid JSON", "BOM"]),
    ("utf16", _PLAIN.encode("utf-16-le"), ["not valid JSON"]),
    ("utf32-bom", _PLAIN.encode("utf-32"), ["not valid JSON"]),
    ("latin1-name", ("{" + f'{_M}, "\xe9": ' + _A[5:] + f", {_B}" + "}").encode("latin-1"), ["not valid JSON"]),
    ("lone-surrogate-name", ("{" + f'{_M}, "\\ud800": ' + _A[5:] + f", {_B}" + "}").encode(), ["not valid JSON"]),
    ("nan-in-metadata", ("{" + f'"__metadata__": {{"format": "pt", "x": NaN}}, {_A}, {_B}' + "}").encode(),
     ["not valid JSON", "NaN"]),
    ("infinity-offset", ("{" + f'{_M}, "a": {{"dtype": "F32", "shape": [2], "data_offsets": [0, Infinity]}}, {_B}'
                         + "}").encode(), ["not valid JSON", "Infinity"]),
    ("duplicate-metadata", ("{" + f"{_M}, {_M}, {_A}, {_B}" + "}").encode(), ["'__metadata__' appears 2 times"]),
    ("duplicate-field", ("{" + f'{_M}, "a": {{"dtype": "F16", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, '
                         f"{_B}" + "}").encode(), ["'dtype' appears 2 times"]),
    ("null-metadata", ("{" + f'"__metadata__": null, {_A}, {_B}' + "}").encode(), None),
    ("leading-whitespace", (" \n" + _PLAIN + "  ").encode(), None),
]


@pytest.mark.parametrize("case_id,raw,words", HEADERS, ids=[c[0] for c in HEADERS])
def test_header_read_as_strictly_as_safetensors(case_id, raw, words, tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    try:
        with safe_open(str(file), framework="pt") as f:
            theirs = sorted(f.keys())
    except Exception:  # noqa: BLE001 - safetensors' own error type
        theirs = None
    if words is None:
        assert theirs == ["a", "b"] and sorted(read_safetensors_header(file)) == theirs
        return
    assert theirs is None, "safetensors reads this header: the case is wrong"
    with pytest.raises(SourceError) as err:
        read_safetensors_header(file)
    assert str(file) in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_duplicate_tensor_name_refused_through_cli(tiny_llama, tmp_path):
    """Two entries for one tensor: the build stops naming the file and the tensor, and writes nothing."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    file = model / "model.safetensors"
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8:8 + n].decode().rstrip()
    entry = json.dumps(json.loads(text)["model.norm.weight"])
    new = (text[:-1] + f', "model.norm.weight": {entry}' + "}").encode()
    new += b" " * (-len(new) % 8)
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe",
                         [f"{file}: safetensors header is not valid JSON", "'model.norm.weight' appears 2 times",
                          "re-download"])


@pytest.mark.parametrize("aligned", [True, False], ids=["memory-mapped", "unaligned"])
@pytest.mark.parametrize("change", ["truncated", "garbage", "removed"])
def test_source_changed_after_its_header_was_read(aligned, change, tmp_path):
    """A shard rewritten between the header check and the read (a re-download) is a SourceError naming it."""
    file = tmp_path / "model.safetensors"
    if aligned:
        save_file({"w": torch.ones(64, 64)}, str(file))
    else:  # a 1-byte-padded header puts the data at an odd offset, so the reader goes through safe_open
        header = json.dumps({"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 4 * 64 * 64]}}).encode()
        header += b" " * ((5 - len(header)) % 8)
        file.write_bytes(struct.pack("<Q", len(header)) + header + torch.ones(64, 64).numpy().tobytes())
    ckpt = Checkpoint("m", tmp_path, {}, read_safetensors_header(file))
    assert (ckpt.tensors["w"].offset % 4 == 0) == aligned
    if change == "removed":
        file.unlink()
    else:
        file.write_bytes(file.read_bytes()[:100] if change == "truncated" else b"\xff" * 50)
    with pytest.raises(SourceError, match=f"{file}: cannot read tensor 'w'"):
        ckpt.read("w")


# ---------------------------------------------------------------------------------------------
# pytorch_model.bin whose weights are not where transformers looks for them.


@pytest.mark.parametrize("wrapper", ["state_dict", "model", "module"])
def test_bin_with_wrapped_weights_refused(wrapper, tiny_llama, tmp_path):
    """{"state_dict": {...}} (a training checkpoint): transformers loads only top-level tensors, so
    from_pretrained would initialise every weight at random. Building from the nested tensors would
    make an MoE of a model no loader sees; it is refused, with the command that unwraps it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    state = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save({wrapper: state, "epoch": 3}, model / "pytorch_model.bin")
    code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [
        f"{model}/pytorch_model.bin: expected a dict of tensors, but '{wrapper}' holds a dict",
        "(and 1 more entries are not tensors)", f"read none of the weights under '{wrapper}'",
        f"torch.save(checkpoint['{wrapper}'], 'pytorch_model.bin')"])


@pytest.mark.parametrize("kind,words", [
    ("sparse", "is stored as a sparse_coo tensor, not a dense one"),
    ("sparse_csr", "is stored as a sparse_csr tensor, not a dense one"),
    ("meta", "has no values in the file (a tensor on the meta device)"),
    ("quantized", "is a quantized tensor (qint8)"),
])
def test_bin_tensor_that_is_not_plain_values_refused(kind, words, tiny_llama, tmp_path):
    """weights_only loading accepts sparse, meta and quantized tensors; a sparse one crashed the plan with a
    traceback, a meta one (no values in the file) passed the plan and crashed the build midway."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    state = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    key = "model.layers.0.mlp.up_proj.weight"
    w = state[key]
    state[key] = {"sparse": w.to_sparse, "sparse_csr": w.to_sparse_csr, "meta": lambda: w.to("meta"),
                  "quantized": lambda: torch.quantize_per_tensor(w, 0.01, 0, torch.qint8)}[kind]()
    torch.save(state, model / "pytorch_model.bin")
    for command in ("plan", "build"):
        args = [tmp_path / "moe"] if command == "build" else []
        code, output = cli(command, _recipe(tmp_path, model), *args)
        assert_clean_failure(code, output, tmp_path / "moe", [
            f"{model}/pytorch_model.bin: tensor '{key}' {words}", "Re-save the model"])


# ---------------------------------------------------------------------------------------------
# config.json fields that mean different things in the dense family and the MoE: sliding_window.


@pytest.mark.parametrize("fixture,changes", [
    ("tiny_llama", {"sliding_window": 4}),  # Llama ignores it; Mixtral would apply it
    # published Qwen2.5 configs: a window, switched off, and no layer_types (older transformers)
    ("tiny_qwen2", {"sliding_window": 4, "use_sliding_window": False, "max_window_layers": 28, "layer_types": None}),
    ("tiny_qwen3", {"sliding_window": 4, "layer_types": None}),  # use_sliding_window missing: off
], ids=["llama", "qwen2-published-shape", "qwen3-no-switch"])
def test_window_the_dense_model_ignores_is_not_added(fixture, changes, request, tmp_path):
    """The MoE of identical experts must give the dense logits on a text longer than the window."""
    model = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), model)
    config = json.loads((model / "config.json").read_text())
    config.update({k: v for k, v in changes.items() if v is not None})
    for k in [k for k, v in changes.items() if v is None]:
        config.pop(k, None)
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, model), out)
    assert code == 0, output
    moe = json.loads((out / "config.json").read_text())
    assert moe["sliding_window"] is None and moe.get("use_sliding_window", False) is False
    assert_close_rel(model_logits(out), model_logits(model))


def test_dense_windows_follow_each_family():
    qwen = {"model_type": "qwen2", "num_hidden_layers": 3, "sliding_window": 8}
    assert dense_windows({**qwen, "model_type": "llama"}) == [None] * 3
    assert dense_windows({**qwen, "model_type": "mistral"}) == [8] * 3
    assert dense_windows({**qwen, "model_type": "mistral", "sliding_window": None}) == [None] * 3
    assert dense_windows(qwen) == [None] * 3  # use_sliding_window defaults to false
    assert dense_windows({**qwen, "use_sliding_window": True, "max_window_layers": 1}) == [None, 8, 8]
    assert dense_windows({**qwen, "use_sliding_window": True}) == [None] * 3  # max_window_layers defaults to 28
    assert dense_windows({**qwen, "model_type": "qwen3", "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}) == [8, None, 8]
    assert dense_windows({**qwen, "use_sliding_window": False, "layer_types": ["sliding_attention"] * 3}) == [None] * 3


# ---------------------------------------------------------------------------------------------
# tie_word_embeddings against the stored weights.


def test_untied_config_without_head_says_which_flag(tiny_llama, tmp_path):
    """No lm_head.weight and tie_word_embeddings false: transformers would draw a random head."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    state = load_file(str(model / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [
        f"tensor 'lm_head.weight' is missing from {model} (config.json has tie_word_embeddings: false; if the "
        f"model's output head is its embedding, set it to true)"])


@pytest.mark.parametrize("head", ["different", "same-bytes"])
def test_tied_config_with_stored_head(head, tiny_llama, tmp_path):
    """tie_word_embeddings: true beside a stored lm_head.weight: transformers 5 runs the stored head,
    4.x the embedding. A head equal to the embedding is unambiguous and builds; a different one is refused."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    state = load_file(str(model / "model.safetensors"))
    if head == "same-bytes":
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]) == (head == "same-bytes")
    out = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, model), out)
    if head == "same-bytes":
        assert code == 0, output
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
        return
    assert_clean_failure(code, output, out, [
        f"base_model ({model}): config.json says tie_word_embeddings: true, but {model}/model.safetensors stores "
        f"an lm_head.weight that differs from model.embed_tokens.weight", "set tie_word_embeddings: false"])


# ---------------------------------------------------------------------------------------------
# Leftovers of a build killed (SIGKILL) in the middle of a --force swap.


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_previous_output_left_mid_swap_is_put_back_before_the_checks(force, tiny_llama, tmp_path):
    """The previous output, left as .moe.old-<pid> with no target, is moved back before the target is
    checked: without --force the build stops at once saying so (it used to do all the work and then
    fail at the final rename with "appeared during the build"); with --force it is replaced."""
    target = tmp_path / "moe"
    previous_build(tmp_path / ".moe.old-99999", {"config.json": '{"previous": true}'})
    before = _snapshot(tmp_path / ".moe.old-99999")
    code, output = cli("build", _recipe(tmp_path, tiny_llama), target, *(["--force"] if force else []))
    assert leftovers(target) == ["moe"]
    if force:
        assert code == 0, output
        assert json.loads((target / "config.json").read_text())["num_local_experts"] == 2
        return
    assert code == 1 and "Traceback" not in output
    assert ("already exists and is not empty (it is the previous output, put back from .moe.old-99999, where a "
            "build killed while replacing it had left it)") in _flat(output), output
    assert "appeared during the build" not in output and _snapshot(target) == before


# ---------------------------------------------------------------------------------------------
# A base without a tokenizer: the MoE is right but has none; the build says so, verify names it.


def test_base_without_tokenizer_warns_and_verify_names_the_tokenizer(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    out = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, model), out)
    assert code == 0, output
    assert (f"warning: {model} holds no tokenizer (tokenizer.json, tokenizer.model, vocab.json), so the MoE will "
            f"have none") in _flat(output), output
    assert not (out / "tokenizer.json").exists() and (out / "config.json").is_file()
    code, output = cli("verify", out)
    flat = _flat(output)
    assert code == 1 and "its tokenizer does not load with transformers AutoTokenizer" in flat, output
    assert "copy the base model's tokenizer files into it" in flat and "AutoModelForCausalLM" not in flat


# ---------------------------------------------------------------------------------------------
# Source files the user may not read (chmod 000; simulated too, since tests may run as root).


@pytest.mark.parametrize("fixture,name,words", [
    ("tiny_llama", "config.json", ["base_model: cannot read {m}/config.json (Permission denied)",
                                   "check that the model folder and its files are readable by you"]),
    ("tiny_llama", "model.safetensors", ["{m}/model.safetensors: cannot read it (Permission denied)"]),
    ("tiny_mistral", "model.safetensors.index.json", ["{m}/model.safetensors.index.json", "Permission denied"]),
    ("tiny_mistral", "model-00002-of-00012.safetensors",
     ["{m}/model-00002-of-00012.safetensors: cannot read it (Permission denied)"]),
    ("tiny_llama_bin_tied", "pytorch_model.bin", ["base_model: cannot read {m}/pytorch_model.bin (Permission denied)"]),
    ("tiny_llama", "tokenizer.json", ["{m}/tokenizer.json: cannot read it (Permission denied)", "make it readable"]),
    ("tiny_llama", "chat_template.jinja", ["{m}/chat_template.jinja: cannot read it (Permission denied)"]),
], ids=lambda v: v if isinstance(v, str) and "." in v else None)
def test_unreadable_source_file_named(fixture, name, words, request, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), model)
    if name == "chat_template.jinja":
        (model / name).write_text("{{ messages }}")
    assert (model / name).is_file(), sorted(p.name for p in model.iterdir())
    locked = str(model / name)
    real_open = io.open

    def refusing_open(file, *args, **kwargs):
        if os.fspath(file) == locked if isinstance(file, (str, os.PathLike)) else False:
            raise PermissionError(errno.EACCES, "Permission denied", locked)
        return real_open(file, *args, **kwargs)

    (model / name).chmod(0)  # refused for a normal user; root needs the simulation below
    monkeypatch.setattr(io, "open", refusing_open)
    monkeypatch.setattr("builtins.open", refusing_open)
    try:
        code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    finally:
        (model / name).chmod(0o644)
    assert_clean_failure(code, output, tmp_path / "moe", [w.replace("{m}", str(model)) for w in words])


# ---------------------------------------------------------------------------------------------
# Model references that point at the wrong kind of thing.


@pytest.mark.parametrize("case", ["weights-file", "config-file", "relative-file", "broken-weights-link"])
def test_model_reference_of_the_wrong_kind(case, tiny_llama, tmp_path, monkeypatch):
    model = tmp_path / "my model é"  # spaces and non-ASCII in the path
    shutil.copytree(tiny_llama, model)
    ref = {"weights-file": model / "model.safetensors", "config-file": model / "config.json",
           "relative-file": Path("my model é") / "model.safetensors", "broken-weights-link": model}[case]
    monkeypatch.chdir(tmp_path)
    if case == "broken-weights-link":  # an interrupted hub download leaves links to missing blobs
        (model / "model.safetensors").unlink()
        (model / "model.safetensors").symlink_to(tmp_path / "blobs" / "0123abcd")
        words = [f"base_model: {model} has no model.safetensors",
                 f"model.safetensors is a link to {tmp_path}/blobs/0123abcd, which does not exist",
                 "download it again"]
    else:
        words = [f"base_model: model '{ref}' is a file, not a model folder",
                 f"give the folder that holds its config.json and weights ({model})"]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(GOOD.replace("{base}", f'"{ref}"'), encoding="utf-8")  # a recipe is UTF-8, whatever the locale
    code, output = cli("build", cfg, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", words)


# ---------------------------------------------------------------------------------------------
# Weights that hold no layer under the names the family uses.


def _rename_all(model: Path, rename) -> None:
    state = load_file(str(model / "model.safetensors"))
    save_file({rename(k): v for k, v in state.items()}, str(model / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("case,words", [
    ("wrapped", ["none of its 21 tensors is named like a LlamaForCausalLM layer",
                 "it holds e.g. 'language_model.model.layers.0.", "give the checkpoint of the language model itself"]),
    ("headless", ["none of its 21 tensors is named like a LlamaForCausalLM layer", "it holds e.g. 'layers.0."]),
    ("no-tensors", ["its weight files hold no tensors at all"]),
    ("empty-index", ["model.safetensors.index.json: its weight_map lists no tensors", "re-download"]),
    ("index-names-bin", ["model.safetensors.index.json: tensor 'model.norm.weight' is mapped to 'pytorch_model.bin', "
                         "but a safetensors index names only *.safetensors files"]),
    ("bin-index-names-safetensors", ["pytorch_model.bin.index.json: tensor 'model.norm.weight' is mapped to "
                                     "'model-00001-of-00001.safetensors', but a pytorch_model.bin index names only PyTorch files"]),
])
def test_weights_without_family_layer_names(case, words, tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    if case == "wrapped":  # a multimodal checkpoint's language model under a prefix
        _rename_all(model, lambda k: "language_model." + k)
    elif case == "headless":  # LlamaModel.save_pretrained: no "model." prefix
        _rename_all(model, lambda k: k.removeprefix("model."))
    elif case == "no-tensors":
        (model / "model.safetensors").write_bytes(struct.pack("<Q", 8) + b"{}      ")
    elif case == "empty-index":
        (model / "model.safetensors").unlink()
        (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    else:  # an index naming a file the other loader reads (transformers would fail on it)
        stored = "pytorch_model.bin" if case == "index-names-bin" else "model-00001-of-00001.safetensors"
        index = "model.safetensors.index.json" if case == "index-names-bin" else "pytorch_model.bin.index.json"
        shutil.move(model / "model.safetensors", model / stored)
        (model / index).write_text(json.dumps({"weight_map": {"model.norm.weight": stored}}))
    code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    if not case.endswith(("index", "-bin", "-safetensors")):
        words = [f"base_model ({model}): {words[0]}", *words[1:]]
    assert_clean_failure(code, output, tmp_path / "moe", words)
    assert "no the tensor" not in output


# ---------------------------------------------------------------------------------------------
# Output names near the filesystem's 255-byte limit: the lock and staging names beside them are longer.


@pytest.mark.parametrize("name", ["x" * 250, "模型" * 42, "x" * 255], ids=["250-ascii", "252-utf8", "255-ascii"])
def test_output_name_near_the_length_limit(name, tiny_llama, tmp_path):
    parent = tmp_path / "out"
    parent.mkdir()
    cfg = _recipe(tmp_path, tiny_llama)
    for args in ([], ["--force"]):  # a new folder, then a rebuild over it
        code, output = cli("build", cfg, parent / name, *args)
        assert code == 0, output
        assert [p.name for p in parent.iterdir()] == [name]  # no lock, staging or swap folder left
        assert json.loads((parent / name / "config.json").read_text())["num_local_experts"] == 2


# ---------------------------------------------------------------------------------------------
# config.json's transformers_weights names the weight file (transformers 4.57 and 5 obey it).


def test_transformers_weights_file_is_the_one_read(tiny_llama, tiny_mistral, tmp_path):
    """model.safetensors holds one model, the file config.json names holds another: the MoE is built
    from the named one, as transformers loads it (before: from model.safetensors)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    shutil.copyfile(model / "model.safetensors", model / "consolidated.safetensors")
    state = load_file(str(model / "model.safetensors"))
    save_file({k: v * 0.5 for k, v in state.items()}, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "transformers_weights": "consolidated.safetensors"}))
    out = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, model), out)
    assert code == 0, output
    assert "transformers_weights" not in json.loads((out / "config.json").read_text())
    assert_close_rel(model_logits(out), model_logits(model))  # the MoE of identical experts = the dense model
    assert_close_rel(model_logits(out), model_logits(tiny_llama))  # ... whose weights are consolidated's


@pytest.mark.parametrize("value,words", [
    ("missing.safetensors", ["transformers_weights names missing.safetensors, which is missing from"]),
    ("../model.safetensors", ["transformers_weights is '../model.safetensors', which is not a file name in"]),
    ("pytorch_model.bin", ["transformers_weights is 'pytorch_model.bin'; transformers loads only a *.safetensors"]),
    (5, ["transformers_weights must be a file name such as \"model.safetensors\", got 5; fix or remove the field"]),
    ("dcp", ["holds distributed-checkpoint shards (shard-00000-model-00001-of-00001.safetensors)",
             "transformers 5 loads instead of the usual weight files"]),
])
def test_weight_file_named_elsewhere_refused(value, words, tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    if value == "dcp":
        shutil.copyfile(model / "model.safetensors", model / "shard-00000-model-00001-of-00001.safetensors")
    else:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "transformers_weights": value}))
    code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", words)


# ---------------------------------------------------------------------------------------------
# A hub id whose local cache holds only part of the model (offline: nothing is downloaded).


def test_hub_id_with_partial_cache_says_what_to_download(tiny_llama, tmp_path, monkeypatch):
    """`hf download org/tiny config.json` (what `plan --from-config` needs) caches no weights."""
    import huggingface_hub.constants


    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    shutil.copyfile(tiny_llama / "config.json", snapshot / "config.json")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(GOOD.replace("{base}", "org/tiny"))
    code, output = cli("build", cfg, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [
        f"base_model: {snapshot} has no model.safetensors", "the Hugging Face cache holds only part of org/tiny",
        "download org/tiny"])


# ---------------------------------------------------------------------------------------------
# route --plot: refused before the routing work when the path cannot take an image or is an input.


@pytest.fixture(scope="module")
def routed_moe(tiny_llama, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("routed")
    code, output = cli("build", _recipe(folder, tiny_llama), folder / "moe")
    assert code == 0, output
    return folder / "moe"


@pytest.mark.parametrize("where,words", [
    ("prompts", ["--plot {p}: .txt is not an image format"]),
    ("same-prompts-png", ["--plot {p}: that is an input of this command; it is never overwritten"]),
    ("model-config", ["--plot {p}: .json is not an image format"]),
    ("model-folder", ["--plot {p}: is a folder; give an image file name"]),
    ("no-suffix", ["--plot {p}: the name has no suffix; end the name with", ".png"]),
    ("missing-parent", ["--plot {p}: folder {parent} does not exist"]),
])
def test_route_plot_path_refused_before_work(where, words, routed_moe, tmp_path):
    prompts = tmp_path / ("prompts.png" if where == "same-prompts-png" else "prompts.txt")
    prompts.write_text("Once upon a time\nThe cat sat on the mat\n")
    plot = {"prompts": prompts, "same-prompts-png": prompts, "model-config": routed_moe / "config.json",
            "model-folder": routed_moe, "no-suffix": tmp_path / "routing",
            "missing-parent": tmp_path / "nowhere" / "r.png"}[where]
    before = {p: p.read_bytes() for p in [prompts, *routed_moe.iterdir()]}
    code, output = cli("route", routed_moe, "--prompts", prompts, "--plot", plot)
    assert_clean_failure(code, output, tmp_path / "no-target",
                         [w.format(p=plot, parent=plot.parent) for w in words])
    assert {p: p.read_bytes() for p in [prompts, *routed_moe.iterdir()]} == before
    assert not list(tmp_path.glob("*.png")) or where == "same-prompts-png"


def test_route_plot_never_overwrites_a_file_without_force(routed_moe, tmp_path):
    """An existing file at --plot is the user's: refused before the routing work, replaced only with --force
    (a whole new image, with the old file's permissions), and no temporary file is left beside it."""
    pytest.importorskip("matplotlib")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe cat sat on the mat\n")
    plot = tmp_path / "figure.png"
    plot.write_bytes(b"my own figure")
    plot.chmod(0o600)
    code, output = cli("route", routed_moe, "--prompts", prompts, "--plot", plot)
    assert_clean_failure(code, output, tmp_path / "no-target",
                         [f"--plot {plot}: file exists; pass --force to replace it or choose another path"])
    assert plot.read_bytes() == b"my own figure"
    code, output = cli("route", routed_moe, "--prompts", prompts, "--plot", plot, "--force")
    assert code == 0, output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_mode & 0o777 == 0o600
    svg = tmp_path / "figure.svg"  # the format follows the target's suffix, not the temporary file's
    code, output = cli("route", routed_moe, "--prompts", prompts, "--plot", svg)
    assert code == 0, output
    assert b"<svg" in svg.read_bytes()[:400]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.png", "figure.svg", "prompts.txt"]


def test_route_plot_write_failure_leaves_nothing(routed_moe, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    plot = tmp_path / "figure.png"
    plot.write_bytes(b"my own figure")

    def full(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    code, output = cli("route", routed_moe, "--prompts", prompts, "--plot", plot, "--force")
    assert_clean_failure(code, output, tmp_path / "no-target",
                         [f"--plot {plot}: cannot write it (No space left on device); nothing was written"])
    assert plot.read_bytes() == b"my own figure"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.png", "prompts.txt"]


def test_write_file_never_takes_a_users_file_for_its_temporary(tmp_path):
    """The old temporary name of `prompts grow` (.NAME.tmp) was a fixed name: a file of the user's with that name
    was overwritten, then deleted. The temporary file is now a fresh one, and a target that appears meanwhile
    is not replaced without `replace`."""
    from moe_upcycle.checkpoint.output_file import write_file

    (tmp_path / ".out.yaml.tmp").write_text("mine")
    write_file(tmp_path / "out.yaml", lambda tmp: tmp.write_text("new"), replace=False)
    assert (tmp_path / "out.yaml").read_text() == "new" and (tmp_path / ".out.yaml.tmp").read_text() == "mine"
    assert oct((tmp_path / "out.yaml").stat().st_mode & 0o777) == oct(0o666 & ~_umask())

    def late(tmp):  # a file made at the target while the command worked
        tmp.write_text("newer")
        (tmp_path / "out.yaml").write_text("theirs")
    with pytest.raises(FileExistsError):
        write_file(tmp_path / "out.yaml", late, replace=False)
    assert (tmp_path / "out.yaml").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.yaml.tmp", "out.yaml"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------------------------------------
# prompts grow -o: never another input, never a folder, no temporary file left on failure.


GROW_CONFIG = ("base_model: x\ngate_mode: random\nexperts:\n  - source_model: x\n    name: a\n"
               "    positive_prompts_from: a_prompts.txt\n  - source_model: x\n    name: b\n"
               "    positive_prompts: [world]\n")


@pytest.mark.parametrize("target,words", [
    ("pool.txt", ["that is an input of this command", "never overwritten, even with --force"]),
    ("a_prompts.txt", ["that is an input of this command (a_prompts.txt)"]),
    ("folder", ["is a folder; give the path of the YAML file to write"]),
    ("unwritable.yaml", ["cannot write it (No space left on device); nothing was changed"]),
])
def test_grown_config_output_refused(target, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(GROW_CONFIG)
    (tmp_path / "a_prompts.txt").write_text("hello there\n")
    (tmp_path / "pool.txt").write_text("one\ntwo\n")
    (tmp_path / "folder").mkdir()
    before = _snapshot(tmp_path)
    if target == "unwritable.yaml":
        def full(src, dst):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OutputError) as err:
        write_grown_config(tmp_path / "cfg.yaml", {"b": ["new prompt"]}, output=tmp_path / target, force=True,
                           inputs=[tmp_path / "pool.txt"])
    assert str(err.value).startswith(f"-o {tmp_path / target}: ") and all(w in str(err.value) for w in words)
    assert _snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["cfg.yaml", "a_prompts.txt", "pool.txt", "folder"])


def test_multimodal_config_named(tiny_llama, tmp_path):
    """A multimodal config.json (the language model under text_config) is named as such, not as missing fields."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    text = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": text,
                                                   "architectures": ["LlavaForConditionalGeneration"]}))
    code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [
        f"{model}/config.json: describes a 'llava' model whose language model is under text_config",
        "give that checkpoint"])


@pytest.mark.parametrize("depth", [1, 3])
def test_output_path_through_a_file(depth, tiny_llama, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    target = tmp_path.joinpath("notes.txt", *["sub"] * (depth - 1), "moe")
    code, output = cli("build", _recipe(tmp_path, tiny_llama), target)
    assert_clean_failure(code, output, tmp_path / "moe",
                         [f"{tmp_path}/notes.txt is a file, not a folder, so the output cannot go under it"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name,words", [
    ("moe_upcycle.json", ["moe_upcycle.json: cannot read it (Permission denied)"]),
    ("README.md", ["README.md: cannot read it (Permission denied); its sha256 was not checked"]),
    ("model-00001-of-00001.safetensors", ["model-00001-of-00001.safetensors: cannot read it (Permission denied)"]),
])
def test_verify_names_an_unreadable_file(name, words, routed_moe, tmp_path, monkeypatch):
    folder = tmp_path / "moe"
    shutil.copytree(routed_moe, folder)
    locked = str(folder / name)
    real_open = io.open

    def refusing_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == locked:
            raise PermissionError(errno.EACCES, "Permission denied", locked)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", refusing_open)
    monkeypatch.setattr("builtins.open", refusing_open)
    code, output = cli("verify", folder)
    assert code == 1 and "Traceback" not in output, output
    assert all(w in _flat(output) for w in words), output


# ---------------------------------------------------------------------------------------------
# A hand-edited or damaged moe_upcycle.json / index: named by verify, never a traceback, never a read outside
# the folder; route falls back to expert_N names; build --force does not take the folder for ours.


@pytest.mark.parametrize("edit,words", [
    (lambda m: [1, 2], ["moe_upcycle.json: it is a JSON list, not an object"]),
    (lambda m: None, ["moe_upcycle.json: it is a JSON null, not an object"]),
    (lambda m: {**m, "config": 3}, ["moe_upcycle.json: config is a JSON number, not an object"]),
    (lambda m: {**m, "sha256": ["config.json"]}, ["moe_upcycle.json: sha256 is a JSON list"]),
    (lambda m: {**m, "sha256": {"config.json": 5}}, ["sha256 of 'config.json' is 5, not a sha256 hex digest"]),
    (lambda m: {**m, "sha256": {"../../etc/passwd": "0" * 64}},
     ["sha256 names '../../etc/passwd', which is not a file name in the folder"]),
    (lambda m: {**m, "sha256": {"/dev/zero": "0" * 64}}, ["sha256 names '/dev/zero', which is not a file name"]),
], ids=["list", "null", "config-number", "sha256-list", "digest-number", "parent-path", "device-path"])
def test_damaged_manifest_is_named_by_every_command(edit, words, routed_moe, tiny_llama, tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(routed_moe, folder)
    manifest = folder / "moe_upcycle.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    before = _snapshot(folder)
    code, output = cli("verify", folder, "--device", "cpu")
    assert code == 1 and "Traceback" not in output, output
    assert all(w in _flat(output) for w in words + ["rebuild the model or delete the file"]), output
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    code, output = cli("route", folder, "--prompts", prompts, "--json", "--device", "cpu")
    assert code == 0, output
    assert json.loads(output[output.index("{"):])["experts"] == ["expert_0", "expert_1"]
    code, output = cli("build", _recipe(tmp_path, tiny_llama), folder, "--force")
    assert code == 1 and "its moe_upcycle.json is not a manifest a moe-upcycle build wrote" in _flat(output), output
    assert _snapshot(folder) == before


def test_manifest_without_a_config_is_checked_without_the_recipe(routed_moe, tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(routed_moe, folder)
    manifest = folder / "moe_upcycle.json"
    data = json.loads(manifest.read_text())
    del data["config"]
    manifest.write_text(json.dumps(data))
    code, output = cli("verify", folder, "--device", "cpu")
    assert "moe_upcycle.json: it records no config; checks without the recipe" in _flat(
        output), output
    assert "Traceback" not in output and "'config'" not in output


@pytest.mark.parametrize("change,words", [
    ({"num_local_experts": "two"}, ["config.json: num_local_experts is 'two', not a number of experts"]),
    ({"num_local_experts": -2}, ["config.json: num_local_experts is -2, not a number of experts"]),
    ({"num_experts_per_tok": 5}, ["config.json: num_experts_per_tok is 5, but each token must go to 1 to 2 experts"]),
    ({"num_experts_per_tok": 0}, ["config.json: num_experts_per_tok is 0, but each token must go to 1 to 2 experts"]),
    ({"num_local_experts": 0}, ["is a dense model", "gives no number of experts"]),
], ids=["count-text", "count-negative", "top-k-above-count", "top-k-zero", "count-zero"])
@pytest.mark.parametrize("command", ["verify", "route"])
def test_impossible_expert_counts_in_a_built_config_are_named(command, change, words, routed_moe, tmp_path):
    """Before, route crashed in the forward pass (RuntimeError: selected index k out of range) and both
    commands called a folder with num_local_experts "two" dense ("has no num_local_experts")."""
    folder = tmp_path / "moe"
    shutil.copytree(routed_moe, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    extra = ["--prompts", prompts] if command == "route" else []
    code, output = cli(command, folder, *extra, "--device", "cpu")
    assert code == 1 and "Traceback" not in output, output
    assert all(w in _flat(output) for w in words), output


@pytest.mark.parametrize("index,words", [
    ("not json", ["model.safetensors.index.json: not a valid index (needs a weight_map object)"]),
    ("[1]", ["model.safetensors.index.json: not a valid index (needs a weight_map object)"]),
    ('{"weight_map": [1]}', ["not a valid index (needs a weight_map object): weight_map is a list"]),
    ('{"weight_map": {"model.norm.weight": 5}}', ["tensor 'model.norm.weight' is mapped to 5, which is not a file name"]),
    ('{"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}',
     ["tensor 'model.norm.weight' is mapped to '../elsewhere.safetensors', which is not a file name in the model folder"]),
    ('{"weight_map": {"model.norm.weight": "/dev/zero"}}',
     ["tensor 'model.norm.weight' is mapped to '/dev/zero', which is not a file name in the model folder"]),
], ids=["not-json", "list", "weight-map-list", "file-number", "parent-path", "device-path"])
def test_verify_reads_a_damaged_index_as_the_loaders_do(index, words, routed_moe, tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(routed_moe, folder)
    (folder / "model.safetensors.index.json").write_text(index)
    (tmp_path / "elsewhere.safetensors").write_bytes(b"\0" * 64)
    code, output = cli("verify", folder, "--device", "cpu", "--skip-hashes")
    assert code == 1 and "Traceback" not in output, output
    assert all(w in _flat(output) for w in words), output


# ---------------------------------------------------------------------------------------------
# demo DIR rerun: the demo's own dense/ and moe/ are rewritten only while they hold only its files.


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("demo") / "demo_out"
    code, output = cli("demo", folder)
    assert code == 0, output
    return folder


@pytest.mark.parametrize("where", ["moe/notes.txt", "dense/notes.txt", "moe/eval/", "clean"])
def test_demo_rerun_keeps_user_files_in_its_parts(where, demo_folder, tmp_path):
    folder = tmp_path / "demo_out"
    shutil.copytree(demo_folder, folder)
    if where.endswith("/"):
        (folder / where).mkdir()
        (folder / where / "scores.json").write_text("{}")
    elif where != "clean":
        (folder / where).write_text("my notes")
    before = _snapshot(folder)
    code, output = cli("demo", folder)
    if where == "clean":
        assert code == 0, output
        return
    part, _, name = where.partition("/")
    assert code == 1 and "Traceback" not in output, output
    assert f"demo folder {folder} is a previous demo's, but {part}/ also holds {name}" in _flat(output), output
    assert _snapshot(folder) == before


def test_model_folder_of_symlinks_builds_from_the_linked_files(tiny_mistral, tmp_path):
    """A Hugging Face cache snapshot is a folder of links into blobs/: every file is read through its link."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(tiny_mistral.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    out = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, snapshot), out)
    assert code == 0, output
    assert_close_rel(model_logits(out), model_logits(tiny_mistral))
    assert all(p.is_file() and not p.is_symlink() for p in out.iterdir())  # the output holds files, not links


def test_quantized_checkpoint_says_to_use_the_unquantized_release(tiny_llama, tmp_path):
    """bitsandbytes/GPTQ-style checkpoints pack weights into integer tensors and say so in config.json."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    state = load_file(str(model / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64, dtype=torch.uint8)  # packed 4-bit pairs
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    code, output = cli("build", _recipe(tmp_path, model), tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [
        f"{model}/config.json: quantization_config says the weights are quantized (bitsandbytes)",
        "upcycle the model's unquantized (bf16, fp16 or fp32) release"])


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "F4"])
def test_low_precision_dtype_names_the_unquantized_release(dtype, tmp_path):
    raw = json.dumps({"w": {"dtype": dtype, "shape": [8], "data_offsets": [0, 8]}}).encode()
    file = tmp_path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(SourceError, match=f"tensor 'w' has dtype '{dtype}', which moe-upcycle does not read .* a "
                                          f"quantized checkpoint: upcycle the model's unquantized"):
        read_safetensors_header(file)


@pytest.mark.parametrize("err", ["EACCES", "EROFS"])
def test_unwritable_output_parent_refused_before_work(err, tiny_llama, tmp_path, monkeypatch):
    """A read-only parent folder (permissions, or a read-only filesystem) stops the build at its first
    write, the lock file beside the target, before the gates or any tensor work."""
    import moe_upcycle.build
    import moe_upcycle.checkpoint.output_dir as output_dir

    parent = tmp_path / "ro"
    parent.mkdir()
    real_open = os.open
    code_no = getattr(errno, err)

    def refusing(path, flags, *args, **kwargs):
        if Path(path).parent == parent and flags & os.O_CREAT:
            raise OSError(code_no, os.strerror(code_no), str(path))
        return real_open(path, flags, *args, **kwargs)

    def no_gates(*args, **kwargs):
        raise AssertionError("the gates were computed before the output was found unwritable")

    monkeypatch.setattr(output_dir.os, "open", refusing)
    monkeypatch.setattr(moe_upcycle.build, "compute_gate_rows", no_gates)
    code, output = cli("build", _recipe(tmp_path, tiny_llama), parent / "moe")
    assert_clean_failure(code, output, parent / "moe", [
        f"cannot create the lock file {parent}/.moe.lock ({os.strerror(code_no)}); the folder {parent} must be "
        f"writable and searchable by you (ls -ld {parent}), or choose another output folder"])


@pytest.mark.parametrize("fixture", ["tiny_qwen2", "tiny_qwen3"])
def test_window_on_some_layers_only(fixture, request, tmp_path):
    """use_sliding_window with max_window_layers 1 of 2 (no layer_types): layer 0 full, layer 1 sliding.
    Qwen2-MoE writes that per layer and reproduces the dense logits; Qwen3-MoE (one window for every
    layer, and the only output with q/k norms) is refused, saying why."""
    model = tmp_path / "model"
    shutil.copytree(request.getfixturevalue(fixture), model)
    config = json.loads((model / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(sliding_window=4, use_sliding_window=True, max_window_layers=1)
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "moe"
    code, output = cli("build", _recipe(tmp_path, model), out)
    if fixture == "tiny_qwen3":
        assert_clean_failure(code, output, out, [
            "qwen3_moe: the base slides its attention window on 1 of its 2 layers only (from layer 1), but "
            "Qwen3-MoE applies one window to every layer"])
        return
    assert code == 0, output
    assert json.loads((out / "config.json").read_text())["layer_types"] == ["full_attention", "sliding_attention"]
    assert_close_rel(model_logits(out), model_logits(model))


def test_grown_config_in_place_write_failure_names_in_place(tmp_path, monkeypatch):
    """`prompts grow --in-place` names --in-place when the write fails (before: "-o cfg.yaml", an option not given)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(GROW_CONFIG)
    (tmp_path / "a_prompts.txt").write_text("hello there\n")
    before = _snapshot(tmp_path)

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OutputError) as err:
        write_grown_config(tmp_path / "cfg.yaml", {"b": ["new prompt"]}, in_place=True)
    assert str(err.value) == (f"--in-place {tmp_path / 'cfg.yaml'}: cannot write it (No space left on device); "
                              f"nothing was changed")
    assert _snapshot(tmp_path) == before
