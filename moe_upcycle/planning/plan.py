"""Plan a build: which output tensors exist, where each comes from, what is done to it.

`make_plan(config, sources)` is pure: it reads only checkpoint headers (shapes, dtypes) and the
sources' config.json, checks every source against the base, and reports **all** problems at once
as one `PlanError`. It runs on meta checkpoints too, so a Mixtral-8x7B plan costs milliseconds.
Only `execute` touches tensor bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.headers import TensorInfo
from moe_upcycle.dtypes import dtype_name
from moe_upcycle.errors import PlanError
from moe_upcycle.planning import (arch, compat, fused, glm4, grow, hybrid, inits, llamacpp, shared_experts,
                                  source_checks, sparsity)
from moe_upcycle.planning.steps import Plan, Step, source_layer
from moe_upcycle.recipe.params import MoeLayers, unused_prompts_note
from moe_upcycle.recipe.resolved import resolved
from moe_upcycle.recipe.schema import ExpertConfig, ExpertInit, UpcycleConfig

__all__ = ["Plan", "Step", "make_plan"]

# buffers some old .bin checkpoints carry; transformers recomputes them
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def make_plan(config: UpcycleConfig, sources: dict[str, Checkpoint]) -> Plan:
    """Plan the output tensors of a build.

    The steps, in order: check the sources against the base (`_check_sources`, which stops at the first
    mismatch class), fix the output's shape (`_draft`), sort the base's tensors (`_sort_base_tensors`),
    place the embedding, each layer (`_plan_layer`) and the head (`_plan_head`), gather the notes
    (`_gather_notes`), and seal the plan (`_finish`).

    Args:
        config: the validated recipe.
        sources: every model the config names (base and experts), keyed by its reference.

    Returns:
        The plan, steps ordered layer by layer; within a layer each dense matrix's expert slots
        follow each other, so a shared source tensor is read once and dropped right after.

    Raises:
        PlanError: every incompatibility found, all at once.
    """
    base = sources[config.base_model]
    if grow.is_grow(base):  # an MoE base: grown, not upcycled (`grow`)
        return grow.make_grow_plan(config, sources)
    layout = arch.choose_layout(config, base)  # raises with every candidate's reasons
    used = _models_used(config)
    _check_sources(config, sources, layout, used)
    draft = _draft(config, sources, layout)
    per_layer = _sort_base_tensors(draft)
    draft.copy(names.EMBED)
    for layer in range(draft.n_layers):
        _plan_layer(draft, layer, per_layer[layer])
    _plan_head(draft)
    _gather_notes(draft, used)
    return _finish(draft)


@dataclasses.dataclass
class _Draft:
    """The plan being made: what the steps below share and append to (steps, notes, problems in order)."""

    config: UpcycleConfig
    sources: dict[str, Checkpoint]
    layout: names.OutputLayout
    dtype: torch.dtype
    chosen: MoeLayers
    granularity: int
    init_of: tuple[ExpertInit, ...]
    problems: list[str]
    steps: list[Step] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    cautions: list[str] = dataclasses.field(default_factory=list)
    inexact: list[str] = dataclasses.field(default_factory=list)
    extra: list[str] = dataclasses.field(default_factory=list)  # outside the layers and not embedding/norm/head
    has_bias: bool = False  # some layer of the base has one of the output's bias tensors

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers that keep the base's dense MLP (``moe_layers:``), ascending."""
        return self.chosen.dense_layers(self.n_layers)

    @property
    def base(self) -> Checkpoint:
        return self.sources[self.config.base_model]

    @property
    def n_layers(self) -> int:
        return self.base.fields.num_hidden_layers

    @property
    def experts(self) -> list[ExpertConfig]:
        return self.config.expert_list()

    @property
    def base_label(self) -> str:
        return f"base_model ({self.config.base_model})"

    def need(self, model: Checkpoint, key: str, label: str) -> Optional[TensorInfo]:
        """`key`'s header in `model`, or None with a problem naming it (`label`: the YAML field)."""
        info = model.tensors.get(key)
        if info is None:
            # transformers would initialise a missing lm_head at random unless the config ties it
            tie = (f" (config.json has tie_word_embeddings: {str(model.fields.tie_word_embeddings).lower()}"
                   f"; if the model's output head is its embedding, set it to true)" if key == names.LM_HEAD else "")
            self.problems.append(f"{label}: tensor {key!r} is missing from {model.path or model.ref}{tie}")
        return info

    def copy(self, key: str) -> None:
        """A step copying the base's `key` (averaged over the experts' sources with ``attention_from: average``)."""
        info = self.need(self.base, key, self.base_label)
        layer = names.split_layer(key)[1]
        if info and self.config.attention_from == "average":  # Branch-Train-MiX: mean over the expert sources
            refs = compat.average_sources(self.config)
            parts = tuple(Step(key, info.shape, self.dtype, "copy", (ref, key), layer) for ref in refs
                          if key in self.sources[ref].tensors)  # a missing one is reported by compat
            self.steps.append(Step(key, info.shape, self.dtype, "average", None, layer, parts=parts))
        elif info:
            self.steps.append(Step(key, info.shape, self.dtype, "copy", (self.config.base_model, key), layer))


