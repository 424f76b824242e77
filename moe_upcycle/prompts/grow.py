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


def grow_prompts(experts: Sequence[ExpertPrompts], pool: list[str], embedder: Optional[Embedder] = None, *,
                 per_expert: int = 10, min_similarity: float = MIN_SIMILARITY, margin: float = MARGIN,
                 duplicate_threshold: float = DUPLICATE_THRESHOLD) -> dict[str, list[Pick]]:
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
        ``{expert name: picks, best first}`` for every expert with prompts (possibly empty lists).

    Raises:
        ConfigError: no expert has positive prompts, or a limit is out of its range (NaN included).
    """
    check_limits(per_expert, min_similarity, margin)
    check_growable(experts)
    known = {p for e in experts for p in e.positive + e.negative}
    experts = [e for e in experts if e.positive]
    pool = [p for p in dict.fromkeys(pool) if p not in known]
    picks: dict[str, list[Pick]] = {e.name: [] for e in experts}
    if not pool:
        return picks
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
    return picks
