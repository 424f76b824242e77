"""Grow expert prompt sets from a pool of candidate prompts (``moe-upcycle prompts grow``).

Each candidate is scored against each expert by its similarity to the expert's prompts: the mean
cosine to the expert's `KNN` most similar positive prompts (all-MiniLM-L6-v2 embeddings). This
works better than the centroid for diverse sets such as ``gate_configs/prompts/code.yaml``, whose
centroid is weak. A candidate goes to the expert it is most similar to only when

- the similarity is at least `MIN_SIMILARITY` (0.20), and
- it beats every other expert by at least `MARGIN` (0.05), and
- it is not a near-duplicate of one of the expert's prompts or of a candidate already taken.

On the hand-labelled pool in ``tests/data/pool.jsonl`` against the shipped code/math/creative/chat
sets, true code prompts score 0.17-0.39 for code with margins 0.03-0.30, and unrelated prompts
that lean to some expert score about 0.2 with margins under 0.06; the defaults take the clear
ones and leave the ambiguous ones out. Each expert then gets its K best-scoring candidates.

The updated config is written by `recipe.rewrite`; the input file is only replaced with ``in_place``.
The input's comments and layout are kept (a ruamel.yaml round trip, see `recipe.yaml_write`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from moe_upcycle.recipe.params import ExpertPrompts
from moe_upcycle.prompts.embed import Embedder, load_embedder
from moe_upcycle.errors import ConfigError
from moe_upcycle.prompts.lint import DUPLICATE_THRESHOLD
from moe_upcycle.prompts.pool import PoolFormat, read_pool_file

KNN = 3
MIN_SIMILARITY = 0.20
MARGIN = 0.05


@dataclass(frozen=True)
class Pick:
    """A candidate chosen for an expert."""

    text: str
    similarity: float  # mean cosine to the expert's KNN most similar prompts
    margin: float  # similarity minus the best similarity to any other expert


def read_pool(path: Union[str, Path], fmt: PoolFormat = "auto") -> list[str]:
    """Read candidate prompts: JSONL, paragraphs (blank-line separated) or lines — see `pool`.

    Raises:
        ConfigError: the file is missing, or a JSONL line has no usable text (file and line named).
    """
    return read_pool_file(path, fmt).prompts


def check_limits(per_expert: int, min_similarity: float, margin: float) -> None:
    """Refuse limits that can pick nothing (or everything): similarities are cosines in [-1, 1].

    Raises:
        ConfigError: every limit out of range, named as its option.
    """
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    problems = []
    if not (number(per_expert) and isinstance(per_expert, int) and per_expert >= 1):
        problems.append(f"--per-expert: {per_expert!r} is not a count; give a whole number >= 1")
    if not (number(min_similarity) and -1 <= min_similarity <= 1):
        problems.append(f"--min-similarity: {min_similarity!r} is not a cosine similarity; give a number from "
                        f"-1 to 1 (default {MIN_SIMILARITY})")
    if not (number(margin) and 0 <= margin <= 2):
        problems.append(f"--margin: {margin!r} is not a lead between two cosine similarities; give a number from "
                        f"0 to 2 (default {MARGIN})")
    if problems:
        raise ConfigError(*problems)


def check_growable(experts: Sequence[ExpertPrompts]) -> None:
    """Refuse experts none of which has positive prompts (`prompts grow` asks before the embedder loads).

    Raises:
        ConfigError: nothing to grow from.
    """
    if not any(e.positive for e in experts):
        raise ConfigError("experts: no expert has positive_prompts, so there is nothing to grow from; "
                          "list experts with a few positive_prompts each")


@dataclass(frozen=True)
class Growth:
    """What `grow` chose: the picks per expert, and why an expert got none."""

    picks: dict[str, list[Pick]]  # every expert with prompts, best first (possibly empty)
    why_none: dict[str, str]  # expert name -> why it got no new prompt (experts without prompts included)


def grow_prompts(experts: Sequence[ExpertPrompts], pool: list[str], embedder: Optional[Embedder] = None, *,
                 per_expert: int = 10, min_similarity: float = MIN_SIMILARITY, margin: float = MARGIN,
                 duplicate_threshold: float = DUPLICATE_THRESHOLD) -> dict[str, list[Pick]]:
    """`grow`'s picks alone: ``{expert name: picks, best first}`` (see `grow` for the arguments)."""
    return grow(experts, pool, embedder, per_expert=per_expert, min_similarity=min_similarity, margin=margin,
                duplicate_threshold=duplicate_threshold).picks


