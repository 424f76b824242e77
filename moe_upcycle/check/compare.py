"""Run causal LMs on the same inputs and measure how far apart they are.

`load_causal_lm` loads a saved folder exactly as a user would (``AutoModelForCausalLM`` and
``AutoTokenizer``) and keeps transformers' loading report; `encode_inputs` tokenizes prompts and
text once, so that every compared model is fed the same ids (two folders' tokenizers can load as
different classes in transformers 5, e.g. a ``qwen2`` base as ``Qwen2Tokenizer`` and its
``qwen2_moe`` output as the generic backend); `run_model` records one model's logits on those ids,
its perplexity on the text and its greedy continuations; `compare_logits` gives max |Δlogit|,
top-1 agreement and mean KL(dense‖moe) between two runs. Used by `verify` and the demo.
It decides nothing: thresholds live in `verify`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from moe_upcycle.inputs.text import check_token_ids

MAX_TEXT_TOKENS = 1024  # perplexity text is cut to this (and to the model's max_position_embeddings)


@dataclass
class Loaded:
    """A model loaded with transformers, and what loading it reported."""

    model: Any
    tokenizer: Any
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)

    @property
    def class_name(self) -> str:
        return type(self.model).__name__


@dataclass
class ModelRun:
    """One model's outputs on the shared inputs.

    Attributes:
        logits: per prompt, fp32 on CPU, (T, V).
        text_nll: mean next-token negative log-likelihood on the text (nats), None without text.
        text_tokens: tokens of the text that were scored.
        continuations: greedy continuation of each continuation prompt (new text only).
    """

    logits: list[torch.Tensor]
    text_nll: Optional[float] = None
    text_tokens: int = 0
    continuations: list[str] = field(default_factory=list)

    @property
    def perplexity(self) -> Optional[float]:
        return None if self.text_nll is None else math.exp(self.text_nll)


@dataclass(frozen=True)
class LogitComparison:
    """How far a model's next-token distributions are from a reference's, over every prompt position."""

    max_abs_diff: float
    top1_agreement: float
    mean_kl: float
    max_kl: float
    positions: int


@dataclass
class Inputs:
    """The token ids every compared model is fed, made once with one tokenizer.

    Attributes:
        prompts: per prompt, (1, T) ids with the tokenizer's special tokens, as a user's input.
        text: (1, T) ids of the perplexity text (cut to the context), None without text.
    """

    prompts: list[torch.Tensor]
    text: Optional[torch.Tensor] = None


def encode_inputs(tokenizer, prompts: list[str], text: Optional[str] = None,
                  max_positions: int = MAX_TEXT_TOKENS) -> Inputs:
    """Tokenize prompts and text once (the text cut to `max_positions` and `MAX_TEXT_TOKENS`)."""
    ids = [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]
    limit = min(MAX_TEXT_TOKENS, max_positions)
    text_ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :limit] if text else None
    return Inputs(ids, text_ids)


def load_causal_lm(folder: Path, dtype: Union[torch.dtype, str] = torch.float32, device: str = "cpu") -> Loaded:
    """Load a model folder with AutoModelForCausalLM/AutoTokenizer (eval mode).

    `dtype` "auto" is the folder's own (config.json ``dtype``); the experts implementation is
    whatever transformers picks for the folder (config.json ``experts_implementation``, else its
    default), as for a user who passes nothing.

    Raises:
        Exception: whatever transformers raises for a folder it cannot load (callers report it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    mismatched = [k if isinstance(k, str) else k[0] for k in info.get("mismatched_keys", [])]
    return Loaded(model.to(device).eval(), tokenizer, sorted(info.get("missing_keys", [])),
                  sorted(info.get("unexpected_keys", [])), sorted(mismatched))


def run_model(loaded: Loaded, prompts: list[str], text: Optional[str] = None, continuation_prompts: int = 3,
              max_new_tokens: int = 16, inputs: Optional[Inputs] = None) -> ModelRun:
    """Logits on every prompt, perplexity on `text`, greedy continuations of the first prompts.

    Args:
        loaded: from `load_causal_lm`.
        prompts: sample prompts; each is tokenized with special tokens, as a user's input would be.
        text: scored for perplexity (cut to the model's context and `MAX_TEXT_TOKENS`).
        continuation_prompts: how many of the prompts get a greedy continuation.
        max_new_tokens: length of each continuation.
        inputs: ids from `encode_inputs` (another model's tokenizer); default: this model's own
            tokenizer on `prompts` and `text`.
    """
    model, tok = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    if inputs is None:
        inputs = encode_inputs(tok, prompts, text, int(getattr(model.config, "max_position_embeddings",
                                                                MAX_TEXT_TOKENS)))
    vocab = model.get_input_embeddings().num_embeddings  # ids past it would index out of range
    for ids, prompt in zip(inputs.prompts, prompts):
        check_token_ids(ids, vocab, tok, prompt)
    if inputs.text is not None:
        check_token_ids(inputs.text, vocab, tok, text)
    run = ModelRun(logits=[])
    with torch.inference_mode():
        for ids in inputs.prompts:
            run.logits.append(model(input_ids=ids.to(device)).logits[0].float().cpu())  # (T, V)
        if inputs.text is not None:
            ids = inputs.text.to(device)
            logits = model(input_ids=ids).logits[0].float()  # (T, V)
            run.text_nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()
            run.text_tokens = ids.shape[1]
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        for ids in inputs.prompts[:continuation_prompts]:
            ids = ids.to(device)
            new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, temperature=None, top_p=None, top_k=None)
            run.continuations.append(tok.decode(new[0, ids.shape[1]:], skip_special_tokens=True))
    return run


def compare_logits(reference: list[torch.Tensor], other: list[torch.Tensor]) -> LogitComparison:
    """Compare next-token distributions position by position (KL in float64).

    Args:
        reference: per prompt (T, V) logits of the reference (dense) model.
        other: the same for the model under test.

    Returns:
        max |Δlogit|, the fraction of positions with the same argmax, and the mean and max over
        positions of KL(reference ‖ other).

    Example:
        >>> a = [torch.tensor([[1.0, 2.0, 0.0]])]
        >>> compare_logits(a, a).mean_kl, compare_logits(a, a).top1_agreement
        (0.0, 1.0)
    """
    diffs, agree, kls = [], [], []
    for ref, oth in zip(reference, other, strict=True):
        if ref.shape != oth.shape:
            raise ValueError(f"logit shapes differ: {tuple(ref.shape)} vs {tuple(oth.shape)}")
        diffs.append((ref - oth).abs().max())
        agree.append(ref.argmax(-1) == oth.argmax(-1))
        log_p = torch.log_softmax(ref.double(), -1)
        log_q = torch.log_softmax(oth.double(), -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0))  # (T,)
    kl = torch.cat(kls)
    return LogitComparison(max_abs_diff=float(torch.stack(diffs).max()),
                           top1_agreement=float(torch.cat(agree).float().mean()),
                           mean_kl=float(kl.mean()), max_kl=float(kl.max()), positions=int(kl.numel()))
