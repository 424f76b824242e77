"""Greedy continuations of a few prompts, batched, and checked against another model's (for `compare`).

`continue_prompts` generates as one left-padded batch: `max_new_tokens` decoding steps in all,
not that many per prompt. `accept_draft` reads a model's own greedy continuation off logits it has
already computed over *prompt + another model's continuation* (the draft): as long as the model's
argmax matches the draft, the draft is its greedy continuation; at the first mismatch its argmax is
its next token, and only then does it need to generate the rest. This is greedy speculative
decoding: the result is the model's greedy continuation (up to float rounding, as for any change in
batching), and a dense base that agrees with its MoE, as a copy-upcycle does, makes no decoding
step at all — decoding steps stream every weight, so on a CPU they cost far more per token than a
forward pass over a prompt. It does not decide anything or compare the texts: `verify` shows them.
"""

from __future__ import annotations

import torch
from torch.nn.functional import pad


def continue_prompts(model, prompts: list[torch.Tensor], max_new_tokens: int, pad_id: int | None,
                     device) -> list[torch.Tensor]:
    """Greedy continuations (new ids only, 1-D, cut at the first end-of-sequence) of (1, T) `prompts`.

    One left-padded batch: the attention mask hides the padding and transformers derives the
    positions from it, so each row continues its own prompt (in 16-bit a near tie can still
    resolve differently from an unbatched run). A batch whose rows are all one length gets one more
    row, the first prompt without its first token, whose continuation is dropped: padded batches are
    how models are served, and a model that cannot generate one (``output_router_logits: true`` in
    config.json) fails here as it would for its users, whatever lengths the prompts happen to have.
    """
    if not prompts or max_new_tokens <= 0:
        return []
    asked = len(prompts)
    if len({p.shape[1] for p in prompts}) == 1 and prompts[0].shape[1] > 1:
        prompts = [*prompts, prompts[0][:, 1:]]  # (1, T - 1): padded by one position
    width = max(p.shape[1] for p in prompts)
    ids = torch.cat([pad(p, (width - p.shape[1], 0), value=0) for p in prompts]).to(device)  # (B, T)
    mask = torch.cat([pad(torch.ones_like(p), (width - p.shape[1], 0), value=0) for p in prompts]).to(device)
    new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
    eos = eos_ids(model)
    return [_cut_at_eos(row[width:].cpu(), eos) for row in new[:asked]]


def continue_from_drafts(model, prompts: list[torch.Tensor], drafts: list[torch.Tensor], logits: list[torch.Tensor],
                         max_new_tokens: int, pad_id: int | None, device) -> list[torch.Tensor]:
    """Each prompt's greedy continuation: read off `logits` as far as its draft goes, generated beyond.

    Args:
        prompts: (1, T) ids; the first ``len(drafts)`` have a draft.
        drafts: (D,) another model's continuations (`usable_draft`).
        logits: per prompt, the model's (T + D, V) logits over prompt + draft ((T, V) without one).
        max_new_tokens: the continuations' length.
        pad_id: fills finished rows while the batch generates.

    Returns:
        1-D new ids per prompt, cut after an end-of-sequence.
    """
    eos = eos_ids(model)
    new, extend = [], []
    for i, prompt in enumerate(prompts):
        tokens, more = (accept_draft(logits[i][prompt.shape[1] - 1:], drafts[i], max_new_tokens, eos)
                        if i < len(drafts) else (prompt.new_zeros(0), True))
        new.append(tokens.cpu())
        if more:
            extend.append(i)
    if extend:  # one batch, as long as the longest remainder; each row is cut to its own
        prefixes = [torch.cat([prompts[i], new[i].view(1, -1)], 1) for i in extend]
        rest = continue_prompts(model, prefixes, max(max_new_tokens - len(new[i]) for i in extend), pad_id, device)
        for i, more in zip(extend, rest):
            new[i] = torch.cat([new[i], more[:max_new_tokens - len(new[i])]])
    return new


def accept_draft(logits: torch.Tensor, draft: torch.Tensor, max_new_tokens: int, eos: set[int]
                 ) -> tuple[torch.Tensor, bool]:
    """The model's greedy tokens read off `logits`, and whether it must go on generating.

    Args:
        logits: (D + 1, V) — the model's logits at the prompt's last position and at each draft token.
        draft: (D,) the other model's continuation, D ≤ `max_new_tokens`.
        max_new_tokens: the continuation's length.
        eos: end-of-sequence ids: a continuation stops after one.

    Returns:
        The tokens (1-D) and True when they are a prefix that generation must extend.

    Example:
        >>> logits = torch.eye(4)[[1, 2, 3]]  # argmax 1, 2, 3
        >>> accept_draft(logits, torch.tensor([1, 0]), 4, set())  # agrees on 1, not on 0: 2 is its own
        (tensor([1, 2]), True)
    """
    greedy = logits.argmax(-1)  # (D + 1,)
    for j in range(min(len(draft) + 1, max_new_tokens)):
        token = int(greedy[j])
        if token in eos or j + 1 == max_new_tokens:
            return greedy[:j + 1], False
        if j == len(draft) or token != int(draft[j]):
            return greedy[:j + 1], True
    return greedy[:0], False  # max_new_tokens < 1: no continuation


def eos_ids(model) -> set[int]:
    """The model's end-of-sequence ids (its generation config's, one or several)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def usable_draft(draft: torch.Tensor, max_new_tokens: int, vocab: int, eos: set[int]) -> torch.Tensor:
    """`draft` cut to `max_new_tokens`, after its first end-of-sequence and before any id the model lacks."""
    draft = _cut_at_eos(draft[:max_new_tokens], eos)
    bad = (draft < 0) | (draft >= vocab)
    return draft[:int(bad.nonzero()[0])] if bool(bad.any()) else draft


def _cut_at_eos(ids: torch.Tensor, eos: set[int]) -> torch.Tensor:
    for j, token in enumerate(ids.tolist()):
        if token in eos:
            return ids[:j + 1]
    return ids
