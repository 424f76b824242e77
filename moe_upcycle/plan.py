"""Plan a build: which output tensors exist, where each comes from, what is done to it.

`make_plan(config, sources)` is pure: it reads only checkpoint headers (shapes, dtypes) and the
sources' config.json, checks every source against the base, and reports **all** problems at once
as one `PlanError`. It runs on meta checkpoints too, so a Mixtral-8x7B plan costs milliseconds.
Only `execute` touches tensor bytes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import inits, names
from .config import UpcycleConfig
from .errors import PlanError
from .source import Checkpoint, TensorInfo

STR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# buffers some old .bin checkpoints carry; transformers recomputes them
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class Step:
    """One output tensor.

    Attributes:
        name: output key.
        shape, dtype: as written.
        kind: "copy" (base tensor), "expert" (an FFN matrix placed in an expert slot) or "router".
        source: (model ref, key) read for it; None for routers (computed by `gates`).
        layer, expert: indices where meaningful.
        transforms: per-slot modifications, e.g. (("noise", 0.01),) or `inits` ones such as
            ("slice", inits.Slice(...)); a slot with any is cloned.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    source: Optional[tuple[str, str]] = None
    layer: Optional[int] = None
    expert: Optional[int] = None
    transforms: tuple[tuple[str, Any], ...] = ()

    @property
    def nbytes(self) -> int:
        return TensorInfo(self.name, self.shape, self.dtype, "").nbytes


@dataclass(frozen=True)
class Plan:
    """Everything needed to write the output, decided before any tensor is read."""

    architecture: str
    steps: tuple[Step, ...]
    expert_names: tuple[str, ...]
    experts_per_token: int
    dtype: torch.dtype
    base_config: dict
    tied_embeddings: bool
    notes: tuple[str, ...] = field(default=())
    expert_intermediate_size: Optional[int] = None  # set when experts are narrower than the dense FFN (split)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.steps)

    @property
    def num_layers(self) -> int:
        return int(self.base_config["num_hidden_layers"])

    def source_uses(self) -> Counter:
        """How many output tensors each (model, key) feeds."""
        return Counter(s.source for s in self.steps if s.source is not None)


