"""Sources that are not a dense Hugging Face checkpoint, named for what they are (checkpoint/quantized.py).

Published repos that people point a recipe at by mistake: a quantized release whose config.json lost
its quantization_config (GPTQ, AWQ, bitsandbytes 4- and 8-bit, compressed-tensors), Meta's and
Mistral's native weights, a GGUF file or a folder of them, a PEFT adapter folder or file. Each is
refused with exit 1, no output folder, and a message that names the folder / file / tensor, says
what it is and what to give instead — not a plan error about "biases" or missing projections.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from failure_checks import cli
from tf4_logits import NO_TF4, TF4_PYTHON, tf4_logits, tf5_logits

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized(kind: str):
    """A state-dict edit that stores each projection as `kind`'s tensors (names and dtypes as saved)."""
    def edit(state: dict) -> dict:
        out = {}
        for key, w in state.items():
            module = key[: -len(".weight")]
            if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in PROJ:
                out[key] = w
                continue
            rows, cols = w.shape
            if kind in ("gptq", "awq"):
                out[f"{module}.qweight"] = torch.zeros(cols // 8, rows, dtype=torch.int32)
                out[f"{module}.qzeros"] = torch.zeros(1, rows // 8, dtype=torch.int32)
                out[f"{module}.scales"] = torch.ones(1, rows, dtype=torch.float16)
                if kind == "gptq":
                    out[f"{module}.g_idx"] = torch.zeros(cols, dtype=torch.int32)
            elif kind == "bnb4":
                out[key] = torch.zeros(w.numel() // 2, 1, dtype=torch.uint8)
                out[f"{key}.absmax"] = torch.ones(4)
                out[f"{key}.quant_map"] = torch.ones(16)
                out[f"{key}.quant_state.bitsandbytes__nf4"] = torch.zeros(8, dtype=torch.uint8)
            elif kind == "bnb8":
                out[key] = torch.zeros(rows, cols, dtype=torch.int8)
                out[f"{module}.SCB"] = torch.ones(rows)
            elif kind == "compressed":
                out[f"{module}.weight_packed"] = torch.zeros(rows, cols // 8, dtype=torch.int32)
                out[f"{module}.weight_scale"] = torch.ones(rows, 1, dtype=torch.bfloat16)
        return out
    return edit


QUANTIZED = {  # kind -> (a tensor the message names, the format it names)
    "gptq": ("model.layers.0.mlp.down_proj.g_idx", "GPTQ"),
    "awq": ("model.layers.0.mlp.down_proj.qweight", "GPTQ/AWQ"),
    "bnb4": ("model.layers.0.mlp.down_proj.weight.absmax", "bitsandbytes 4-bit"),
    "bnb8": ("model.layers.0.mlp.down_proj.SCB", "bitsandbytes 8-bit"),
    "compressed": ("model.layers.0.mlp.down_proj.weight_packed", "compressed-tensors"),
}


@pytest.mark.parametrize("kind", sorted(QUANTIZED))
@pytest.mark.parametrize("field", ["base_model", "experts[1].source_model"])
def test_quantized_weights_without_quantization_config_are_named(kind, field, tiny_llama, tmp_path, write_yaml):
    model = tmp_path / kind
    shutil.copytree(tiny_llama, model)
    state = _quantized(kind)(load_file(str(model / "model.safetensors")))
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    base = str(model) if field == "base_model" else str(tiny_llama)
    cfg = {"base_model": base, "gate_mode": "random",
           "experts": [{"source_model": str(tiny_llama)}, {"source_model": str(model)}]}
    code, out = cli("build", write_yaml(cfg), "-o", tmp_path / "out")
    text = " ".join(out.split())
    tensor, fmt = QUANTIZED[kind]
    assert code == 1 and "Traceback" not in text, text
    for words in (f"{field}: {model}: tensor '{tensor}' belongs to quantized weights ({fmt}",
                  "config.json has no quantization_config", "upcycle the model's unquantized (bf16, fp16 or fp32) "
                                                            "release"):
        assert words in text, (words, text)
    assert "plan error" not in text and not (tmp_path / "out").exists()


def _native(folder: Path) -> None:
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(folder / "consolidated.safetensors"))
    (folder / "params.json").write_text(json.dumps({"dim": 4096, "n_layers": 32}))


def _original_pth(folder: Path) -> None:
    (folder / "original").mkdir()
    torch.save({"tok_embeddings.weight": torch.zeros(4, 4)}, folder / "original" / "consolidated.00.pth")


def _adapter(base_name: str):
    def make(folder: Path) -> None:
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                                "base_model_name_or_path": base_name}))
        save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 4)}, str(folder / "adapter_model.safetensors"))
    return make


