"""Deal a build's output shards to the ranks of a job, and cut the plan down to one rank's tensors.

Every rank makes the same plan (it is pure and deterministic) and the same shard layout
(`checkpoint.writer.assign_shards`), so each can work out its own part without being told: `deal_shards` gives
rank r a run of consecutive shards, the runs balanced by bytes (no rank holds more than its share plus one
shard). Consecutive shards hold consecutive layers, so a rank reads a contiguous stretch of the sources and
a source tensor feeding several expert slots is read by one rank (two where a run ends inside its slots).

`rank_plan` is the plan of those shards' tensors only, in the same order: the executor's read counts and
share cache then count that rank's uses. Values do not depend on the rank that computes them: random inits
are drawn per (seed, tensor name) (`planning.execute.slot_generator`) and routers come from the lead.

It does not write anything, nor talk to other ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from moe_upcycle.planning.steps import Plan


def deal_shards(shard_bytes: Sequence[int], ranks: int) -> list[range]:
    """Consecutive runs of shard indices, one per rank, balanced by bytes; a rank may get none (fewer shards).

    A shard goes to the rank whose even share of the bytes holds its middle byte.

    Example:
        >>> deal_shards([4, 4, 4, 4, 8], 2)
        [range(0, 3), range(3, 5)]
        >>> deal_shards([10], 3)
        [range(0, 0), range(0, 1), range(1, 1)]
    """
    total = sum(shard_bytes)
    bounds, done, k = [0], 0, 0
    for r in range(1, ranks):
        goal = total * r / ranks
        while k < len(shard_bytes) and done + shard_bytes[k] / 2 < goal:
            done += shard_bytes[k]
            k += 1
        bounds.append(k)
    bounds.append(len(shard_bytes))
    return [range(bounds[r], bounds[r + 1]) for r in range(ranks)]


def rank_plan(plan: Plan, names: Sequence[str]) -> Plan:
    """The plan of the output tensors named `names` only, in plan order (one rank's shards)."""
    wanted = set(names)
    return dataclasses.replace(plan, steps=tuple(s for s in plan.steps if s.name in wanted))
