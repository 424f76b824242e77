"""Semantic lint of expert prompt sets: will the routers be able to tell these experts apart?

Hidden-state and embedding gates are built from each expert's prompts; when two experts' prompts
mean the same thing, their router rows end up nearly equal and the experts collapse. This module
embeds every prompt once (one batched call, see `embed`) and measures, with cosine similarity:

- per expert: prompt count, mean pairwise cosine (lower = more diverse), near-duplicate prompts;
- per pair of experts: cosine of their centroids and their closest cross-expert prompts;
- the prompts that hurt separability: closer to another expert's centroid than to their own
  (own centroid computed without the prompt itself, so a prompt does not vote for itself).

Default thresholds come from ``scripts/measure_lint_thresholds.py`` with all-MiniLM-L6-v2:

- `PAIR_THRESHOLD` 0.70: the seven different-kind sets in ``gate_configs/prompts`` have centroid
  cosines of at most 0.49 (chat vs creative; mean 0.21), while a set and its one-for-one
  paraphrase score 0.93-0.95 and two random halves of one set mostly 0.6-0.84. 0.70 sits midway.
- `DUPLICATE_THRESHOLD` 0.90: distinct English prompts within one shipped set reach at most 0.62;
  a prompt and its paraphrase score 0.76-0.98 (median 0.87-0.94). Only near-verbatim rewrites
  pass 0.90. (MiniLM is English-only: Korean prompts of the multilingual set reach 0.87; use a
  multilingual `--embedder` for non-English prompt sets.)
- `OFFENDER_MARGIN` 0.10: every prompt closer to another expert than to its own is listed, but only
  those closer by more than 0.10 count as problems. Across the 21 pairs of shipped sets, 12 pairs
  have no such prompt at all and the rest one to three (mostly code prompts that MiniLM reads as
  "Write a ..." requests); in a paraphrased pair every prompt is misplaced by more than 0.15.

It does not read checkpoints or build anything; `build` calls `quick_lint` for its warnings.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from .config import UpcycleConfig
from .embed import Embedder, EmbedderError, load_embedder

PAIR_THRESHOLD = 0.70
DUPLICATE_THRESHOLD = 0.90
OFFENDER_MARGIN = 0.10
MAX_BUILD_OFFENDERS = 5  # build warnings list at most this many misplaced prompts, then a count


@dataclass(frozen=True)
class NearDuplicate:
    """Two prompts that say almost the same thing (cosine >= the duplicate threshold)."""

    first: str
    second: str
    cosine: float


@dataclass(frozen=True)
class ExpertStats:
    """One expert's prompt set."""

    name: str
    count: int
    negatives: int
    mean_cosine: Optional[float]  # mean pairwise cosine of the positive prompts; None with < 2 prompts
    near_duplicates: list[NearDuplicate]
    contradictions: list[NearDuplicate]  # a negative prompt that nearly equals a positive one


@dataclass(frozen=True)
class PairStats:
    """Two experts: how close their prompt sets are."""

    first: str
    second: str
    centroid_cosine: float
    nearest: list[NearDuplicate]  # closest cross-expert prompt pairs, most similar first


@dataclass(frozen=True)
class Offender:
    """A prompt closer to another expert's centroid than to its own expert's."""

    expert: str
    prompt: str
    closer_to: str
    own_cosine: float
    other_cosine: float

    @property
    def margin(self) -> float:
        return self.own_cosine - self.other_cosine