FOLDERS = {  # what a folder without config.json holds -> the words that say so
    "mistral_native": (_native, ["has no config.json — it holds Meta/Mistral's native format (consolidated.safetensors, "
                                 "params.json)", "give the model's Hugging Face release", "convert_mistral_weights_to_hf.py"]),
    "llama_original": (_original_pth, ["has no config.json — it holds PyTorch .pth files, which transformers does not "
                                         "load as a model", "give the model's Hugging Face release"]),
    "gguf_folder": (lambda f: (f / "model-Q4_K_M.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(24)),
                    ["it holds GGUF file(s) (model-Q4_K_M.gguf), llama.cpp's format", "the GGUF was converted from"]),
    "adapter_named": (_adapter("org/base-7b"), ["it holds a PEFT adapter (adapter_config.json), not a model",
                                                "write MODEL+ADAPTER, e.g. org/base-7b+"]),
    "adapter_unnamed": (_adapter(""), ["write MODEL+ADAPTER: the model the adapter was trained on, a plus sign"]),
    "nothing_known": (lambda f: (f / "notes.txt").write_text("hello"), ["has no config.json; is it a Hugging Face "
                                                                        "model folder?"]),
}


@pytest.mark.parametrize("case", sorted(FOLDERS))
def test_a_folder_that_is_not_a_hugging_face_model_says_what_it_holds(case, tmp_path, write_yaml):
    make, words = FOLDERS[case]
    folder = tmp_path / case
    folder.mkdir()
    make(folder)
    _refused_naming(folder, [f"base_model: {folder} has no config.json", *words], tmp_path, write_yaml)


@pytest.mark.parametrize("name, words", [
    ("model.Q8_0.gguf", ["is a GGUF file (llama.cpp's format), which moe-upcycle does not read",
                         "give the Hugging Face release it was converted from"]),
    ("adapter_model.safetensors", ["is a PEFT adapter's file, not a model", "write MODEL+ADAPTER, e.g. org/base-7b+"]),
    ("adapter_config.json", ["is a PEFT adapter's file, not a model"]),
])
def test_a_gguf_or_adapter_file_given_as_the_model_says_what_to_give(name, words, tmp_path, write_yaml):
    folder = tmp_path / "files"
    folder.mkdir()
    _adapter("org/base-7b")(folder)
    (folder / "model.Q8_0.gguf").write_bytes(b"GGUF" + bytes(28))
    _refused_naming(folder / name, [f"base_model: model '{folder / name}'", *words], tmp_path, write_yaml)


def _refused_naming(base: Path, words: list[str], tmp_path: Path, write_yaml) -> None:
    """A build with `base` as base_model: exit 1, no traceback, every one of `words`, no output folder."""
    code, out = cli("build", write_yaml({"base_model": str(base), "num_experts": 2, "gate_mode": "random"}),
                    "-o", tmp_path / "out")
    text = " ".join(out.split())
    assert code == 1 and "Traceback" not in text, text
    for word in words:
        assert word in text, (word, text)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_decoder_saved_without_its_head_reads_as_transformers_loads_it(fmt, tied, tmp_path, write_yaml):
    """`model.model.save_pretrained(folder)` (a LlamaModel: 'layers.0...', no 'model.' prefix, no lm_head):
    transformers loads it as a LlamaForCausalLM by adding the prefix. Tied, that is the whole model: the MoE
    computes its logits (before: refused as "a multimodal model, or one saved inside a wrapper"). Untied,
    transformers would make up a random head: refused, named."""
    from transformers import AutoModelForCausalLM

    from conftest import model_logits
    from moe_upcycle.checkpoint.tiny import make_dense_model

    dense = make_dense_model(tmp_path / "dense", family="llama", seed=5, tie_word_embeddings=tied)
    bare = tmp_path / "bare"
    AutoModelForCausalLM.from_pretrained(str(dense)).model.save_pretrained(str(bare))
    for f in dense.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, bare)
    weights = load_file(str(bare / "model.safetensors"))
    if fmt == "bin":  # as transformers 4 saved it with safe_serialization=False
        torch.save(weights, bare / "pytorch_model.bin")
        (bare / "model.safetensors").unlink()
    assert "layers.0.mlp.up_proj.weight" in weights and "lm_head.weight" not in weights
    cfg = {"base_model": str(bare), "num_experts": 2, "gate_mode": "random"}
    code, out = cli("build", write_yaml(cfg), "-o", tmp_path / "out")
    text = " ".join(out.split())
    if tied:
        assert code == 0, text
        torch.testing.assert_close(model_logits(tmp_path / "out"), model_logits(dense), rtol=1e-5, atol=1e-5)
    else:
        assert code == 1 and "Traceback" not in text, text
        for words in (f"base_model: {bare} holds a decoder saved without its LM head", "no lm_head.weight",
                      "transformers would give it a random output head", "give the ...ForCausalLM checkpoint"):
            assert words in text, (words, text)
        assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_the_tied_bare_decoder_loads_as_the_causal_lm_in_transformers_4_too(tmp_path):
    """The reading above is what both loaders do: 4.57 and 5 give the bare decoder folder the dense logits."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle.checkpoint.tiny import make_dense_model

    dense = make_dense_model(tmp_path / "dense", family="llama", seed=5, tie_word_embeddings=True)
    bare = tmp_path / "bare"
    AutoModelForCausalLM.from_pretrained(str(dense)).model.save_pretrained(str(bare))
    ids = [1, 5, 9, 3]
    got = tf4_logits(ids, [str(bare), str(dense)])
    assert not isinstance(got[str(bare)], str), got[str(bare)]
    torch.testing.assert_close(torch.tensor(got[str(bare)]), torch.tensor(got[str(dense)]), rtol=0, atol=0)
    torch.testing.assert_close(tf5_logits(bare, ids), tf5_logits(dense, ids), rtol=0, atol=0)


LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a214614ab2935c943f9e0ff69f22eadbb8f32b1258daaa5e2ca24d17e2393\nsize {size}\n")


WEIGHT_LAYOUTS = ["model.safetensors", "a shard of two", "pytorch_model.bin"]


@pytest.mark.parametrize("layout, role", [(layout, role) for layout in WEIGHT_LAYOUTS for role in ("base_model", "expert")]
                         + [("tokenizer.model", "base_model"), ("tokenizer.json", "base_model")])  # the MoE's tokenizer
def test_a_repository_cloned_without_git_lfs_is_named(layout, role, tiny_llama, tmp_path):
    """A hub repo cloned with plain git holds ~130-byte Git LFS pointers where the weights and tokenizer files
    should be. Each is named as such, with the size it stands for and how to fetch the real file; before, a
    safetensors header "claiming 2336927755350992246 bytes", a refused pickle, or (tokenizer.model) a pointer
    copied into the MoE, whose tokenizer would not load. Exit 1, nothing written."""
    from moe_upcycle.checkpoint.tiny import make_dense_model

    folder = tmp_path / "cloned"
    if layout == "a shard of two":
        make_dense_model(folder, seed=0, max_shard_size="60KB")
        victim = sorted(folder.glob("model-*.safetensors"))[-1]
    elif layout == "pytorch_model.bin":
        make_dense_model(folder, seed=0, fmt="bin")
        victim = folder / "pytorch_model.bin"
    else:
        shutil.copytree(tiny_llama, folder)
        victim = folder / layout
    size = victim.stat().st_size if victim.exists() else 499723
    victim.write_text(LFS_POINTER.format(size=size))
    expected = [f"{victim}: is a Git LFS pointer (", f"bytes) to a {size:,}-byte file, not the file itself; "
                f"the repository was cloned without Git LFS. Fetch the real files: `git lfs install && git lfs "
                f"pull` in {folder}"]
    recipe = tmp_path / "moe.yaml"
    base, expert = (folder, tiny_llama) if role == "base_model" else (tiny_llama, folder)
    recipe.write_text(f"base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {expert}\n"
                      f"  - source_model: {tiny_llama}\n")
    code, output = cli("build", recipe, tmp_path / "out")
    flat = " ".join(output.split())
    assert code == 1 and "Traceback" not in flat, flat
    for words in expected:
        assert words in flat, (words, flat)
    assert not (tmp_path / "out").exists()