def _models_used(config: UpcycleConfig) -> list[tuple[str, str]]:
    """(YAML field, model) of every routed and shared expert."""
    used = [(f"experts[{i}]", e.source_model) for i, e in enumerate(config.expert_list())]
    return used + [(f"shared_experts[{i}]", e.source_model) for i, e in enumerate(config.shared_experts)]


def _check_sources(config: UpcycleConfig, sources: dict[str, Checkpoint], layout: names.OutputLayout,
                   used: list[tuple[str, str]]) -> None:
    """Raise every way the sources do not fit the base (family, sizes, config.json against the shapes): the
    per-tensor checks of sources that do not fit would only repeat these."""
    problems = compat.source_problems(config, sources)
    problems += hybrid.problems(layout, sources[config.base_model].fields, f"base_model ({config.base_model})")
    problems += source_checks.expert_problems(config.base_model, used, sources,
                                              attention_average=config.attention_from == "average")
    for ref, ckpt in sources.items():  # config.json against the tensor shapes, every source
        problems += source_checks.shape_problems(ckpt, f"{_where(config, ref)} ({ref})")
    if problems:
        raise PlanError(*problems)


def _draft(config: UpcycleConfig, sources: dict[str, Checkpoint], layout: names.OutputLayout) -> _Draft:
    """The output's dtype, MoE layers and expert inits, with the problems of each (granularity first)."""
    base = sources[config.base_model]
    problems: list[str] = []
    g = inits.granularity(config)
    dense_i = base.fields.intermediate_size
    if dense_i % g:
        problems.append(f"expert_init.granularity: {g} does not divide intermediate_size {dense_i} of "
                        f"{config.base_model}; use a divisor of {dense_i}")
    recipe = resolved(config)
    dtype = recipe.dtype or _base_dtype(base, problems)
    chosen = recipe.moe_layers
    problems += chosen.problems(base.fields.num_hidden_layers, f"base_model ({config.base_model})")
    return _Draft(config, sources, layout, dtype, chosen, g, recipe.inits, problems)