def grow(experts: Sequence[ExpertPrompts], pool: list[str], embedder: Optional[Embedder] = None, *,
         per_expert: int = 10, min_similarity: float = MIN_SIMILARITY, margin: float = MARGIN,
         duplicate_threshold: float = DUPLICATE_THRESHOLD) -> Growth:
    """Pick, for each routed expert with prompts, up to `per_expert` candidates from `pool`.

    Args:
        experts: the routed experts, whose positive prompts define them (`recipe.resolve.expert_prompts`).
        pool: candidate prompts; ones already among any expert's prompts are ignored.
        embedder: a loaded embedder; the packaged default when None.
        per_expert: most candidates added to one expert.
        min_similarity: least similarity to the expert's prompts.
        margin: least lead over the next most similar expert (ignored with one expert).
        duplicate_threshold: a candidate this similar to a prompt the expert has is not added.

    Returns:
        ``{expert name: picks, best first}`` for every expert with prompts (possibly empty lists), and for each
        expert that got none the reason (`_why_none`).

    Raises:
        ConfigError: no expert has positive prompts, or a limit is out of its range (NaN included).
    """
    check_limits(per_expert, min_similarity, margin)
    check_growable(experts)
    known = {p for e in experts for p in e.positive + e.negative}
    why = {e.name: "it has no positive_prompts to compare the pool with" for e in experts if not e.positive}
    experts = [e for e in experts if e.positive]
    pool = [p for p in dict.fromkeys(pool) if p not in known]
    picks: dict[str, list[Pick]] = {e.name: [] for e in experts}
    if not pool:
        return Growth(picks, {**why, **{e.name: "the pool holds no prompt that the recipe does not have already"
                                        for e in experts}})
    embedder = embedder or load_embedder()
    texts = [p for e in experts for p in e.positive] + pool
    vecs = embedder.encode(texts)  # one batched call: (N, D) unit rows
    cand = vecs[len(texts) - len(pool):]  # (C, D)
    own_vecs, at = [], 0
    for e in experts:
        own_vecs.append(vecs[at:at + len(e.positive)])
        at += len(e.positive)
    sims = [cand @ v.T for v in own_vecs]  # per expert (C, P_e)
    score = torch.stack([s.topk(min(KNN, s.shape[1]), dim=1).values.mean(1) for s in sims], 1)  # (C, E)
    if len(experts) > 1:
        top2 = score.topk(2, dim=1)
        best, lead = top2.indices[:, 0], top2.values[:, 0] - top2.values[:, 1]
    else:
        best, lead = torch.zeros(len(pool), dtype=torch.long), torch.full((len(pool),), float("inf"))
    for j, e in enumerate(experts):
        mine = ((best == j) & (score[:, j] >= min_similarity) & (lead >= margin)
                & (sims[j].max(1).values < duplicate_threshold)).nonzero().flatten()
        taken: list[int] = []
        for c in sorted(mine.tolist(), key=lambda c: -float(score[c, j])):
            if len(taken) == per_expert:
                break
            if taken and float((cand[taken] @ cand[c]).max()) >= duplicate_threshold:
                continue  # near-duplicate of a candidate already taken
            taken.append(c)
            picks[e.name].append(Pick(pool[c], float(score[c, j]), float(lead[c])))
        if not taken:
            dup = sims[j].max(1).values >= duplicate_threshold
            why[e.name] = _why_none(j, [x.name for x in experts], score, best, lead, dup, min_similarity, margin,
                                    duplicate_threshold)
    return Growth(picks, why)


def _why_none(j: int, names: list[str], score: torch.Tensor, best: torch.Tensor, lead: torch.Tensor,
              dup: torch.Tensor, min_similarity: float, margin: float, duplicate_threshold: float) -> str:
    """Why expert `j` got no pool prompt: none was closest to it, or each that was fell short of a limit.

    Args:
        score: (C, E) similarity of each candidate to each expert; best: (C,) the expert each is closest to;
        lead: (C,) its lead over the next expert; dup: (C,) whether it repeats one of expert j's prompts.
    """
    mine = best == j
    if not bool(mine.any()):
        c = int(score[:, j].argmax())
        return (f"no pool prompt is closer to it than to another expert (the closest, at {float(score[c, j]):.2f}, "
                f"is closer to {names[int(best[c])]})")
    low = mine & (score[:, j] < min_similarity)
    narrow = mine & ~low & (lead < margin)
    repeats = mine & ~low & ~narrow & dup
    parts = []
    if bool(low.any()):
        parts.append(f"{int(low.sum())} score under --min-similarity {min_similarity:.2f} (best "
                     f"{float(score[low, j].max()):.2f})")
    if bool(narrow.any()):
        parts.append(f"{int(narrow.sum())} lead the next expert by under --margin {margin:.2f} (most "
                     f"{float(lead[narrow].max()):.2f})")
    if bool(repeats.any()):
        parts.append(f"{int(repeats.sum())} repeat one of its prompts (cosine {duplicate_threshold:.2f} or more)")
    return f"{int(mine.sum())} pool prompt(s) are closest to it, but {', '.join(parts)}"
