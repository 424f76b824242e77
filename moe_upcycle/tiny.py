"""Tiny dense models on disk, for the demo, tests and benchmarks.

`make_dense_model` writes a randomly initialised (seeded) Llama or Mistral in Hugging Face format
with a small trained BPE tokenizer, as safetensors (single or sharded) or as a ``.bin`` whose tied
weights share storage. It is not a model zoo: shapes are whatever the caller asks for.
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


def make_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB):
    """Train a small byte-level BPE tokenizer and save it (tokenizer.json + config) into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
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
    **overrides,
) -> Path:
    """Write a tiny random dense model to `folder` and return it.

    Args:
        family: "llama" or "mistral" (or any AutoConfig model_type with the same MLP).
        seed: init seed (same seed → same weights).
        fmt: "safetensors" or "bin" (``pytorch_model.bin``; tied weights share storage in it).
        max_shard_size: e.g. "20KB" to get a sharded checkpoint with an index.
        overrides: config fields replacing TINY_DIMS (e.g. num_hidden_layers=3).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dims = {**TINY_DIMS, "vocab_size": TINY_VOCAB, "initializer_range": 0.1, "bos_token_id": 1,
            "eos_token_id": 2, **overrides}
    config = AutoConfig.for_model(family, tie_word_embeddings=tie_word_embeddings, **dims)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    if fmt == "bin":
        config.save_pretrained(str(folder))
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(str(folder), **kwargs)
    if tokenizer:
        make_tokenizer(folder, dims["vocab_size"])
    return folder