def _sort_base_tensors(draft: _Draft) -> dict[int, list[str]]:
    """The base's tensors each layer copies; the top-level ones the output does not hold go to `draft.extra`,
    buffers transformers recomputes to a note, and MLP biases or tensors the output cannot hold to problems."""
    base, layout, n_layers = draft.base, draft.layout, draft.n_layers
    per_layer: dict[int, list[str]] = {i: [] for i in range(n_layers)}
    for key in base.tensors:
        template, layer = names.split_layer(key)
        if key.endswith(IGNORED_SUFFIXES):
            draft.notes.append(f"skipped buffer {key} (recomputed by transformers)")
            continue
        if layer is None:
            if key not in (names.EMBED, "model.norm.weight", names.LM_HEAD):
                draft.extra.append(key)
            continue
        if layer >= n_layers:
            draft.problems.append(f"base_model: tensor {key!r} is beyond num_hidden_layers={n_layers} in config.json")
            continue
        suffix = template.removeprefix("model.layers.{layer}.")
        if suffix.startswith("mlp."):
            if not any(suffix == f"mlp.{p}.weight" for p in names.PROJS):
                draft.problems.append(f"base_model: tensor {key!r} ({suffix}) cannot be placed in "
                                      f"{layout.model_type} experts, which have no MLP biases; it would be silently "
                                      f"dropped, so the build stops")
            continue
        if not layout.holds(suffix):
            draft.problems.append(f"base_model: tensor {key!r} has no place in the {layout.model_type} architecture "
                                  f"(it holds only {', '.join(layout.layer_tensors)}); it would be dropped, so the "
                                  f"build stops")
            continue
        per_layer[layer].append(key)
    draft.has_bias = any(f"model.layers.{layer}.{b}" in base.tensors for layer in per_layer
                         for b in layout.bias_tensors)
    return per_layer


def _plan_layer(draft: _Draft, layer: int, keys: list[str]) -> None:
    """One decoder layer: attention and norms copied, zero biases added, then its MLP (`_plan_mlp`)."""
    base, layout = draft.base, draft.layout
    for suffix in hybrid.required_tensors(layout, base.fields, layer):
        key = f"model.layers.{layer}.{suffix}"
        if key not in keys:
            draft.need(base, key, draft.base_label)
    for key in keys:
        draft.copy(key)
    for bias in layout.bias_tensors:  # zero biases where the output has them and the base does not
        key, weight = f"model.layers.{layer}.{bias}", f"model.layers.{layer}.{bias[:-len('bias')]}weight"
        if (layout.biases_always or draft.has_bias) and key not in base.tensors and weight in base.tensors:
            draft.steps.append(Step(key, base.tensors[weight].shape[:1], draft.dtype, "zeros", layer=layer))
    if layer in draft.dense_layers:
        _plan_dense_mlp(draft, layer)
    else:
        _plan_mlp(draft, layer)


def _plan_dense_mlp(draft: _Draft, layer: int) -> None:
    """A layer left out of ``moe_layers``: the base's own MLP, byte for byte in its dtype (never averaged)."""
    for proj in names.PROJS:
        key = names.fill(names.DENSE_MLP, layer=layer, proj=proj)
        info = draft.need(draft.base, key, draft.base_label)
        if info:
            draft.steps.append(Step(names.fill(draft.layout.dense_mlp[proj], layer=layer), info.shape, draft.dtype,
                                    "copy", (draft.config.base_model, key), layer))


def _plan_mlp(draft: _Draft, layer: int) -> None:
    """An MoE layer: the router, each projection's expert slots side by side, then the shared experts."""
    experts, layout = draft.experts, draft.layout
    draft.steps.append(Step(names.fill(layout.router, layer=layer), (len(experts), draft.base.fields.hidden_size),
                            draft.dtype, "router", layer=layer))
    if layout.router_bias:  # GLM-4-MoE's / ERNIE-4.5-MoE's e_score_correction_bias: zeros, fp32 as transformers keeps it
        shape = (len(experts),) if layout.router_bias_shape == "(E,)" else (1, len(experts))
        draft.steps.append(Step(names.fill(layout.router_bias, layer=layer), shape, torch.float32, "zeros",
                                layer=layer))
    for proj in names.PROJS:
        for e, expert in enumerate(experts):
            src = draft.sources[expert.source_model]
            key = names.fill(names.DENSE_MLP, layer=source_layer(expert, layer), proj=proj)
            info = draft.need(src, key, f"experts[{e}] ({expert.source_model})")
            if info is None:
                continue
            transforms = inits.slot_transforms(draft.init_of[e], proj, e)
            if expert.residual_scale is not None and proj == "down_proj" and expert.residual_scale != 1.0:
                transforms.append(("scale", float(expert.residual_scale)))
            shape = inits.sliced_shape(info.shape, proj, draft.granularity)
            draft.steps.append(Step(names.fill(layout.expert[proj], layer=layer, expert=e), shape, draft.dtype,
                                    "expert", (expert.source_model, key), layer, e, tuple(transforms)))
    draft.steps += shared_experts.plan_steps(draft.config, draft.sources, layout, layer, draft.dtype, draft.problems)


