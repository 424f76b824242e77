"""The routers checking themselves: how many of each expert's own prompts its router row wins.

A prompt-routed build has every prompt's router inputs in hand when it makes the rows (`hidden_gates`); this module
routes the experts' own positive prompts through those rows and counts, per expert, the prompts it wins — counted as
``moe-upcycle route --labeled`` counts them (`majority_expert`, which `check.route_eval` uses too): in each MoE layer
every real token picks its top-1 expert (the largest ``row · x``); a prompt goes to the expert with the most top-1
picks summed over layers (ties: the lower index). The base model's router inputs are the MoE's when its experts are
copies of the base; with fine-tuned experts, the MoE's earlier layers change them a little, so `route --labeled` on
the built model can differ by a prompt or two.

An expert that wins fewer than half of its own prompts gets a warning naming the likely cause: its negative prompts
(when the same rows without them would win it more), a row nearly parallel to another expert's, or prompts that
look like another expert's to the base model. It computes counts only; it writes and prints nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from moe_upcycle.gates.checks import PARALLEL_COSINE

# a routing check holds the positive prompts' token router inputs up to this size; beyond it, each prompt's mean
SELF_CHECK_BYTES = 1 << 30


def majority_expert(counts: torch.Tensor) -> torch.Tensor:
    """The expert each prompt goes to: most top-1 picks summed over layers, ties to the lower index.

    Args:
        counts: (P, L, E) top-1 picks (or shares: each (p, l) row scaled alike) of prompt p's tokens at layer l.

    Returns:
        (P,) expert indices.

    Example:
        >>> majority_expert(torch.tensor([[[3, 1], [0, 4]], [[2, 2], [1, 1]]])).tolist()
        [1, 0]
    """
    return counts.sum(dim=1).argmax(dim=-1)


def top1_counts(tokens: torch.Tensor, text_of: torch.Tensor, rows: torch.Tensor, n_texts: int) -> torch.Tensor:
    """(n_texts, E) how many tokens of each text pick each expert first under `rows`.

    Args:
        tokens: (N, H) router inputs of one layer (any dtype; scored in fp32).
        text_of: (N,) the text each token belongs to.
        rows: (E, H) router rows of that layer.
    """
    pick = (tokens.float() @ rows.float().T).argmax(dim=-1)  # (N,)
    out = torch.zeros(n_texts, rows.shape[0], dtype=torch.long)
    out.index_put_((text_of.long(), pick), torch.ones_like(pick), accumulate=True)
    return out


@dataclass(frozen=True)
class KeptInputs:
    """The positive prompts' router inputs kept by `capture.capture_router_inputs` for the check.

    Attributes:
        layers: MoE layer -> (N, H) vectors: every real token of the kept texts (``per_token``), or one per text
            (its mean router input).
        text_of: (N,) the text (index in capture order) of each vector, the same in every layer.
        per_token: whether the vectors are tokens (else prompt means, when the tokens were over `SELF_CHECK_BYTES`).
    """

    layers: dict[int, torch.Tensor]
    text_of: torch.Tensor
    per_token: bool


@dataclass(frozen=True)
class SelfCheck:
    """Per expert, the prompts it wins among its own positive prompts (`check_routing`).

    Attributes:
        experts: expert names in router order.
        wins: own prompts each expert wins.
        prompts: own positive prompts of each expert.
        confusion: (E, E) own prompts of expert i that go to expert j.
        layers: the MoE layers counted.
        per_token: counted per token, as `route --labeled` (else on prompt means).
        causes: expert name -> the likely cause, for the experts winning fewer than half.
    """

    experts: list[str]
    wins: list[int]
    prompts: list[int]
    confusion: list[list[int]]
    layers: list[int]
    per_token: bool = True
    causes: dict[str, str] = field(default_factory=dict)

    def starved(self) -> list[int]:
        """Experts winning fewer than half of their own prompts."""
        return [e for e, (w, n) in enumerate(zip(self.wins, self.prompts)) if n and 2 * w < n]

    def went_to(self, e: int) -> str:
        """Where expert e's lost prompts went: ``23 go to code, 7 to chat``."""
        lost = sorted(((n, j) for j, n in enumerate(self.confusion[e]) if j != e and n), reverse=True)
        parts = [f"{n} {'go' if n != 1 else 'goes'} to {self.experts[j]}" if i == 0 else f"{n} to {self.experts[j]}"
                 for i, (n, j) in enumerate(lost)]
        return ", ".join(parts)

    def lines(self) -> list[str]:
        """One line per expert: ``math wins 0 of 30 of its own prompts (23 go to code, 7 to chat)``."""
        out = []
        for e, name in enumerate(self.experts):
            lost = self.went_to(e)
            out.append(f"{name} wins {self.wins[e]} of {self.prompts[e]} of its own prompts"
                       + (f" ({lost})" if lost else ""))
        return out

    def warnings(self) -> list[str]:
        """One warning per starved expert, naming it and the likely cause."""
        how = "" if self.per_token else " (counted on each prompt's mean router input)"
        return [f"routing self-check: expert `{self.experts[e]}` wins {self.wins[e]} of {self.prompts[e]} of its own "
                f"prompts{how} ({self.went_to(e)}): {self.causes.get(self.experts[e], '')}".rstrip(": ")
                for e in self.starved()]

    def to_dict(self) -> dict:
        return {"experts": {name: {"wins": self.wins[e], "prompts": self.prompts[e]}
                            for e, name in enumerate(self.experts)},
                "confusion": self.confusion, "layers": self.layers,
                "counted": "per token, top-1, majority over layers" if self.per_token
                else "per prompt mean, top-1, majority over layers",
                "starved": {self.experts[e]: self.causes.get(self.experts[e], "") for e in self.starved()}}


