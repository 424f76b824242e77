"""The plan's data types: `Step` (one output tensor) and `Plan` (all of them, decided up front).

They sit below everything that makes or reads a plan (planner, architectures, fused layout,
shared experts, gates, executor, checks), so those modules import them from here and never from
each other. Also here: the two small rules of where a slot reads from and what mergekit's
per-expert knobs do to it, shared by the routed and shared-expert planners.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import torch

from moe_upcycle.checkpoint.dense_config import DenseConfig
from moe_upcycle.checkpoint.headers import tensor_nbytes
from moe_upcycle.checkpoint.names import LM_HEAD
from moe_upcycle.recipe.layer_words import moe_layers_said
from moe_upcycle.recipe.schema import ExpertConfig


@dataclass(frozen=True)
class Step:
    """One output tensor.

    Attributes:
        name: output key.
        shape, dtype: as written.
        kind: "copy" (base tensor), "expert" (an FFN matrix placed in an expert slot), "router",
            "shared" (shared-expert matrix), "shared_gate" (computed by `shared_experts`),
            "zeros" (written as zeros), "half_gate" (the constant shared-expert gate, see `llamacpp`)
            or "average" (mean of its parts).
        source: (model ref, key) read for it; None for routers, zeros and steps made of parts.
        layer, expert: indices where meaningful.
        transforms: per-slot modifications, e.g. (("noise", 0.01),) or `inits` ones such as
            ("slice", inits.Slice(...)); a slot with any is cloned.
        parts: the steps this tensor is made of: averaged ("average"), or concatenated along
            `part_dim` and reshaped to `shape` (fused experts, several shared experts).
        part_dim: the concatenation dimension of `parts`; 0 means each part's bytes simply follow
            the previous part's, so the writer can stream them one at a time.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    source: Optional[tuple[str, str]] = None
    layer: Optional[int] = None
    expert: Optional[int] = None
    transforms: tuple[tuple[str, Any], ...] = ()
    parts: tuple["Step", ...] = ()
    part_dim: int = 0

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)

    def leaves(self) -> tuple["Step", ...]:
        """The steps that read sources: itself, or its parts."""
        return tuple(leaf for part in self.parts for leaf in part.leaves()) if self.parts else (self,)


@dataclass(frozen=True)
class Plan:
    """Everything needed to write the output, decided before any tensor is read."""

    architecture: str
    steps: tuple[Step, ...]
    expert_names: tuple[str, ...]
    experts_per_token: int
    dtype: torch.dtype
    base_config: DenseConfig  # the base's config.json, checked and typed
    tied_embeddings: bool
    notes: tuple[str, ...] = field(default=())
    expert_intermediate_size: Optional[int] = None  # set when experts are narrower than the dense FFN (split)
    layout: str = "per_expert"
    # the notes (also in `notes`) that `build` prints too: where the MoE differs from what its sources
    # or mergekit-moe would suggest (an expert's rope or vocab that the MoE does not keep, another output)
    cautions: tuple[str, ...] = field(default=())
    # base tensors outside the decoder layers that are not written (a value head, a stray buffer): a loader
    # skips them too, but a model in memory may use them (`upcycle_model` refuses those)
    not_copied: tuple[str, ...] = field(default=())
    # cautions (also in `cautions`) saying the MoE will not start as the dense model although its experts
    # come from it: a split whose top-k cannot hold whole groups, uniform gates whose ties pick the experts
    inexact: tuple[str, ...] = field(default=())
    # every router row is the same (gate_mode uniform): each expert scores the same for every token, so with
    # experts_per_token below the expert count the choice is each runtime's tie-breaking
    tied_scores: bool = False
    # layers that keep the base's dense MLP (``moe_layers:``); empty: every layer is an MoE layer
    dense_layers: tuple[int, ...] = ()
    # the top-k router weights are renormalised to sum 1 (config.json's norm_topk_prob; Mixtral always does)
    norm_topk_prob: bool = True
    # set when the base is an MoE that the build grows (`planning.grow.GrowInfo`); None for a dense base
    grow: Optional[Any] = None

    @cached_property
    def total_bytes(self) -> int:
        # cached: progress reporting asks for it after every written tensor
        return sum(s.nbytes for s in self.steps)

    @property
    def num_layers(self) -> int:
        return self.base_config.num_hidden_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with a router and experts, ascending."""
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    def moe_layers_text(self) -> str:
        """Where the experts are, for the plan and the card: ``layers 1, 3 of 4`` or ``all 4 layers``.

        Example:
            >>> from moe_upcycle.checkpoint.dense_config import dense_config
            >>> base = dense_config({"model_type": "qwen3", "hidden_size": 8, "intermediate_size": 16, "vocab_size": 10,
            ...                      "num_hidden_layers": 4, "num_attention_heads": 2}, "config.json")
            >>> Plan("qwen3_moe", (), (), 2, torch.float32, base, False, dense_layers=(0, 2)).moe_layers_text()
            'layers 1, 3 of 4'
        """
        return moe_layers_said(self.moe_layers, self.num_layers)

    def leaf_steps(self) -> list[Step]:
        """Every step that reads a source or is computed, with fused/averaged steps expanded into their parts."""
        return [leaf for s in self.steps for leaf in s.leaves()]

    @cached_property
    def experts_identical(self) -> bool:
        """Every routed expert is the same source tensors, unchanged (no noise, drop, slice or scale): whichever
        experts a token is sent to, it computes the same."""
        slots: dict[int, list] = {}
        for leaf in self.leaf_steps():
            if leaf.kind == "expert":
                slots.setdefault(leaf.expert, []).append((leaf.layer, leaf.source, leaf.transforms))
        ways = {tuple(sorted(slot, key=repr)) for slot in slots.values()}
        return len(ways) <= 1 and not any(t for way in ways for _, _, t in way)

    @property
    def tied_head_written(self) -> bool:
        """The tied head is written beside the embedding as ``lm_head.weight`` (for llama.cpp, see `llamacpp`)."""
        return self.tied_embeddings and any(s.name == LM_HEAD for s in self.steps)

    @property
    def ties_decide(self) -> bool:
        """Which experts a token goes to is left to tie-breaking, and it changes what the MoE computes."""
        return (self.tied_scores and self.experts_per_token < len(self.expert_names)
                and not self.experts_identical)

    def source_uses(self) -> Counter:
        """How many output tensors (or parts of them) each (model, key) feeds."""
        return Counter(s.source for s in self.leaf_steps() if s.source is not None)


def source_layer(expert: ExpertConfig, layer: int) -> int:
    """The source layer feeding output `layer` (shifted by the expert's `layers: [start, end)`)."""
    return layer + (expert.layers[0] if expert.layers else 0)


def mergekit_transforms(expert: ExpertConfig, proj: str) -> tuple[tuple[str, float], ...]:
    """A shared expert's modifications: mergekit's noise_scale and residual_scale (down_proj only)."""
    transforms: list[tuple[str, float]] = []
    if expert.noise_scale:
        transforms.append(("noise", float(expert.noise_scale)))
    if expert.residual_scale is not None and proj == "down_proj" and expert.residual_scale != 1.0:
        transforms.append(("scale", float(expert.residual_scale)))
    return tuple(transforms)