def _plan_head(draft: _Draft) -> None:
    """The final norm and the output head: copied, written twice when tied and llama.cpp needs it, or left out."""
    draft.copy("model.norm.weight")
    arch_name = draft.layout.model_type
    if not draft.base.fields.tie_word_embeddings:
        draft.copy(names.LM_HEAD)
    elif llamacpp.LLAMACPP[arch_name].needs_lm_head:  # same values (and storage) as the embedding
        draft.steps += [dataclasses.replace(s, name=names.LM_HEAD) for s in draft.steps if s.name == names.EMBED]
        draft.notes.append(f"lm_head.weight is tied to model.embed_tokens.weight (tie_word_embeddings: true); "
                           f"written twice, because llama.cpp's {llamacpp.LLAMACPP[arch_name].name} requires "
                           f"output.weight")
    elif names.LM_HEAD in draft.base.tensors:
        draft.notes.append("lm_head.weight is tied to model.embed_tokens.weight (tie_word_embeddings: true); "
                           "written once")


def _gather_notes(draft: _Draft, used: list[tuple[str, str]]) -> None:
    """The split's and the inits' notes, the fused layout, where the experts are, renormalisation, then the
    cautions (the notes saying where the MoE differs from its experts or from what mergekit-moe writes)."""
    config, sources, layout, base = draft.config, draft.sources, draft.layout, draft.base
    experts, g, dense_i = draft.experts, draft.granularity, base.fields.intermediate_size
    split_inexact = ""  # why a split is not function-preserving at init (`inits.split_notes`)
    if g > 1:
        groups = [{x.source_model for x in experts[i:i + g]} for i in range(0, len(experts), g)]
        split, split_inexact = inits.split_notes(len(experts), config.experts_per_token, g, groups, dense_i,
                                                 config.gate_mode, draft.dtype.itemsize)
        draft.notes += split
    draft.notes += inits.describe(draft.init_of, dense_i)
    fuse = config.layout == "fused" or layout.fused_only  # Qwen3.5-MoE: transformers reads only fused experts
    if fuse and (problem := fused.installed_transformers_problem()):
        draft.problems.append(problem)
    if fuse and not draft.problems:
        draft.steps = fused.fuse_experts(draft.steps, layout, len(experts))
    draft.notes += shared_experts.exactness_notes(config, layout)
    if layout.fused_only and config.layout != "fused" and not layout.native_fused:
        draft.notes.append(f"{layout.model_type}: experts written fused (mlp.experts.gate_up_proj, down_proj): "
                           f"transformers converts no per-expert names for {layout.class_name}")
    draft.notes += sparsity.layer_notes(config, draft.chosen, draft.n_layers)
    renorm_notes, renorm_inexact = sparsity.renormalisation_notes(config, layout, len(experts))
    draft.notes += renorm_notes
    dropped = []  # a value head, a stray buffer: the dense model's loader skips them too, so the logits are unchanged
    if draft.extra:
        extra = draft.extra
        shown = ", ".join(map(names.shown, extra[:5])) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        dropped.append(f"base_model: {len(extra)} tensor(s) outside the decoder layers, which transformers does not "
                       f"load into a {base.fields.model_type} model either, are not copied: {shown}")
    draft.cautions = (arch.choice_notes(config, base, layout) + arch.mergekit_choice_notes(config, base, layout)
                      + compat.source_notes(config, sources)
                      + source_checks.expert_setting_notes(config.base_model, used, sources) + dropped
                      + unused_prompts_note(config) + glm4.window_notes(layout, base.config))
    draft.notes += draft.cautions
    if split_inexact:  # a caution (printed by build, warned by upcycle_model), beside the split's notes
        draft.cautions.append(split_inexact)
    draft.cautions += renorm_inexact
    draft.inexact = ([split_inexact] if split_inexact else []) + list(renorm_inexact)


