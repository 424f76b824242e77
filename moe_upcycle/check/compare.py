"""Run causal LMs on the same inputs and measure how far apart they are.

`load_causal_lm` loads a saved folder exactly as a user would (``AutoModelForCausalLM`` and
``AutoTokenizer``) and keeps transformers' loading report; `encode_inputs` tokenizes prompts and
text once, so that every compared model is fed the same ids (two folders' tokenizers can load as
different classes in transformers 5, e.g. a ``qwen2`` base as ``Qwen2Tokenizer`` and its
``qwen2_moe`` output as the generic backend); `run_model` records one model's logits on those ids,
its perplexity on the text and its greedy continuations, the prompts and the continuations each
run as a batch (a few forward calls, not one per prompt and per new token); `compare_logits` gives
max |Δlogit|, top-1 agreement and mean KL(dense‖moe) between two runs. Used by `verify` and the demo.
It decides nothing: thresholds live in `verify`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from moe_upcycle.check.continuations import continue_from_drafts, eos_ids, usable_draft
from moe_upcycle.checkpoint.lora import Adapter, merge_into_model
from moe_upcycle.errors import reraise_if_out_of_memory
from moe_upcycle.inputs.text import check_token_ids

MAX_TEXT_TOKENS = 1024  # perplexity text is cut to this (and to the model's max_position_embeddings)
PROMPT_BATCH_TOKENS = 512  # padded positions per prompt batch: its (B, T, V) logits are 0.3 GB at a 152k vocabulary


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
        continuation_ids: the same as token ids (1-D each; another model's `drafts`).
    """

    logits: list[torch.Tensor]
    text_nll: Optional[float] = None
    text_tokens: int = 0
    continuations: list[str] = field(default_factory=list)
    continuation_ids: list[torch.Tensor] = field(default_factory=list)

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


def load_causal_lm(folder: Path, dtype: Union[torch.dtype, str] = torch.float32, device: str = "cpu",
                   adapter: Optional[Adapter] = None, overrides: Optional[dict] = None) -> Loaded:
    """Load a model folder with AutoModelForCausalLM/AutoTokenizer (eval mode), `adapter` (a LoRA) merged in.

    `overrides` replace config.json fields as ``from_pretrained(..., key=value)`` does (a training switch
    `verify` has already reported).

    `dtype` "auto" is the folder's own (config.json ``dtype``); the experts implementation is
    whatever transformers picks for the folder (config.json ``experts_implementation``, else its
    default), as for a user who passes nothing.

    Raises:
        Exception: whatever transformers raises for a folder it cannot load (callers report it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises; say it is the tokenizer
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        raise TokenizerLoadError(f"its tokenizer does not load with transformers AutoTokenizer "
                                 f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
                                 + ("; the folder holds no tokenizer.json, tokenizer.model or vocab.json — copy the "
                                    "base model's tokenizer files into it"
                                    if not any((Path(folder) / n).is_file()
                                               for n in ("tokenizer.json", "tokenizer.model", "vocab.json")) else "")
                                 ) from exc
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True,
                                                       **(overrides or {}))
    merge_into_model(model, adapter)
    mismatched = [k if isinstance(k, str) else k[0] for k in info.get("mismatched_keys", [])]
    return Loaded(model.to(device).eval(), tokenizer, sorted(info.get("missing_keys", [])),
                  sorted(info.get("unexpected_keys", [])), sorted(mismatched))


class TokenizerLoadError(Exception):
    """`load_causal_lm` could not load the folder's tokenizer (the weights were not tried)."""


def upcast_to_fp32(model) -> None:
    """Turn a 16-bit model into fp32 in place: the same logits as loading it with ``dtype=torch.float32``.

    bf16/fp16 → fp32 is exact and nothing else about the model depends on the dtype it was loaded
    in, so this replaces a second load. Parameters that are views of a memory-mapped weight file
    (transformers 5 keeps the tensors it does not convert as views of the safetensors mmap, whose
    pages all stay resident once loading has read the file) are converted first: the mapping is
    released before the large copies are made, so memory peaks at the fp32 model, not the fp32
    model plus the file.
    """
    mapped = _mapped_weight_files()
    params = sorted(model.parameters(), key=lambda p: not any(lo <= p.data_ptr() < hi for lo, hi in mapped))
    with torch.no_grad():
        for param in params:  # tied parameters appear once
            if param.is_floating_point():
                param.data = param.data.float()
    model.float()  # the buffers, and the config's dtype


