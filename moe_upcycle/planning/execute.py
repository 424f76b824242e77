"""Execute a plan: read each source tensor once, place it in its slots, hand tensors to a writer.

The executor is the only place that touches tensor bytes. Storage policy:

- ``share``: every slot fed by the same source tensor receives the *same* tensor object, so
  memory does not grow with the number of experts (the source is read once and dropped after its
  last use; the plan orders its slots next to each other).
- ``clone``: every slot gets its own copy.

A slot with transforms (noise, residual scale, the `inits` methods) is always an independent copy,
whatever the policy. Each source tensor is checked for NaN/Inf once, as it passes (a warning
naming it; see `guards`), on a background thread while the writer writes it.

Steps made of parts: "average" is the fp32 mean of its parts; parts concatenated along dim 0
(fused experts) are handed to the writer as a lazy `TensorParts`, read and written one part at a
time, so a stacked (E, 2I, H) tensor is never held; other concatenations (several shared
experts' down_proj columns) are built with ``torch.cat``. "zeros" steps are zeros, "half_gate" steps
`llamacpp.half_gate`.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, Literal, Optional, Union

import torch

from moe_upcycle.planning import inits
from moe_upcycle.planning.guards import NonfiniteWatch
from moe_upcycle.planning.steps import Plan, Step
from moe_upcycle.planning.shared_experts import shared_gate
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.writer import TensorParts
from moe_upcycle.planning.llamacpp import half_gate
from moe_upcycle.terminal.cpus import usable_cpus


@contextmanager
def threads_beside_writer(workers: int = 2) -> Iterator[None]:
    """Limit torch's intra-op threads to the cores the writer's own threads leave free.

    While a checkpoint is written, the write syscalls and the sha256 worker keep `workers` cores
    busy; torch ops run beside them (casts, transforms, the NaN/Inf pass). Intra-op threads that
    outnumber the free cores wait on each other: on a 2-core machine 22 tiny matrix products took
    0.49 s with 2 threads and 0.7 ms with 1. Restored on exit (a library caller keeps its setting).
    """
    before = torch.get_num_threads()
    cores = usable_cpus()
    torch.set_num_threads(max(1, min(before, cores - workers)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def slot_generator(seed: int, step: Step, device: inits.DeviceLike = None) -> torch.Generator:
    """A generator on `device` (default CPU) seeded from (seed, tensor name): stable whatever the slot order."""
    digest = hashlib.sha256(f"{seed}:{step.name}".encode()).digest()
    return torch.Generator(device=device or "cpu").manual_seed(int.from_bytes(digest[:8], "little"))


def apply_transforms(tensor: torch.Tensor, step: Step, seed: int) -> torch.Tensor:
    """Apply a slot's transforms in fp32 (always on a fresh copy), on the tensor's device.

    One fp32 copy of the slot plus, for a draw, one tensor of draws, scaled and added in place: the
    same values as ``out + randn * value``, without a temporary for each operation.
    """
    out = tensor.to(torch.float32, copy=True)
    dev = out.device
    for name, value in step.transforms:
        if name == "noise":  # mergekit's noise_scale: absolute Gaussian noise
            out += torch.randn(out.shape, generator=slot_generator(seed, step, dev), device=dev).mul_(value)
        elif name == "scale":
            out *= value
        elif name in inits.TRANSFORMS:
            out = inits.apply_transform(out, name, value, step.layer, step.expert, seed,
                                        slot_generator(seed, step, dev))
        else:
            raise ValueError(f"unknown transform {name!r}")
    return out


def iter_tensors(
    plan: Plan,
    sources: dict[str, Checkpoint],
    gates: dict[int, torch.Tensor],
    policy: Literal["share", "clone"] = "share",
    seed: int = 0,
    shared_gates: Optional[dict[int, torch.Tensor]] = None,
) -> Iterator[tuple[Step, Union[torch.Tensor, TensorParts]]]:
    """Yield (step, tensor) for every planned output tensor, in plan order.

    A fused step yields a `TensorParts`, which reads its parts as it is consumed: consume it
    (``writer.write`` or ``.materialize()``) before advancing the iterator.

    Args:
        plan: from `make_plan`.
        sources: the opened checkpoints, keyed by reference.
        gates: layer -> router weights (num_experts, hidden).
        policy: "share" or "clone" (see module doc).
        seed: seeds per-slot transforms.
        shared_gates: layer -> shared-expert gate (1, hidden), for "shared_gate" steps.
    """
    # keyed by the bytes read: the same model under two LoRA adapters shares the tensors neither adapts
    def same(src: tuple[str, str]) -> tuple[str, str]:
        return sources[src[0]].identity(src[1])

    remaining: Counter = Counter()
    for src, uses in plan.source_uses().items():
        remaining[same(src)] += uses
    # transforms (residual_scale, noise, expert inits) start from the source's own precision and are rounded
    # to the output dtype once, as mergekit-moe does: a source they use keeps its raw tensor while cached
    transformed = {same(s.source) for s in plan.leaf_steps() if s.transforms and s.source is not None}
    cache: dict[tuple[str, str], torch.Tensor] = {}
    raws: dict[tuple[str, str], torch.Tensor] = {}

    def slot(step: Step) -> torch.Tensor:
        src = step.source
        key = same(src)
        base = cache.get(key)
        if base is None:
            raw = sources[src[0]].read(src[1])
            base = raw.to(step.dtype)
            watch.submit(base, raw, src[1], sources[src[0]])  # once per source tensor, no extra read
            if key in transformed:
                raws[key] = raw
            del raw
            cache[key] = base
        raw = raws.get(key, base)
        remaining[key] -= 1
        if remaining[key] == 0:
            del cache[key]
            raws.pop(key, None)
        if step.transforms:
            return apply_transforms(raw, step, seed).to(step.dtype)
        if policy == "clone" and step.kind in ("expert", "shared"):
            return base.clone()
        return base

    def streamed(parts: tuple[Step, ...]) -> Iterator[torch.Tensor]:
        for part in parts:
            yield slot(part)

    with torch.inference_mode(), NonfiniteWatch() as watch:
        for step in plan.steps:
            if step.kind == "router":
                tensor = gates[step.layer].to(step.dtype)
            elif step.kind == "shared_gate":
                tensor = shared_gate(shared_gates, step).to(step.dtype)
            elif step.kind == "zeros":
                tensor = torch.zeros(step.shape, dtype=step.dtype)
            elif step.kind == "half_gate":
                tensor = half_gate(step.shape, step.dtype)
            elif step.kind == "average":  # fp32 mean, one part in memory at a time
                total = None  # on the parts' device (an in-memory model may be on a GPU)
                for part in step.parts:
                    x = slot(part).float()
                    total = x.clone() if total is None else total.add_(x)
                tensor = (total / len(step.parts)).to(step.dtype)
            elif step.parts and step.part_dim == 0:
                tensor = TensorParts(step.shape, step.dtype, streamed(step.parts))
            elif step.parts:
                tensor = torch.cat([slot(part) for part in step.parts], dim=step.part_dim)
            else:
                tensor = slot(step)
            yield step, tensor