def _written_layout(draft: _Draft) -> str:
    """The expert layout written: the recipe's, or fused where the architecture reads only fused experts."""
    layout = draft.layout
    return "fused" if (draft.config.layout == "fused" or layout.fused_only) and not layout.native_fused \
        else draft.config.layout


def _finish(draft: _Draft) -> Plan:
    """The plan, or every problem found; with the tie-breaking caution and llama.cpp's verdict noted."""
    if draft.problems:
        raise PlanError(*_dedupe(draft.problems))
    config, experts, g = draft.config, draft.experts, draft.granularity
    bcfg, dense_i = draft.base.fields, draft.base.fields.intermediate_size
    plan = Plan(draft.layout.model_type, tuple(draft.steps), tuple(e.name or "" for e in experts),
                config.experts_per_token, draft.dtype, bcfg, bcfg.tie_word_embeddings, tuple(draft.notes),
                expert_intermediate_size=dense_i // g if g > 1 else None, layout=_written_layout(draft),
                cautions=tuple(draft.cautions), tied_scores=config.gate_mode == "uniform",
                not_copied=tuple(draft.extra), inexact=tuple(draft.inexact),
                dense_layers=draft.dense_layers, norm_topk_prob=config.norm_topk_prob is not False)
    if plan.ties_decide:
        tie = (f"gate_mode uniform: every expert scores the same for every token, so the top-{plan.experts_per_token} "
               f"of {len(experts)} is decided by tie-breaking — in transformers on a CPU the same fixed experts for "
               f"every token (torch.topk's order), in other runtimes others — not a uniform mix; routing is uniform "
               f"only with experts_per_token: {len(experts)} (or train the routers, or use gate_mode: random)")
        plan = dataclasses.replace(plan, notes=plan.notes + (tie,), cautions=plan.cautions + (tie,),
                                   inexact=plan.inexact + (tie,))
    if llamacpp.verdict(plan)[0] != "exact":
        plan = dataclasses.replace(plan, notes=plan.notes + (llamacpp.plan_note(plan),))
    return plan


def _base_dtype(base: Checkpoint, problems: list[str]) -> torch.dtype:
    """The output's default dtype: the base's config.json (``torch_dtype``, which transformers 4 reads, or ``dtype``,
    which 5 reads), else its embedding's; when the two names give two dtypes, a problem asking for ``dtype:``."""
    spelled = base.fields.stated_dtypes  # torch_dtype / dtype -> the dtype it names
    if len(set(spelled.values())) > 1:
        problems.append(f"base_model: config.json gives torch_dtype {base.fields['torch_dtype']} and dtype "
                        f"{base.fields['dtype']}, so the output's dtype (the base's, by default) is ambiguous; set "
                        f"dtype: in the recipe (e.g. dtype: {base.fields['dtype']})")
    info = base.tensors.get(names.EMBED)
    dtype = (next(iter(spelled.values())) if spelled else
             info.dtype if info and info.dtype.is_floating_point else torch.float32)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):  # float64: no MoE output takes it
        problems.append(f"base_model: the base is {dtype_name(dtype)}, which moe-upcycle does not "
                        f"write (float32, float16 or bfloat16); set the output's dtype in the recipe, e.g. dtype: "
                        f"float32")
        return torch.float32
    return dtype


def _where(config: UpcycleConfig, ref: str) -> str:
    """The YAML field that names model `ref` (base_model first)."""
    if ref == config.base_model:
        return "base_model"
    fields = [f"experts[{i}]" for i, e in enumerate(config.experts) if e.source_model == ref]
    fields += [f"shared_experts[{i}]" for i, e in enumerate(config.shared_experts) if e.source_model == ref]
    return fields[0] if fields else "source"


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
