"""Ranks agree before they write: every rank shows the facts its build rests on, and a difference is named.

Each rank of a distributed build plans on its own (the plan is pure), so two nodes given different recipes, or
different copies of a model, would each write their share of a different model into one folder: a mixed build,
published as if whole. `check_agreement` runs once every rank has planned, before the first byte is written:

- `build_facts` lists what must be the same on every rank, in the order a user looks for it: the tool and torch
  versions, the number of experts and the seed, every field of the resolved recipe (nested ones by their path,
  ``expert_init.scale``), the output folder, each source's headers and file sizes (a digest; its config.json
  too), and the plan (every output tensor's name, shape, dtype, kind and source, and the shard layout).
- every rank sends its facts (JSON, a few kilobytes) to every other with one all-gather (`World.gather_bytes`), and
  each compares the digests: all the same, the build goes on; else every rank raises the same error, which the
  lead alone prints (``cli.app``): the first fact that differs, each disagreeing rank's value and host beside rank
  0's, and how many other facts differ.

It writes nothing, and does not say why the facts differ (a recipe copied to one node only, a model re-downloaded).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any, Mapping

import torch

from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.writer import TensorSpec, assign_shards
from moe_upcycle.distributed.world import World
from moe_upcycle.errors import ConfigError, PlanError, SourceError, UpcycleError
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.schema import UpcycleConfig

SHOWN_CHARS = 60  # a value longer than this is shown cut, with its digest (prompts, long lists)
GROUPS: dict[str, tuple[type[UpcycleError], str]] = {  # group -> (error, what to do)
    "tool": (ConfigError, "run the same moe-upcycle and torch on every node"),
    "recipe": (ConfigError, "give every node the same recipe and sources"),
    "sources": (SourceError, "give every node the same copy of each model (same files, same sizes)"),
    "plan": (PlanError, "run the same moe-upcycle version with the same recipe and sources on every node"),
}


def build_facts(config: UpcycleConfig, sources: Mapping[str, Checkpoint], plan: Plan, target: Path,
                max_shard_bytes: int) -> list[tuple[str, str, str]]:
    """What every rank must agree on, as (group, name, phrase) in the order they are compared.

    A phrase says the fact as the message shows it ("seed 0", "4 experts"); it is cut at `SHOWN_CHARS` with a
    digest of the whole value, so two values differing beyond the cut still differ.

    Args:
        max_shard_bytes: the writer's shard size (the plan's tensors are dealt into shards by it).
    """
    from moe_upcycle import __version__

    facts = [("tool", "moe-upcycle", f"moe-upcycle {__version__}"), ("tool", "torch", f"torch {torch.__version__}"),
             ("recipe", "expert count", f"{len(plan.expert_names)} experts"), ("recipe", "seed", f"seed {config.seed}")]
    recipe = config.model_dump(mode="json")
    facts += [("recipe", name, _phrase(name, value)) for name, value in _leaves("", recipe) if name != "seed"]
    facts.append(("recipe", "output folder", f"output folder {target}"))
    facts += [("sources", ref, f"{ref}: {_source_summary(sources[ref])}") for ref in sorted(sources)]
    specs = [TensorSpec(s.name, s.shape, s.dtype) for s in plan.steps]
    shard_names = [[spec.name for spec in shard] for shard in assign_shards(specs, max_shard_bytes)]
    steps = [(s.name, list(s.shape), str(s.dtype), s.kind, s.source, repr(s.transforms), repr(s.parts))
             for s in plan.steps]
    facts.append(("plan", "plan", f"a plan of {len(steps)} tensors in {len(shard_names)} shards "
                                  f"(sha256 {_digest([steps, shard_names])[:12]})"))
    return facts


def check_agreement(world: World, facts: list[tuple[str, str, str]]) -> None:
    """Compare every rank's `facts` with one all-gather; return when all are the same (at once on one process).

    Raises:
        ConfigError, SourceError or PlanError (by the first fact that differs): on every rank, the same message:
            which ranks (and hosts) differ from rank 0 on which fact, with each one's value, and what to do.
    """
    if world.size == 1:
        return
    mine = {"host": socket.gethostname(), "digest": _digest(facts), "facts": facts}
    ranks = [json.loads(data) for data in world.gather_bytes(json.dumps(mine).encode())]
    if len({r["digest"] for r in ranks}) == 1:
        return
    raise disagreement(ranks)


def disagreement(ranks: list[dict[str, Any]]) -> UpcycleError:
    """The error naming the first fact on which some rank differs from rank 0 (`check_agreement`'s records)."""
    by_rank = [{(g, n): p for g, n, p in r["facts"]} for r in ranks]
    order = [tuple(f[:2]) for f in ranks[0]["facts"]]
    order += [key for facts in by_rank[1:] for key in facts if key not in by_rank[0] and key not in order]
    differing = [key for key in order if any(facts.get(key) != by_rank[0].get(key) for facts in by_rank[1:])]
    if not differing:  # the same facts under another digest: a rank computes it otherwise (another version)
        differing = [("tool", "moe-upcycle")]
    group, name = differing[0]
    said = [f"rank {r} (host {ranks[r]['host']}) has {by_rank[r].get((group, name)) or f'no {name}'}"
            for r in range(1, len(ranks)) if by_rank[r].get((group, name)) != by_rank[0].get((group, name))]
    said.append(f"rank 0 (host {ranks[0]['host']}) has {by_rank[0].get((group, name)) or f'no {name}'}")
    more = len(differing) - 1
    also = f" (and {more} more difference{'s' if more > 1 else ''})" if more else ""
    error, todo = GROUPS[group]
    return error(f"ranks disagree on the {'versions' if group == 'tool' else group}: {', '.join(said)}{also}; "
                 f"nothing was written — {todo}")


def _leaves(path: str, value: Any) -> list[tuple[str, Any]]:
    """(dotted path, value) of every scalar in a recipe's JSON; an empty list or mapping is a value itself."""
    if isinstance(value, dict) and value:
        return [leaf for key, item in value.items() for leaf in _leaves(f"{path}.{key}" if path else key, item)]
    if isinstance(value, list) and value:
        return [leaf for k, item in enumerate(value) for leaf in _leaves(f"{path}[{k}]", item)]
    return [(path, value)]


def _phrase(name: str, value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > SHOWN_CHARS:
        text = f"{text[:SHOWN_CHARS]}… (sha256 {_digest(value)[:12]})"
    return f"{name} {text}"


def _source_summary(source: Checkpoint) -> str:
    """A source's headers (every tensor's key, shape, dtype, file and offset), config.json and file sizes."""
    headers = sorted((k, list(t.shape), str(t.dtype), t.file, t.offset) for k, t in source.tensors.items())
    sizes = {file: stamp.size for file, stamp in sorted(source.stamps.items())}
    adapter = source.adapter
    if adapter is not None:
        adapter_file = Path(adapter.path) / adapter.file
        sizes[str(adapter_file)] = os.stat(adapter_file).st_size if adapter_file.exists() else -1
    # the JSON as read, whole (not through the typed view: it is compared, not used)
    config = json.dumps(getattr(source.config, "raw", source.config), sort_keys=True, default=str)
    files = f"{len(sizes)} file{'s' if len(sizes) != 1 else ''}"
    return (f"{len(headers)} tensors in {files} of {sum(sizes.values())} bytes "
            f"(headers and config sha256 {_digest([headers, config, sizes])[:12]})")


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
