"""Spherical k-means for router rows: pure torch, seeded, every cluster non-empty.

A router with rows of equal length sends a token ``x`` to ``argmax_e x·r_e``, i.e. to the row with
the highest *cosine* to ``x``. Spherical k-means (points and centroids on the unit sphere,
assignment by cosine) therefore yields rows whose routing of the calibration tokens is exactly
the clustering. This module clusters tensors; it does not read text or run models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

MAX_ITERATIONS = 100
RESTARTS = 4  # seeded restarts; the clustering with the highest total cosine wins


@dataclass(frozen=True)
class Clusters:
    """Result of `spherical_kmeans`.

    Attributes:
        centroids: (k, H) unit vectors.
        assignment: (N,) cluster index of each point.
        sizes: (k,) points per cluster, all ≥ 1.
        iterations: Lloyd iterations run.
    """

    centroids: torch.Tensor
    assignment: torch.Tensor
    sizes: torch.Tensor
    iterations: int


def spherical_kmeans(points: torch.Tensor, k: int, seed: int,
                     on_run: Optional[Callable[[int], None]] = None) -> Clusters:
    """Cluster `points` (N, H) by cosine into `k` clusters.

    k-means++ seeding (on cosine distance) from a CPU generator seeded with `seed`, then Lloyd
    iterations until assignments stop changing; `RESTARTS` seeded runs, keeping the one whose
    points have the highest total cosine to their centroids. A cluster that empties is given the point that is
    currently farthest from its own centroid, so every cluster keeps at least one point.

    Args:
        points: (N, H) float tensor; rows of zero length are not allowed.
        k: number of clusters.
        seed: random seed; same points and seed give the same clusters.
        on_run: called with the number of Lloyd iterations after each of the `RESTARTS` runs (progress).

    Returns:
        The clusters.

    Raises:
        ValueError: fewer than `k` distinct directions among the points.

    Example:
        >>> pts = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
        >>> spherical_kmeans(pts, 2, seed=0).sizes.tolist()
        [2, 2]
    """
    x = torch.nn.functional.normalize(points.float(), dim=-1)  # (N, H)
    distinct = torch.unique(torch.round(x * 1e5), dim=0).shape[0]
    if distinct < k:
        raise ValueError(f"only {distinct} distinct token directions for {k} clusters")
    gen = torch.Generator().manual_seed(seed)
    best, best_score = None, float("-inf")
    for _ in range(RESTARTS):
        run = _lloyd(x, _plus_plus(x, k, gen), k)
        if on_run is not None:
            on_run(run.iterations)
        score = float((x * run.centroids[run.assignment]).sum())
        if score > best_score + 1e-9:
            best, best_score = run, score
    return best


def _lloyd(x: torch.Tensor, centroids: torch.Tensor, k: int) -> Clusters:
    """Lloyd iterations from the given unit centroids until assignments stop changing."""
    assignment = torch.full((x.shape[0],), -1, dtype=torch.long)
    iterations = 0
    for iterations in range(1, MAX_ITERATIONS + 1):
        sim = x @ centroids.T  # (N, k)
        new = sim.argmax(dim=1)
        if torch.bincount(new, minlength=k).min() == 0:
            new = _fill_empty(new, sim, k)
        if torch.equal(new, assignment):
            break
        assignment = new
        sums = torch.nn.functional.one_hot(assignment, k).T.to(x.dtype) @ x  # (k, H); index_add_ is slow on CPU
        centroids = torch.nn.functional.normalize(sums, dim=-1)
    return Clusters(centroids, assignment, torch.bincount(assignment, minlength=k), iterations)


def _plus_plus(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding with distance 1 - cosine; (k, H) unit vectors."""
    n = x.shape[0]
    chosen = [int(torch.randint(n, (1,), generator=gen))]
    dist = (1 - x @ x[chosen[0]]).clamp_min(0)  # (N,)
    for _ in range(1, k):
        weights = dist.double().cpu()
        if float(weights.sum()) <= 0:  # all remaining points coincide with a centroid
            idx = int(torch.randint(n, (1,), generator=gen))
        else:
            idx = int(torch.multinomial(weights, 1, generator=gen))
        chosen.append(idx)
        dist = torch.minimum(dist, (1 - x @ x[idx]).clamp_min(0))
    return x[chosen].clone()


def _fill_empty(assignment: torch.Tensor, sim: torch.Tensor, k: int) -> torch.Tensor:
    """Give each empty cluster the point farthest from its own centroid (deterministic)."""
    assignment = assignment.clone()
    for cluster in range(k):
        sizes = torch.bincount(assignment, minlength=k)
        if sizes[cluster] > 0:
            continue
        own = sim.gather(1, assignment[:, None]).squeeze(1)
        own[sizes[assignment] <= 1] = float("inf")  # never empty another cluster
        assignment[int(own.argmin())] = cluster
    return assignment