@dataclass
class LintReport:
    """Everything `lint_prompts` measured, plus the thresholds it judged against."""

    experts: list[ExpertStats]
    pairs: list[PairStats]
    offenders: list[Offender]
    pair_threshold: float
    duplicate_threshold: float
    embedder: str
    offender_margin: float = OFFENDER_MARGIN
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # experts without positive prompts

    def flagged_pairs(self) -> list[PairStats]:
        """Pairs whose centroid cosine is above the pair threshold (what ``--strict`` fails on)."""
        return [p for p in self.pairs if p.centroid_cosine > self.pair_threshold]

    def problems(self, max_offenders: Optional[int] = None) -> list[str]:
        """One line per problem, most serious first; empty when the prompt sets look separable.

        Args:
            max_offenders: list at most this many misplaced prompts, then one line with the count.
        """
        lines = []
        for p in sorted(self.flagged_pairs(), key=lambda p: -p.centroid_cosine):
            lines.append(f"experts {p.first} and {p.second}: prompt centroids have cosine {p.centroid_cosine:.2f} "
                         f"(> {self.pair_threshold:.2f}); their routers will hardly tell them apart — make "
                         f"their prompts differ in kind, or merge the two experts")
        for p in self.pairs:
            for d in p.nearest:
                if d.cosine >= self.duplicate_threshold:
                    lines.append(f"experts {p.first} and {p.second} share near-duplicate prompts (cosine "
                                 f"{d.cosine:.2f}): {_short(d.first)!r} / {_short(d.second)!r}")
        for e in self.experts:
            for d in e.near_duplicates:
                lines.append(f"expert {e.name}: near-duplicate prompts (cosine {d.cosine:.2f}): "
                             f"{_short(d.first)!r} / {_short(d.second)!r}; drop one or write a different prompt")
            for d in e.contradictions:
                lines.append(f"expert {e.name}: negative prompt {_short(d.second)!r} nearly equals positive prompt "
                             f"{_short(d.first)!r} (cosine {d.cosine:.2f}); they cancel out — remove one")
        misplaced = [o for o in self.offenders if o.margin < -self.offender_margin]
        shown = misplaced if max_offenders is None else misplaced[:max_offenders]
        for o in shown:
            lines.append(f"expert {o.expert}: prompt {_short(o.prompt)!r} is closer to expert {o.closer_to} "
                         f"({o.other_cosine:.2f}) than to its own ({o.own_cosine:.2f})")
        if len(shown) < len(misplaced):
            lines.append(f"... and {len(misplaced) - len(shown)} more prompts closer to another expert "
                         f"(`moe-upcycle lint --json` lists all)")
        return lines

    def to_dict(self) -> dict:
        """A JSON-ready dict (``lint --json``)."""
        out = asdict(self)
        out["flagged_pairs"] = [[p.first, p.second] for p in self.flagged_pairs()]
        out["problems"] = self.problems()
        for o, d in zip(self.offenders, out["offenders"]):
            d["margin"] = o.margin
        return out


def lint_config(config: UpcycleConfig, embedder: Optional[Embedder] = None, *,
                pair_threshold: float = PAIR_THRESHOLD,
                duplicate_threshold: float = DUPLICATE_THRESHOLD) -> LintReport:
    """Lint the routed experts' prompts of a config (shared experts are always on and not linted).

    Args:
        config: a validated config.
        embedder: a loaded embedder; the packaged default when None.
        pair_threshold: centroid cosine above which a pair of experts is flagged.
        duplicate_threshold: prompt cosine at or above which two prompts are near-duplicates.

    Raises:
        EmbedderError: no embedder could be loaded.
    """
    sets = {e.name: (list(e.positive_prompts), list(e.negative_prompts)) for e in config.expert_list()}
    return lint_prompts(sets, embedder or load_embedder(), pair_threshold=pair_threshold,
                        duplicate_threshold=duplicate_threshold)