def _mapped_weight_files() -> list[tuple[int, int]]:
    """Address ranges of the safetensors files this process has mapped (Linux; elsewhere none)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[-1].endswith(".safetensors"):
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def run_model(loaded: Loaded, prompts: list[str], text: Optional[str] = None, continuation_prompts: int = 3,
              max_new_tokens: int = 16, inputs: Optional[Inputs] = None,
              drafts: Optional[list[torch.Tensor]] = None) -> ModelRun:
    """Logits on every prompt, perplexity on `text`, greedy continuations of the first prompts.

    The prompts run batched (`prompt_logits`) and the continuations are generated as one batch: a
    few forward calls instead of one per prompt and per new token; each position's logits are
    those of the prompt alone up to float rounding.

    Args:
        loaded: from `load_causal_lm`.
        prompts: sample prompts; each is tokenized with special tokens, as a user's input would be.
        text: scored for perplexity (cut to the model's context and `MAX_TEXT_TOKENS`).
        continuation_prompts: how many of the prompts get a greedy continuation.
        max_new_tokens: length of each continuation.
        inputs: ids from `encode_inputs` (another model's tokenizer); default: this model's own
            tokenizer on `prompts` and `text`. Inputs without text skip the perplexity.
        drafts: another model's continuations of the same prompts (its `ModelRun.continuation_ids`):
            they ride along in the prompt batch, and this model generates only from where its own
            greedy choice departs from them (`continuations.continue_from_drafts`); the result is
            still this model's greedy continuation.
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
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    continued = inputs.prompts[:continuation_prompts] if max_new_tokens > 0 else []
    drafts = [usable_draft(d, max_new_tokens, vocab, eos_ids(model)) for d in (drafts or [])[:len(continued)]]
    run = ModelRun(logits=[])
    with torch.inference_mode():
        drafted = [torch.cat([p, d.view(1, -1)], 1) for p, d in zip(continued, drafts)]
        logits = prompt_logits(model, drafted + inputs.prompts[len(drafted):], device)  # drafted: (T + D, V)
        run.logits = [out[:p.shape[1]] for out, p in zip(logits, inputs.prompts)]
        if inputs.text is not None:
            ids = inputs.text.to(device)
            text_logits = model(input_ids=ids, use_cache=False).logits[0].float()  # (T, V)
            run.text_nll = torch.nn.functional.cross_entropy(text_logits[:-1], ids[0, 1:]).item()
            run.text_tokens = ids.shape[1]
            del text_logits
        run.continuation_ids = continue_from_drafts(model, continued, drafts, logits, max_new_tokens, pad_id, device)
    run.continuations = [tok.decode(ids, skip_special_tokens=True) for ids in run.continuation_ids]
    return run


def prompt_logits(model, prompts: list[torch.Tensor], device, batch_tokens: int = PROMPT_BATCH_TOKENS
                  ) -> list[torch.Tensor]:
    """Each (1, T) prompt's (T, V) logits, fp32 on CPU, from forward calls over right-padded batches.

    Prompts are grouped by length (`_length_batches`) so that a batch holds at most `batch_tokens`
    positions (its (B, T, V) logits are the transient that grows). No
    attention mask is needed: the padding comes after a prompt's last token and attention is
    causal, so no real position sees it, and an MoE routes every token on its own (transformers'
    MoE blocks have no capacity limit), so pad tokens take no expert slot from real ones.
    """
    out: list[Optional[torch.Tensor]] = [None] * len(prompts)
    for batch in _length_batches([p.shape[1] for p in prompts], batch_tokens):
        width = max(prompts[i].shape[1] for i in batch)
        ids = torch.cat([torch.nn.functional.pad(prompts[i], (0, width - prompts[i].shape[1]), value=0)
                         for i in batch]).to(device)  # (B, T); id 0 exists in every vocabulary
        logits = model(input_ids=ids, use_cache=False).logits  # (B, T, V)
        for row, i in enumerate(batch):
            out[i] = logits[row, :prompts[i].shape[1]].to("cpu", torch.float32, copy=True)  # not a view of the batch
        del logits
    return out


def _length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped shortest first, each group's count × longest length ≤ `batch_tokens` (≥ 1 each).

    As few groups as the budget allows: on a CPU shared with other work a forward call costs about
    the same whatever its length up to a few hundred positions, so one call with some padding beats
    two without.

    Example:
        >>> _length_batches([16, 9, 7, 9, 17, 7], 512), _length_batches([16, 9, 7, 9, 17, 7], 40)
        ([[2, 5, 1, 3, 0, 4]], [[2, 5, 1, 3], [0, 4]])
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


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
        # equal values differ by 0, -inf too (a masked vocabulary entry in both): -inf - -inf would be NaN
        diffs.append(torch.where(ref == oth, 0.0, (ref - oth).abs()).max())
        agree.append(ref.argmax(-1) == oth.argmax(-1))
        log_p = torch.log_softmax(ref.double(), -1)
        log_q = torch.log_softmax(oth.double(), -1)
        p = log_p.exp()  # 0 * log 0 counts 0 (where the reference gives a token no probability)
        kls.append(torch.where(p == 0, 0.0, p * (log_p - log_q)).sum(-1).clamp_min(0.0))  # (T,); NaN stays NaN
    kl = torch.cat(kls)
    return LogitComparison(max_abs_diff=float(torch.stack(diffs).max()),
                           top1_agreement=float(torch.cat(agree).float().mean()),
                           mean_kl=float(kl.mean()), max_kl=float(kl.max()), positions=int(kl.numel()))


def eager_experts() -> dict:
    """``experts_implementation="eager"`` for `from_pretrained`, where transformers has the option (5.x): 4.x
    runs the experts in an eager loop anyway, and refuses the keyword (``MixtralForCausalLM.__init__() got an
    unexpected keyword argument 'experts_implementation'``)."""
    from transformers import PretrainedConfig

    return {"experts_implementation": "eager"} if hasattr(PretrainedConfig(), "_experts_implementation") else {}