def make_plan(config: UpcycleConfig, sources: dict[str, Checkpoint]) -> Plan:
    """Plan the output tensors of a build.

    Args:
        config: the validated recipe.
        sources: every model the config names (base and experts), keyed by its reference.

    Returns:
        The plan, steps ordered layer by layer; within a layer each dense matrix's expert slots
        follow each other, so a shared source tensor is read once and dropped right after.

    Raises:
        PlanError: every incompatibility found, all at once.
    """
    problems: list[str] = []
    base = sources[config.base_model]
    experts = config.expert_list()
    try:
        names.input_family(base.model_type, f"base_model ({config.base_model})")
    except PlanError as exc:
        raise PlanError(*exc.problems) from None
    arch = config.architecture or "mixtral"
    if arch == "qwen":
        arch = "qwen2_moe"
    try:
        layout = names.output_layout(arch)
    except PlanError as exc:
        raise PlanError(*exc.problems) from None
    if config.shared_experts:
        problems.append(f"shared_experts: the {arch} architecture has no shared experts; remove them "
                        f"(shared experts need architecture: qwen2_moe)")

    bcfg = base.config
    for i, expert in enumerate(experts):
        src = sources[expert.source_model]
        if src is base:
            continue
        label = f"experts[{i}] ({expert.source_model})"
        if src.model_type != base.model_type:
            problems.append(f"{label}: model_type {src.model_type!r} differs from base_model's {base.model_type!r}; "
                            f"experts must be fine-tunes of the same family as base_model")
        for key in SHAPE_FIELDS:
            if src.config.get(key) != bcfg.get(key):
                problems.append(f"{label}: {key} is {src.config.get(key)} but base_model "
                                f"{config.base_model} has {bcfg.get(key)}; experts must have the base's shape")

    g = inits.granularity(config)
    init_of = inits.expert_inits(config)
    dense_i = int(bcfg["intermediate_size"])
    if dense_i % g:
        problems.append(f"expert_init.granularity: {g} does not divide intermediate_size {dense_i} of "
                        f"{config.base_model}; use a divisor of {dense_i}")
    dtype = STR_DTYPES[config.dtype] if config.dtype else _base_dtype(base)
    tied = bool(bcfg.get("tie_word_embeddings", False))
    n_layers = int(bcfg["num_hidden_layers"])
    steps: list[Step] = []
    notes: list[str] = []

    def need(model: Checkpoint, key: str, label: str) -> Optional[TensorInfo]:
        info = model.tensors.get(key)
        if info is None:
            problems.append(f"{label}: tensor {key!r} is missing from {model.path or model.ref}")
        return info

    def copy(key: str) -> None:
        info = need(base, key, f"base_model ({config.base_model})")
        if info:
            steps.append(Step(key, info.shape, dtype, "copy", (config.base_model, key), names.split_layer(key)[1]))

    # Sort base tensors into top-level, per-layer allowed, MLP, and ones the output cannot hold.
    per_layer: dict[int, list[str]] = {i: [] for i in range(n_layers)}
    for key in base.tensors:
        template, layer = names.split_layer(key)
        if key.endswith(IGNORED_SUFFIXES):
            notes.append(f"skipped buffer {key} (recomputed by transformers)")
            continue
        if layer is None:
            continue
        if layer >= n_layers:
            problems.append(f"base_model: tensor {key!r} is beyond num_hidden_layers={n_layers} in config.json")
            continue
        suffix = template.removeprefix("model.layers.{layer}.")
        if suffix.startswith("mlp."):
            if not any(suffix == f"mlp.{p}.weight" for p in names.PROJS):
                problems.append(f"base_model: tensor {key!r} ({suffix}) cannot be placed in {arch} experts, "
                                f"which have no MLP biases; it would be silently dropped, so the build stops")
            continue
        if suffix not in layout.layer_tensors:
            problems.append(f"base_model: tensor {key!r} has no place in the {arch} architecture "
                            f"(it holds only {', '.join(layout.layer_tensors)}); it would be dropped, so the build stops")
            continue
        per_layer[layer].append(key)

    copy(names.EMBED)
    for layer in range(n_layers):
        for suffix in layout.layer_tensors:
            key = f"model.layers.{layer}.{suffix}"
            if key not in per_layer[layer]:
                need(base, key, f"base_model ({config.base_model})")
        for key in per_layer[layer]:
            copy(key)
        hidden = int(bcfg["hidden_size"])
        steps.append(Step(names.fill(layout.router, layer=layer), (len(experts), hidden), dtype, "router",
                          layer=layer))
        for proj in names.PROJS:
            for e, expert in enumerate(experts):
                src = sources[expert.source_model]
                key = names.fill(names.DENSE_MLP, layer=layer, proj=proj)
                info = need(src, key, f"experts[{e}] ({expert.source_model})")
                if info is None:
                    continue
                transforms = inits.slot_transforms(init_of[e], proj, e)
                if expert.residual_scale is not None and proj == "down_proj" and expert.residual_scale != 1.0:
                    transforms.append(("scale", float(expert.residual_scale)))
                shape = inits.sliced_shape(info.shape, proj, g)
                steps.append(Step(names.fill(layout.expert[proj], layer=layer, expert=e), shape, dtype,
                                  "expert", (expert.source_model, key), layer, e, tuple(transforms)))
    copy("model.norm.weight")
    if not tied:
        copy(names.LM_HEAD)
    elif names.LM_HEAD in base.tensors:
        notes.append("lm_head.weight is tied to model.embed_tokens.weight (tie_word_embeddings: true); written once")

    if g > 1:
        groups = [{x.source_model for x in experts[i:i + g]} for i in range(0, len(experts), g)]
        notes += inits.split_notes(len(experts), config.experts_per_token, g, groups, dense_i, config.gate_mode,
                                   dtype.itemsize)
    notes += inits.describe(init_of, dense_i)
    if problems:
        raise PlanError(*_dedupe(problems))
    return Plan(arch, tuple(steps), tuple(e.name or "" for e in experts), config.experts_per_token, dtype,
                dict(bcfg), tied, tuple(notes), dense_i // g if g > 1 else None)


def _base_dtype(base: Checkpoint) -> torch.dtype:
    name = base.config.get("torch_dtype") or base.config.get("dtype")
    if name in STR_DTYPES:
        return STR_DTYPES[name]
    info = base.tensors.get(names.EMBED)
    return info.dtype if info and info.dtype.is_floating_point else torch.float32


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