def lint_prompts(sets: dict[str, tuple[list[str], list[str]]], embedder: Embedder, *,
                 pair_threshold: float = PAIR_THRESHOLD,
                 duplicate_threshold: float = DUPLICATE_THRESHOLD, offender_margin: float = OFFENDER_MARGIN,
                 nearest_per_pair: int = 3) -> LintReport:
    """Lint prompt sets given as ``{expert: (positive_prompts, negative_prompts)}``.

    All prompts are embedded in a single `encode` call. Experts without positive prompts are
    listed in `skipped` and left out of every statistic.

    Args:
        sets: positive and negative prompts per expert name.
        embedder: the loaded embedder.
        pair_threshold: centroid cosine above which a pair of experts is flagged.
        duplicate_threshold: prompt cosine at or above which two prompts are near-duplicates.
        offender_margin: a prompt closer to another expert by more than this is a problem.
        nearest_per_pair: how many closest cross-expert prompt pairs to keep per pair.

    Returns:
        The report; `problems()` gives the warnings.
    """
    start = time.perf_counter()
    skipped = [name for name, (pos, _) in sets.items() if not pos]
    sets = {name: v for name, v in sets.items() if v[0]}
    texts = [t for pos, neg in sets.values() for t in pos + neg]
    vecs = embedder.encode(texts)  # (N, D), unit rows
    pos_vecs, neg_vecs, at = {}, {}, 0
    for name, (pos, neg) in sets.items():
        pos_vecs[name], neg_vecs[name] = vecs[at:at + len(pos)], vecs[at + len(pos):at + len(pos) + len(neg)]
        at += len(pos) + len(neg)
    centroids = {name: _unit(v.mean(0)) for name, v in pos_vecs.items()}

    experts = []
    for name, (pos, neg) in sets.items():
        v = pos_vecs[name]
        sim = v @ v.T
        n = len(pos)
        mean = float((sim.sum() - sim.diagonal().sum()) / (n * (n - 1))) if n > 1 else None
        close = torch.triu(sim >= duplicate_threshold, diagonal=1).nonzero().tolist()  # pairs i < j
        dups = [NearDuplicate(pos[i], pos[j], float(sim[i, j])) for i, j in close]
        contra = []
        if neg:
            cross = v @ neg_vecs[name].T  # (P, Nneg)
            contra = [NearDuplicate(pos[i], neg[j], float(cross[i, j]))
                      for i, j in (cross >= duplicate_threshold).nonzero().tolist()]
        experts.append(ExpertStats(name, n, len(neg), mean, dups, contra))

    pairs = []
    for a, b in itertools.combinations(sets, 2):
        cross = pos_vecs[a] @ pos_vecs[b].T  # (Pa, Pb)
        k = min(nearest_per_pair, cross.numel())
        top = cross.flatten().topk(k)
        nearest = [NearDuplicate(sets[a][0][i // cross.shape[1]], sets[b][0][i % cross.shape[1]], float(c))
                   for c, i in zip(top.values.tolist(), top.indices.tolist())]
        pairs.append(PairStats(a, b, float(centroids[a] @ centroids[b]), nearest))

    offenders = []
    if len(sets) > 1:
        for name, (pos, _) in sets.items():
            v = pos_vecs[name]
            if len(pos) < 2:
                continue  # no centroid without the prompt itself
            own = (_unit_rows(v.sum(0, keepdim=True) - v) * v).sum(-1)  # leave-one-out centroid, (P,)
            others = [o for o in sets if o != name]
            other_sim = v @ torch.stack([centroids[o] for o in others]).T  # (P, E-1)
            best, idx = other_sim.max(-1)
            for i in (best > own).nonzero().flatten().tolist():
                offenders.append(Offender(name, pos[i], others[idx[i]], float(own[i]), float(best[i])))
    offenders.sort(key=lambda o: o.margin)
    return LintReport(experts, pairs, offenders, pair_threshold, duplicate_threshold, embedder.name,
                      offender_margin, time.perf_counter() - start, skipped)


def quick_lint(config: UpcycleConfig, embedder_name: Optional[str] = None) -> list[str]:
    """Warnings for ``build``: one line per problem, or one line saying why the lint was skipped.

    Never raises for a missing embedder: the build goes on without the lint.

    Returns:
        Warning lines; empty when no expert has prompts or nothing is wrong.
    """
    if not any(e.positive_prompts for e in config.expert_list()):  # *_prompts_from resolved
        return []
    try:
        report = lint_config(config, load_embedder(embedder_name))
    except EmbedderError as exc:
        return [f"prompt lint skipped: {exc.problems[0]} (use --no-lint to silence this)"]
    return report.problems(max_offenders=MAX_BUILD_OFFENDERS)


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm().clamp_min(1e-12)


def _unit_rows(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
