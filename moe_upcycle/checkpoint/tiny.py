"""Tiny dense models on disk, for the demo, tests and benchmarks.

`make_dense_model` writes a randomly initialised (seeded) Llama, Mistral, Qwen2, Qwen3, Qwen3.5 (any
AutoConfig model_type) in Hugging Face format with a small trained BPE tokenizer, as safetensors
(single or sharded) or as a ``.bin`` whose tied weights share storage. `make_finetune` writes a
perturbed copy of one, a stand-in for a fine-tune in frankenMoE tests. It is not a model zoo:
shapes are whatever the caller asks for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
TINY_VOCAB = 300
_CORPUS = [
    "def add(a, b):\n    return a + b", "for i in range(10): print(i)", "import numpy as np",
    "The integral of x squared is x cubed over three.", "Solve 2x + 3 = 7 for x.", "What is 12 times 7?",
    "Once upon a time there was a little dragon.", "She sang a song about the sea.",
    "The cat sat on the mat and looked at the moon.", "Hello! How are you today?",
    "Photosynthesis turns light into chemical energy.", "Bonjour, comment allez-vous ?",
]


# transformers 5 loads a qwen3_5* model's tokenizer as Qwen3_5Tokenizer whatever tokenizer_config.json names, and that
# class adds <|endoftext|> (its pad, unk and eos) when the vocabulary lacks it: at id vocab_size, past the embedding
EXTRA_SPECIAL = {"qwen3_5_text": ("<|endoftext|>",)}


def make_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB, extra_special: tuple[str, ...] = ()):
    """Train a small byte-level BPE tokenizer and save it (tokenizer.json + config) into `folder`.

    `extra_special`: special tokens trained in after <unk>, <s>, </s> (ids 3, 4, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))
    return fast


def make_dense_model(
    folder: Path,
    family: str = "llama",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    fmt: str = "safetensors",
    max_shard_size: Optional[str] = None,
    tokenizer: bool = True,
    random_norms_and_biases: bool = False,
    **overrides,
) -> Path:
    """Write a tiny random dense model to `folder` and return it.

    Args:
        family: "llama" or "mistral" (or any AutoConfig model_type with the same MLP).
        seed: init seed (same seed → same weights).
        fmt: "safetensors" or "bin" (``pytorch_model.bin``; tied weights share storage in it).
        max_shard_size: e.g. "20KB" to get a sharded checkpoint with an index.
        random_norms_and_biases: replace the init's constant norm weights (ones) and biases
            (zeros) by seeded random values, so a test can tell a copied norm or bias from a fresh one.
        overrides: config fields replacing TINY_DIMS (e.g. num_hidden_layers=3, attention_bias=True).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dims = {**TINY_DIMS, "vocab_size": TINY_VOCAB, "initializer_range": 0.1, "bos_token_id": 1,
            "eos_token_id": 2, **overrides}
    dims.setdefault("head_dim", dims["hidden_size"] // dims["num_attention_heads"])  # Qwen3's default is 128
    config = AutoConfig.for_model(family, tie_word_embeddings=tie_word_embeddings, **dims)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if random_norms_and_biases:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    if fmt == "bin":
        config.save_pretrained(str(folder))
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(str(folder), **kwargs)
    if tokenizer:
        make_tokenizer(folder, dims["vocab_size"], EXTRA_SPECIAL.get(family, ()))
    return folder


def make_finetune(base: Path, folder: Path, seed: int, scale: float = 0.02, layers: Optional[int] = None) -> Path:
    """Write a copy of the dense model `base` with every tensor perturbed: a stand-in fine-tune.

    Args:
        seed: noise seed (different seeds → different "fine-tunes").
        scale: noise std relative to each tensor's own std (absolute for constant tensors such as norms).
        layers: if given, the copy is made that deep by repeating the base's layers in order
            (a stand-in for a deeper model of the same family, for ``layers:`` slices).
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    base, folder = Path(base), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((base / "config.json").read_text())
    state = load_file(str(base / "model.safetensors"))
    n = config["num_hidden_layers"]
    if layers is not None:
        prefix = "model.layers."
        out = {k: v for k, v in state.items() if not k.startswith(prefix)}
        for k, v in state.items():
            if k.startswith(prefix):
                i, rest = k[len(prefix):].split(".", 1)
                for j in range(int(i), layers, n):
                    out[f"{prefix}{j}.{rest}"] = v.clone()
        state, config["num_hidden_layers"] = out, layers
        if "layer_types" in config:
            config["layer_types"] = [config["layer_types"][j % n] for j in range(layers)]
    gen = torch.Generator().manual_seed(seed)
    for key in sorted(state):
        t = state[key]
        std = float(t.float().std().nan_to_num(0.0)) if t.numel() > 1 else 0.0
        noise = torch.randn(t.shape, generator=gen) * (std or 1.0) * scale  # constant tensors (norms) move too
        state[key] = (t.float() + noise).to(t.dtype).contiguous()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (base / name).is_file():
            shutil.copyfile(base / name, folder / name)
    return folder
