"""Expert initialisations for sparse upcycling: copy, noise, Drop-Upcycling and fine-grained split.

Each method is described per expert slot as plan transforms (``Step.transforms``) and applied
to one matrix at a time by `apply_transform`, so every method streams like a plain copy. All
randomness comes from generators keyed on ``(seed, what, layer, expert/group)``: the same seed
gives the same bytes whatever order the slots are made in.

Methods (``expert_init.method``):

- ``copy``: the dense FFN, unchanged (function-preserving).
- ``noise``: add N(0, σ²) with σ = ``scale`` · std(matrix) (or σ = ``scale`` with
  ``absolute: true``, which is what mergekit's ``noise_scale`` does).
- ``drop`` (Drop-Upcycling, Nakamura et al., ICLR 2025): per (layer, expert) one set of
  ``round_half_up(ratio · I)`` intermediate neurons, shared by gate/up (rows) and down
  (columns), is re-drawn from N(mean(W), std(W)²) of the original matrix W; the rest is kept
  byte for byte.
- ``split`` (fine-grained experts, Qwen1.5-MoE / Megatron granular upcycling): expert j takes
  slice ``j % G`` of the intermediate dimension (I/G neurons, optionally after a permutation
  seeded per (layer, virtual group ``j // G``)), and its down projection is multiplied by G.
  With routers tied within each virtual group (`tie_router_rows`), a token's top-k holds
  k/G whole groups whenever G divides k and E; Mixtral renormalises the top-k weights, so
  each group carries total weight 1/G and Σ_group w·G·Σ_slices = dense FFN exactly.
  `split_notes` says when that does not hold.

It does not decide where slots go (that is `plan`) nor read checkpoints (that is `execute`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Union

import torch

from moe_upcycle.recipe.schema import ExpertInit, UpcycleConfig

# transform names handled here (execute also knows "noise" (absolute) and "scale")
TRANSFORMS = ("rel_noise", "drop", "slice")
DeviceLike = Union[torch.device, str, None]


@dataclass(frozen=True)
class Drop:
    """Drop-Upcycling of one matrix: `ratio` of the neurons along `axis` (0: rows of gate/up, 1: columns of down)."""

    ratio: float
    axis: int


@dataclass(frozen=True)
class Slice:
    """Slice `index` of `granularity` along `axis`; `group` keys the optional shuffle permutation."""

    granularity: int
    index: int
    axis: int
    group: int
    shuffle: bool


def keyed_generator(seed: int, *parts: Any, device: DeviceLike = None) -> torch.Generator:
    """A generator on `device` (default CPU) seeded from (seed, parts) by sha256: independent of call order.

    CPU and CUDA generators are different algorithms (Mersenne Twister, Philox): the same seed
    gives different draws on each, but always the same draws on the same device type.
    """
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return torch.Generator(device=device or "cpu").manual_seed(int.from_bytes(digest[:8], "little"))


def drop_count(intermediate: int, ratio: float) -> int:
    """Number of neurons Drop-Upcycling re-initialises: ratio·I rounded half up.

    Example:
        >>> drop_count(172, 0.5), drop_count(5, 0.5)
        (86, 3)
    """
    return int(ratio * intermediate + 0.5)


def drop_indices(intermediate: int, ratio: float, seed: int, layer: int, expert: int,
                 device: DeviceLike = None) -> torch.Tensor:
    """The sorted neuron indices dropped for (layer, expert); one set for gate, up and down (drawn on `device`)."""
    gen = keyed_generator(seed, "drop", layer, expert, device=device)
    perm = torch.randperm(intermediate, generator=gen, device=gen.device)
    return perm[: drop_count(intermediate, ratio)].sort().values


def split_permutation(intermediate: int, seed: int, layer: int, group: int, device: DeviceLike = None) -> torch.Tensor:
    """The neuron order whose consecutive slices form virtual group `group`'s experts (drawn on `device`)."""
    gen = keyed_generator(seed, "split", layer, group, device=device)
    return torch.randperm(intermediate, generator=gen, device=gen.device)


def granularity(config: UpcycleConfig) -> int:
    """G for ``expert_init: split``, else 1."""
    init = config.expert_init
    return int(init.granularity) if init.method == "split" and init.granularity else 1


