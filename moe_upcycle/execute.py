"""Execute a plan: read each source tensor once, place it in its slots, hand tensors to a writer.

The executor is the only place that touches tensor bytes. Storage policy:

- ``share``: every slot fed by the same source tensor receives the *same* tensor object, so
  memory does not grow with the number of experts (the source is read once and dropped after its
  last use; the plan orders its slots next to each other).
- ``clone``: every slot gets its own copy.

A slot with transforms (noise, residual scale) is always an independent copy, whatever the policy.
Each source tensor is checked for NaN/Inf once, as it passes (a warning naming it; see `guards`).
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Literal

import torch

from .guards import warn_nonfinite
from .plan import Plan, Step
from .source import Checkpoint


def slot_generator(seed: int, step: Step) -> torch.Generator:
    """A generator seeded from (seed, tensor name): stable whatever order slots are made in."""
    digest = hashlib.sha256(f"{seed}:{step.name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def apply_transforms(tensor: torch.Tensor, step: Step, seed: int) -> torch.Tensor:
    """Apply a slot's transforms in fp32 (always on a fresh copy)."""
    out = tensor.float().clone()
    for name, value in step.transforms:
        if name == "noise":  # mergekit's noise_scale: absolute Gaussian noise
            out += torch.randn(out.shape, generator=slot_generator(seed, step)) * value
        elif name == "scale":
            out *= value
        else:
            raise ValueError(f"unknown transform {name!r}")
    return out


def iter_tensors(
    plan: Plan,
    sources: dict[str, Checkpoint],
    gates: dict[int, torch.Tensor],
    policy: Literal["share", "clone"] = "share",
    seed: int = 0,
) -> Iterator[tuple[Step, torch.Tensor]]:
    """Yield (step, tensor) for every planned output tensor, in plan order.

    Args:
        plan: from `make_plan`.
        sources: the opened checkpoints, keyed by reference.
        gates: layer -> router weights (num_experts, hidden).
        policy: "share" or "clone" (see module doc).
        seed: seeds per-slot transforms.
    """
    remaining = plan.source_uses()
    cache: dict[tuple[str, str], torch.Tensor] = {}
    with torch.inference_mode():
        for step in plan.steps:
            if step.kind == "router":
                tensor = gates[step.layer].to(step.dtype)
            else:
                src = step.source
                base = cache.get(src)
                if base is None:
                    raw = sources[src[0]].read(src[1])
                    base = raw.to(step.dtype)
                    warn_nonfinite(base, raw, src[1], sources[src[0]])  # once per source tensor, no extra read
                    del raw
                    cache[src] = base
                remaining[src] -= 1
                if remaining[src] == 0:
                    del cache[src]
                if step.transforms:
                    tensor = apply_transforms(base, step, seed).to(step.dtype)
                elif policy == "clone" and step.kind == "expert":
                    tensor = base.clone()
                else:
                    tensor = base
            yield step, tensor