def route_own_prompts(kept: KeptInputs, rows: dict[int, torch.Tensor], layers: Sequence[int], text_expert: Sequence[int],
                      n_experts: int) -> torch.Tensor:
    """(E, E) confusion of the kept texts: row = the expert whose prompt it is, column = the expert it goes to.

    Args:
        rows: layer -> (E, H) router rows (any positive per-layer scale: only the top-1 counts).
        layers: the MoE layers.
        text_expert: per text in capture order, the expert whose positive prompt it is (-1: not kept).
    """
    n_texts = len(text_expert)
    counts = torch.stack([top1_counts(kept.layers[layer], kept.text_of, rows[layer], n_texts) for layer in layers],
                         dim=1)  # (T, L, E)
    texts = torch.tensor([t for t, e in enumerate(text_expert) if e >= 0], dtype=torch.long)
    label = torch.tensor([text_expert[t] for t in texts.tolist()], dtype=torch.long)
    conf = torch.zeros(n_experts, n_experts, dtype=torch.long)
    if len(texts):
        conf.index_put_((label, majority_expert(counts[texts])), torch.ones_like(label), accumulate=True)
    return conf


def check_routing(kept: KeptInputs, rows: dict[int, torch.Tensor], layers: Sequence[int], text_expert: Sequence[int],
                  names: Sequence[str], without_negatives: Optional[dict[int, torch.Tensor]] = None,
                  has_negative: Sequence[bool] = ()) -> SelfCheck:
    """Count each expert's wins among its own prompts and name the likely cause for the starved ones.

    Args:
        kept: the positive prompts' router inputs.
        rows: layer -> (E, H) the rows the build writes.
        layers: the MoE layers.
        text_expert: per text in capture order, its expert (-1 for a negative prompt).
        names: expert names.
        without_negatives: layer -> (E, H) the rows made without any expert's negative prompts, to tell whether
            those starve an expert (None: no expert has negatives).
        has_negative: per expert, whether it has negative prompts.
    """
    n = len(names)
    conf = route_own_prompts(kept, rows, layers, text_expert, n)
    wins, prompts = conf.diagonal().tolist(), conf.sum(dim=1).tolist()
    causes: dict[str, str] = {}
    starved = [e for e in range(n) if prompts[e] and 2 * wins[e] < prompts[e]]
    if starved:
        plain = (route_own_prompts(kept, without_negatives, layers, text_expert, n).diagonal().tolist()
                 if without_negatives is not None else None)
        unit = torch.nn.functional.normalize(torch.stack([rows[layer].float() for layer in layers]), dim=-1)
        cosine = unit @ unit.transpose(1, 2)  # (L, E, E)
        for e in starved:
            causes[names[e]] = _cause(e, names, wins, prompts, conf, plain, cosine, layers,
                                      bool(has_negative[e]) if has_negative else False)
    return SelfCheck(list(names), wins, prompts, conf.tolist(), list(layers), kept.per_token, causes)


def _cause(e: int, names: Sequence[str], wins: list[int], prompts: list[int], conf: torch.Tensor,
           plain: Optional[list[int]], cosine: torch.Tensor, layers: Sequence[int], negative: bool) -> str:
    """The likely cause of expert e's starving, and what to do."""
    if negative and plain is not None and plain[e] > wins[e]:
        return (f"its negative_prompts pull its row away from its own prompts (without any expert's negative prompts "
                f"it would win {plain[e]} of {prompts[e]}); remove experts[{e}].negative_prompts or use prompts "
                f"less like its own")
    others = cosine[:, e].clone()
    others[:, e] = -2.0
    worst, layer_at = others.max(dim=0).values, others.max(dim=1).values  # (E,), (L,)
    rival = int(worst.argmax())
    if float(worst[rival]) > PARALLEL_COSINE:
        hit = [layers[i] for i, c in enumerate(layer_at.tolist()) if c > PARALLEL_COSINE]
        return (f"its row is nearly parallel to `{names[rival]}`'s (cosine up to {float(worst[rival]):.3f}, in "
                f"{len(hit)} of {len(layers)} layers); make the two experts' prompts more distinct")
    taker = int(conf[e].masked_fill(torch.arange(len(names)) == e, -1).argmax())
    return (f"to the base model its prompts look more like `{names[taker]}`'s than its own row; make its prompts "
            f"more distinct, or add negative_prompts from `{names[taker]}`'s set")