def slot_transforms(init: ExpertInit, proj: str, expert: int) -> list[tuple[str, Any]]:
    """Plan transforms for one expert matrix (`proj` is gate_proj, up_proj or down_proj).

    Example:
        >>> slot_transforms(ExpertInit(method="split", granularity=2), "down_proj", 3)
        [('slice', Slice(granularity=2, index=1, axis=1, group=1, shuffle=False)), ('scale', 2.0)]
    """
    axis = 1 if proj == "down_proj" else 0  # neurons are rows of gate/up (I, H), columns of down (H, I)
    if init.method == "noise":
        return [("noise", float(init.scale))] if init.absolute else [("rel_noise", float(init.scale))]
    if init.method == "drop":
        return [("drop", Drop(0.5 if init.ratio is None else float(init.ratio), axis))]
    if init.method == "split":
        g = int(init.granularity)
        out: list[tuple[str, Any]] = [("slice", Slice(g, expert % g, axis, expert // g, init.shuffle))]
        if proj == "down_proj":
            out.append(("scale", float(g)))
        return out
    return []


def sliced_shape(shape: tuple[int, ...], proj: str, g: int) -> tuple[int, ...]:
    """Shape of an expert matrix after `split` with granularity g."""
    if g == 1:
        return shape
    return (shape[0], shape[1] // g) if proj == "down_proj" else (shape[0] // g, shape[1])


def apply_transform(out: torch.Tensor, name: str, value: Any, layer: int, expert: int, seed: int,
                    slot_gen: torch.Generator) -> torch.Tensor:
    """Apply one of `TRANSFORMS` to an fp32 matrix (a private copy, changed in place) and return the result.

    Args:
        out: the slot's matrix so far, fp32.
        name, value: the transform, as planned by `slot_transforms`.
        layer, expert: the slot, which keys the neuron sets (shared by gate/up/down of an expert).
        seed: the build seed.
        slot_gen: a generator keyed on the slot's name, for values drawn for this matrix only, on
            `out`'s device (every draw is made where the matrix is: nothing crosses devices).
    """
    if name == "rel_noise":
        return out.add_(torch.randn(out.shape, generator=slot_gen, device=out.device).mul_(value * out.std()))
    if name == "drop":
        n_neurons = out.shape[value.axis]
        idx = drop_indices(n_neurons, value.ratio, seed, layer, expert, device=out.device)
        shape = list(out.shape)
        shape[value.axis] = len(idx)
        fresh = torch.randn(shape, generator=slot_gen, device=out.device).mul_(out.std()).add_(out.mean())
        out.index_copy_(value.axis, idx, fresh)
        return out
    if name == "slice":
        n_neurons = out.shape[value.axis]
        width = n_neurons // value.granularity
        if value.shuffle:
            order = split_permutation(n_neurons, seed, layer, value.group, device=out.device)
        else:
            order = torch.arange(n_neurons, device=out.device)
        keep = order[value.index * width:(value.index + 1) * width]
        return out.index_select(value.axis, keep).contiguous()
    raise ValueError(f"unknown transform {name!r}")


def tie_router_rows(rows: torch.Tensor, g: int, reduce: str = "first") -> torch.Tensor:
    """Give every expert of a virtual group (g consecutive experts) the same router row.

    Args:
        rows: (E, H) router weights, one row per expert.
        g: group size (the split granularity); 1 returns `rows` unchanged.
        reduce: "first" (each group takes its first row: for random draws this is an i.i.d.
            draw per group, so `router_init_std` keeps its meaning) or "mean" (prompt-based rows).

    Returns:
        (E, H) with rows equal within each group (a trailing partial group is tied too).
    """
    if g == 1:
        return rows
    out = rows.clone()
    for start in range(0, rows.shape[0], g):
        block = rows[start:start + g]
        out[start:start + g] = block[0] if reduce == "first" else block.mean(dim=0)
    return out


def split_notes(num_experts: int, top_k: int, g: int, group_sources: list[set[str]],
                intermediate: int, gate_mode: str, itemsize: int = 4) -> tuple[list[str], str]:
    """Say whether a split build is function-preserving at init, and why not when it is not.

    Args:
        num_experts, top_k, g: E, k and the granularity G.
        group_sources: the source models of each virtual group's experts.
        intermediate: the dense intermediate size I.
        gate_mode: the router mode (``uniform`` leaves ties to torch.topk).
        itemsize: bytes per element of the output dtype.

    Returns:
        (the plan's notes, the one saying why it is not function-preserving, or '' when it is).
    """
    why = []
    if num_experts % g:
        why.append(f"num_experts {num_experts} is not a multiple of granularity {g}, so the last virtual group "
                   f"lacks {g - num_experts % g} slice(s)")
    if top_k % g:
        why.append(f"experts_per_token {top_k} is not a multiple of granularity {g}, so a token's top-{top_k} "
                   f"cannot hold whole virtual groups")
    if any(len(s) > 1 for s in group_sources):
        why.append("a virtual group mixes source models, so its slices do not add up to one dense FFN")
    if gate_mode == "uniform":
        why.append("gate_mode uniform gives every expert the same score and leaves the top-k choice to tie-breaking")
    head = (f"expert_init split: {num_experts} experts of intermediate size {intermediate // g} "
            f"(dense {intermediate} / granularity {g}) in {-(-num_experts // g)} virtual group(s); routers tied "
            f"within each group, down_proj scaled by {g}")
    if why:
        inexact = ("expert_init split is NOT function-preserving at init: " + "; ".join(why)
                   + ". Expect the outputs to move from the dense model's.")
        return [head, "  " + inexact], inexact
    exact = ("  function-preserving at init: each token's top-k holds whole virtual groups (exact up to float "
             "rounding")
    if itemsize < 4:  # the router's logits are rounded to 16 bits: two groups can tie exactly
        exact += ("; in a 16-bit dtype the router logits of two groups can round to the same value, and a token's "
                  "top-k then takes experts of both: rare, but that token's output is off there — measured on "
                  "stories260K in bf16 and fp16: 1-2 of 1,135 token-layers, up to 3.5 logits; fp32 keeps them apart")
    return [head, exact + ")"], ""


def describe(per_expert: list[ExpertInit], intermediate: int) -> list[str]:
    """One plan note per distinct non-copy, non-split init, naming the experts it applies to."""
    by_init: dict[ExpertInit, list[int]] = {}
    for i, init in enumerate(per_expert):
        if init.method in ("noise", "drop"):
            by_init.setdefault(init, []).append(i)
    lines = []
    for init, experts in by_init.items():
        if init.method == "noise":
            what = (f"Gaussian noise, std {init.scale} (absolute)" if init.absolute
                    else f"Gaussian noise, std {init.scale} x each matrix's std")
        else:
            ratio = 0.5 if init.ratio is None else init.ratio
            what = (f"Drop-Upcycling, {drop_count(intermediate, ratio)} of {intermediate} neurons per expert "
                    f"re-initialised (ratio {ratio})")
        lines.append(f"expert_init {init.method} on expert(s) {experts}: {what}")
    return lines
