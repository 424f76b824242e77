"""Texts into batches for a base model's forward pass: tokenize them (`Encoded`: ids and which tokens count), pad
a batch, and put its inputs on the device in one copy (`Inputs`, whose `Batch` is what a layer's hook sees).

Both models that run texts use it: the streamed base of the gates (`stream.StreamedModel`) and the built MoE that
``route`` loads, so both see the same tokens, the same padding and the same positions.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from moe_upcycle.errors import (ConfigError, SourceError, UpcycleError, UpcycleWarning,
                                reraise_if_out_of_memory)
from moe_upcycle.inputs.text import check_texts
from moe_upcycle.recipe.calibration import CALIBRATION_WINDOW


def load_tokenizer(path: Path):
    """The base model's tokenizer alone (seconds before its weights would load), pad token set in memory.

    Raises:
        SourceError: it does not load.
    """
    tokenizer = open_tokenizer(path, lambda exc: SourceError(
        f"base_model: loading the tokenizer of {path} for hidden-state gates failed ({type(exc).__name__}: {exc}); "
        f"use gate_mode: random, or add the tokenizer files"))
    if tokenizer.pad_token is None:  # in memory only; the saved tokenizer is copied unmodified
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
    return tokenizer


def open_tokenizer(path: Path, failed: Callable[[Exception], UpcycleError]):
    """``AutoTokenizer.from_pretrained(path)``; a tokenizer that does not load raises ``failed(exc)`` (a memory
    error stays one: a file that did not fit is not a damaged file)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        reraise_if_out_of_memory(exc)
        raise failed(exc) from None


def context_length(path: Path) -> int:
    """How many tokens of a text the base model reads: config.json's max_position_embeddings (4096 without one),
    known before its weights load."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 4096


def encode(tokenizer, texts: list[str], max_length: int, where: str = "prompt",
           fields: Optional[list[str]] = None) -> list[Encoded]:
    """Tokenize texts with the tokenizer's special tokens; mark real (non-special) tokens.

    Args:
        fields: the recipe field each text comes from (``experts[1].positive_prompts``), for the message.

    Raises:
        ConfigError: every text that has no real token, each named with its field.
    """
    check_texts(texts, where)
    special = set(tokenizer.all_special_ids)
    out, problems = [], []
    for k, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
        if len(ids) >= max_length:  # cut at the model's context: say so (the full count costs one more pass)
            full = len(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
            if full > max_length:
                field = f"{fields[k]}: " if fields else ""
                warnings.warn(f"{field}{where} {text[:40]!r}... has {full} tokens; only its first {max_length} (the "
                              f"model's max_position_embeddings) are used", UpcycleWarning, stacklevel=2)
        real = tuple(i not in special for i in ids)
        if not any(real) and not text.strip():  # mergekit's empty "default expert" prompt: the BOS token alone
            ids = ids or ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else [])
            real = (True,) * len(ids)
        if not any(real):
            field = f"{fields[k]}: {where}" if fields else where
            problems.append(f"{field} {text!r} has no tokens besides special tokens ({tokenizer.convert_ids_to_tokens(ids)} "
                            f"with the base model's tokenizer); write some text, e.g. a sentence of what this expert "
                            f"should see" + (" (or build with --mergekit, which computes the routers as mergekit-moe "
                                             "does, special tokens included)" if fields else ""))
        out.append(Encoded(tuple(ids), real))
    if problems:
        raise ConfigError(*problems)
    return out


def encode_windows(tokenizer, docs: list[str], window: int = CALIBRATION_WINDOW) -> list[Encoded]:
    """Tokenize documents and cut them into windows of `window` real tokens, each with the leading
    special tokens (BOS) the tokenizer puts before a text."""
    check_texts(docs, "calibration document")
    special = set(tokenizer.all_special_ids)
    out = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=True, verbose=False)["input_ids"]  # windowed below
        head = []
        for i in ids:
            if i not in special:
                break
            head.append(i)
        body = [i for i in ids[len(head):] if i not in special]
        for start in range(0, len(body), window):
            chunk = body[start:start + window]
            out.append(Encoded(tuple(head + chunk), (False,) * len(head) + (True,) * len(chunk)))
    return out


def padding_id(tokenizer, num_embeddings: int) -> int:
    """The id to pad batches with: the tokenizer's pad token, else 0; 0 too when the pad token was added past the
    model's embedding rows (pad positions are masked, so any row will do, but one past the end is an index error)."""
    pad_id = tokenizer.pad_token_id
    return pad_id if isinstance(pad_id, int) and 0 <= pad_id < num_embeddings else 0


def pad_batch(rows: list[Encoded], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, real) each (B, T), padded on `side`."""
    width = max(len(r.ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, r in enumerate(rows):
        n = len(r.ids)
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[b, cols] = torch.tensor(r.ids)
        attn[b, cols] = 1
        real[b, cols] = torch.tensor(r.real)
    return ids, attn, real


def on_device(rows: list[int], ids: torch.Tensor, attn: torch.Tensor, real: torch.Tensor,
              row_values: Optional[torch.Tensor], device: torch.device) -> "Inputs":
    """The batch's inputs on `device`, packed into one int64 buffer on the host and copied once."""
    n = ids.numel()
    positions = (attn.cumsum(1) - 1).clamp_min(0)  # the same positions whatever the padding
    parts = [ids.flatten(), attn.flatten(), positions.flatten(), real.flatten().long()]
    if row_values is not None:
        parts.append(row_values[rows].long())
    packed = to_device(torch.cat(parts), device)
    shape = ids.shape
    values = packed[4 * n:] if row_values is not None else None
    batch = Batch(rows, packed[3 * n:4 * n].view(shape).bool(), values)
    return Inputs(packed[:n].view(shape), packed[n:2 * n].view(shape), packed[2 * n:3 * n].view(shape), batch)


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """Copy a small CPU tensor to `device` without making the host wait for the GPU's queue.

    A copy from pageable memory synchronises the stream; from pinned memory it is queued like a kernel.
    """
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def batch_on(copies: dict, device: torch.device) -> "Batch":
    """The batch on `device`, from `copies` (device -> Batch, the input device's first): a layer on another device
    (a device_map spread) gets a device-to-device copy, made once per batch and device."""
    batch = copies.get(device)
    if batch is None:
        batch = copies[device] = next(iter(copies.values())).to(device)
    return batch


@dataclass(frozen=True)
class Encoded:
    """One tokenized text; `real` marks tokens that count in averages (not special, not padding)."""

    ids: tuple[int, ...]
    real: tuple[bool, ...]


@dataclass
class Batch:
    """One batch as a layer's hook sees it, on that layer's device."""

    rows: list[int]  # indices of the batch's texts
    real: torch.Tensor  # (B, T) bool: the tokens that count
    values: Optional[torch.Tensor]  # (B,) the row_values given for these texts (`StreamedModel.run`), if any

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.rows, self.real.to(device),
                     None if self.values is None else self.values.to(device))


@dataclass
class Inputs:
    """The forward pass's inputs of one batch, views of one buffer on the input device."""

    ids: torch.Tensor
    attn: torch.Tensor
    positions: torch.Tensor
    batch: Batch
