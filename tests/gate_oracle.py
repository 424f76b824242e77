"""Native hidden-state gate rows computed the plain way, as the oracle of the gates tests.

Nothing here calls the product's gate code: the dense base is loaded whole with transformers
(``AutoModelForCausalLM.from_pretrained``), each text runs alone (no padding, no batching), a forward pre-hook on
each decoder layer's ``mlp`` takes its input — the router input of a Mixtral-style block — and the gate formula of
docs/gates.md is spelled out below, in float64:

- a text's vector at layer l: the mean of the router input over its real tokens (tokens that are not special
  tokens of the tokenizer), or for ``hidden_last`` the router input at its last real token;
- an expert's mean: the mean of its positive prompts' vectors; direction = that minus the mean of its negative
  prompts' vectors (when it has any);
- ``gate_center``: mu, the mean over experts of their positive means, is taken from both an expert's positive and
  negative means: ``(own - mu) - (negative - mu)`` with negatives, ``own - mu`` without;
- each row is the unit direction times a scale: ``gate_scale`` when given, else per layer the length that makes the
  median expert's own row beat the best other row on its own prompts' mean by 4 nats, capped so that a token of the
  layer's mean router-input norm (over every real token of every prompt) gets at most 16 nats between two rows.

It imports nothing from moe_upcycle: the tokenizer and the model are transformers', the arithmetic is written here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

DECISIVE = 4.0  # nats between an expert's own row and its best rival on its own prompts
CAP = 16.0  # nats at most between two rows for a token of mean norm


def load_dense(path: Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) as transformers loads them, the model in `dtype` and eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def router_inputs(model, tokenizer, text: str) -> list[torch.Tensor]:
    """Per layer, the router input of `text`'s real tokens, (T_real, H) float64; the text runs alone."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    special = set(tokenizer.all_special_ids)
    real = torch.tensor([i not in special for i in ids])
    seen: dict[int, torch.Tensor] = {}
    layers = model.model.layers
    handles = [layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0][0].clone()))
               for i, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [seen[i][real.to(seen[i].device)].double().cpu() for i in range(len(layers))]


def prompt_vectors(model, tokenizer, texts: Sequence[str], last: bool = False) -> torch.Tensor:
    """(L, N, H) float64: each text's masked mean (or last real token) at every layer."""
    per_text = []
    for text in texts:
        xs = router_inputs(model, tokenizer, text)
        per_text.append(torch.stack([x[-1] if last else x.sum(dim=0) / x.shape[0] for x in xs]))
    return torch.stack(per_text, dim=1)


def token_norms(model, tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """(L,) float64: the mean L2 norm of a real token's router input over every real token of `texts`."""
    total, count = None, 0
    for text in texts:
        xs = router_inputs(model, tokenizer, text)
        norms = torch.stack([x.norm(dim=-1).sum() for x in xs])
        total = norms if total is None else total + norms
        count += xs[0].shape[0]
    return total / count


def gate_rows(model, tokenizer, experts: Sequence[tuple[Sequence[str], Sequence[str]]], last: bool = False,
              center: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """(L, E, H) float64 rows for ``hidden`` (``hidden_last`` with `last`) from (positive, negative) prompts."""
    own = torch.stack([prompt_vectors(model, tokenizer, pos, last).mean(dim=1) for pos, _ in experts], dim=1)
    shared = own.mean(dim=1, keepdim=True) if center else torch.zeros_like(own[:, :1])  # (L, 1, H)
    direction = own - shared
    for e, (_, neg) in enumerate(experts):
        if neg:  # with gate_center, mu is taken from the negative mean too: (own - mu) - (neg - mu)
            direction[:, e] -= prompt_vectors(model, tokenizer, neg, last).mean(dim=1) - shared[:, 0]
    unit = direction / direction.norm(dim=-1, keepdim=True)
    every = [t for pos, neg in experts for t in (*pos, *neg)]
    norm = token_norms(model, tokenizer, every)
    lengths = []
    for layer in range(unit.shape[0]):
        lengths.append(scale if scale else default_length(unit[layer], own[layer], float(norm[layer])))
    return unit * torch.tensor(lengths, dtype=torch.float64)[:, None, None]


def default_length(unit: torch.Tensor, own: torch.Tensor, token_norm: float) -> float:
    """One layer's row length from its unit rows (E, H), its experts' own means (E, H) and its mean token norm."""
    n = unit.shape[0]
    if n == 1:
        return DECISIVE / token_norm
    spread = max(float((unit[e] - unit[f]).norm()) for e in range(n) for f in range(n))
    cap = CAP / (token_norm * spread)
    gaps = []
    for e in range(n):  # the mean logit of e's tokens under its own row, minus under its best rival
        logits = [float(own[e] @ unit[f]) for f in range(n)]
        gaps.append(logits[e] - max(v for f, v in enumerate(logits) if f != e))
    gap = sorted(gaps)[(n - 1) // 2]  # the median; with an even count, the lower of the two middle ones
    return min(DECISIVE / gap, cap) if gap > 0 else cap
