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
from moe_upcycle.checkpoint.source import STR_DTYPES, Checkpoint
from moe_upcycle.checkpoint.headers import TensorInfo
from moe_upcycle.errors import PlanError
from moe_upcycle.planning import (arch, compat, fused, hybrid, inits, llamacpp, router_statics, shared_experts,
                                  source_checks, sparsity)
from moe_upcycle.planning.steps import Plan, Step, source_layer
from moe_upcycle.recipe.params import unused_prompts_note
from moe_upcycle.recipe.resolve import expert_inits, moe_layers
from moe_upcycle.recipe.schema import UpcycleConfig

__all__ = ["Plan", "Step", "make_plan", "STR_DTYPES"]

# buffers some old .bin checkpoints carry; transformers recomputes them
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    layout = arch.choose_layout(config, base)  # raises with every candidate's reasons
    arch_name = layout.model_type
    problems += compat.source_problems(config, sources)
    problems += hybrid.problems(layout, base.fields, f"base_model ({config.base_model})")
    used = [(f"experts[{i}]", e.source_model) for i, e in enumerate(config.expert_list())]
    used += [(f"shared_experts[{i}]", e.source_model) for i, e in enumerate(config.shared_experts)]
    problems += source_checks.expert_problems(config.base_model, used, sources,
                                              attention_average=config.attention_from == "average")
    for ref, ckpt in sources.items():  # config.json against the tensor shapes, every source
        problems += source_checks.shape_problems(ckpt, f"{_where(config, ref)} ({ref})")
    if problems:  # per-tensor checks of sources that do not fit would only repeat these
        raise PlanError(*problems)
    bcfg = base.fields  # the checked, typed config.json

    g = inits.granularity(config)
    init_of = expert_inits(config)
    dense_i = bcfg.intermediate_size
    if dense_i % g:
        problems.append(f"expert_init.granularity: {g} does not divide intermediate_size {dense_i} of "
                        f"{config.base_model}; use a divisor of {dense_i}")
    dtype = STR_DTYPES[config.dtype] if config.dtype else _base_dtype(base, problems)
    tied = bcfg.tie_word_embeddings
    n_layers = bcfg.num_hidden_layers
    chosen = moe_layers(config)
    problems += chosen.problems(n_layers, f"base_model ({config.base_model})")
    dense_layers = set(chosen.dense_layers(n_layers))
    steps: list[Step] = []
    notes: list[str] = []

    def need(model: Checkpoint, key: str, label: str) -> Optional[TensorInfo]:
        info = model.tensors.get(key)
        if info is None:
            # transformers would initialise a missing lm_head at random unless the config ties it
            tie = (f" (config.json has tie_word_embeddings: {str(model.fields.tie_word_embeddings).lower()}"
                   f"; if the model's output head is its embedding, set it to true)" if key == names.LM_HEAD else "")
            problems.append(f"{label}: tensor {key!r} is missing from {model.path or model.ref}{tie}")
        return info

    def copy(key: str) -> None:
        info = need(base, key, f"base_model ({config.base_model})")
        if info and config.attention_from == "average":  # Branch-Train-MiX: mean over the expert sources
            refs = compat.average_sources(config)
            parts = tuple(Step(key, info.shape, dtype, "copy", (ref, key), names.split_layer(key)[1]) for ref in refs
                          if key in sources[ref].tensors)  # a missing one is reported by compat
            steps.append(Step(key, info.shape, dtype, "average", None, names.split_layer(key)[1], parts=parts))
        elif info:
            steps.append(Step(key, info.shape, dtype, "copy", (config.base_model, key), names.split_layer(key)[1]))

    # Sort base tensors into top-level, per-layer allowed, MLP, and ones the output cannot hold.
    per_layer: dict[int, list[str]] = {i: [] for i in range(n_layers)}
    extra: list[str] = []  # outside the layers and not the embedding, final norm or head
    for key in base.tensors:
        template, layer = names.split_layer(key)
        if key.endswith(IGNORED_SUFFIXES):
            notes.append(f"skipped buffer {key} (recomputed by transformers)")
            continue
        if layer is None:
            if key not in (names.EMBED, "model.norm.weight", names.LM_HEAD):
                extra.append(key)
            continue
        if layer >= n_layers:
            problems.append(f"base_model: tensor {key!r} is beyond num_hidden_layers={n_layers} in config.json")
            continue
        suffix = template.removeprefix("model.layers.{layer}.")
        if suffix.startswith("mlp."):
            if not any(suffix == f"mlp.{p}.weight" for p in names.PROJS):
                problems.append(f"base_model: tensor {key!r} ({suffix}) cannot be placed in {arch_name} experts, "
                                f"which have no MLP biases; it would be silently dropped, so the build stops")
            continue
        if not layout.holds(suffix):
            problems.append(f"base_model: tensor {key!r} has no place in the {arch_name} architecture "
                            f"(it holds only {', '.join(layout.layer_tensors)}); it would be dropped, so the build stops")
            continue
        per_layer[layer].append(key)

    dropped = []  # a value head, a stray buffer: the dense model's loader skips them too, so the logits are unchanged
    if extra:
        shown = ", ".join(map(names.shown, extra[:5])) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        dropped.append(f"base_model: {len(extra)} tensor(s) outside the decoder layers, which transformers does not "
                       f"load into a {bcfg.model_type} model either, are not copied: {shown}")
    has_bias = any(f"model.layers.{layer}.{b}" in base.tensors for layer in per_layer for b in layout.bias_tensors)
    copy(names.EMBED)
    for layer in range(n_layers):
        for suffix in hybrid.required_tensors(layout, bcfg, layer):
            key = f"model.layers.{layer}.{suffix}"
            if key not in per_layer[layer]:
                need(base, key, f"base_model ({config.base_model})")
        for key in per_layer[layer]:
            copy(key)
        for bias in layout.bias_tensors:  # zero biases where the output has them and the base does not
            key, weight = f"model.layers.{layer}.{bias}", f"model.layers.{layer}.{bias[:-len('bias')]}weight"
            if (layout.biases_always or has_bias) and key not in base.tensors and weight in base.tensors:
                steps.append(Step(key, base.tensors[weight].shape[:1], dtype, "zeros", layer=layer))
        if layer in dense_layers:  # the base's own MLP, byte for byte in its dtype (from base_model, never averaged)
            for proj in names.PROJS:
                key = names.fill(names.DENSE_MLP, layer=layer, proj=proj)
                info = need(base, key, f"base_model ({config.base_model})")
                if info:
                    steps.append(Step(names.fill(layout.dense_mlp[proj], layer=layer), info.shape, dtype, "copy",
                                      (config.base_model, key), layer))
            continue
        hidden = bcfg.hidden_size
        steps.append(Step(names.fill(layout.router, layer=layer), (len(experts), hidden), dtype, "router",
                          layer=layer))
        for proj in names.PROJS:
            for e, expert in enumerate(experts):
                src = sources[expert.source_model]
                key = names.fill(names.DENSE_MLP, layer=source_layer(expert, layer), proj=proj)
                info = need(src, key, f"experts[{e}] ({expert.source_model})")
                if info is None:
                    continue
                transforms = inits.slot_transforms(init_of[e], proj, e)
                if expert.residual_scale is not None and proj == "down_proj" and expert.residual_scale != 1.0:
                    transforms.append(("scale", float(expert.residual_scale)))
                shape = inits.sliced_shape(info.shape, proj, g)
                steps.append(Step(names.fill(layout.expert[proj], layer=layer, expert=e), shape, dtype,
                                  "expert", (expert.source_model, key), layer, e, tuple(transforms)))
        steps += shared_experts.plan_steps(config, sources, layout, layer, dtype, problems)
        steps += router_statics.steps(layout, layer, len(experts))
    copy("model.norm.weight")
    if not tied:
        copy(names.LM_HEAD)
    elif llamacpp.LLAMACPP[arch_name].needs_lm_head:  # same values (and storage) as the embedding
        steps += [dataclasses.replace(s, name=names.LM_HEAD) for s in steps if s.name == names.EMBED]
        notes.append(f"lm_head.weight is tied to model.embed_tokens.weight (tie_word_embeddings: true); written "
                     f"twice, because llama.cpp's {llamacpp.LLAMACPP[arch_name].name} requires output.weight")
    elif names.LM_HEAD in base.tensors:
        notes.append("lm_head.weight is tied to model.embed_tokens.weight (tie_word_embeddings: true); written once")

    split_inexact = ""  # why a split is not function-preserving at init (`inits.split_notes`)
    if g > 1:
        groups = [{x.source_model for x in experts[i:i + g]} for i in range(0, len(experts), g)]
        split, split_inexact = inits.split_notes(len(experts), config.experts_per_token, g, groups, dense_i,
                                                 config.gate_mode, dtype.itemsize)
        notes += split
    notes += inits.describe(init_of, dense_i)
    fuse = config.layout == "fused" or layout.fused_only  # Qwen3.5-MoE: transformers reads only fused experts
    if fuse and (problem := fused.installed_transformers_problem()):
        problems.append(problem)
    if fuse and not problems:
        steps = fused.fuse_experts(steps, layout, len(experts))
    notes += shared_experts.exactness_notes(config, layout)
    if layout.fused_only and config.layout != "fused" and not layout.native_fused:
        notes.append(f"{arch_name}: experts written fused (mlp.experts.gate_up_proj, down_proj): transformers converts "
                     f"no per-expert names for {layout.class_name}")
    notes += sparsity.layer_notes(config, chosen, n_layers)
    renorm_notes, renorm_inexact = sparsity.renormalisation_notes(config, layout, len(experts))
    notes += renorm_notes
    cautions = (arch.choice_notes(config, base, layout) + arch.mergekit_choice_notes(config, base, layout)
                + compat.source_notes(config, sources)
                + source_checks.expert_setting_notes(config.base_model, used, sources) + dropped
                + unused_prompts_note(config))
    notes += cautions
    if split_inexact:  # a caution (printed by build, warned by upcycle_model), beside the split's notes
        cautions.append(split_inexact)
    cautions += renorm_inexact
    if problems:
        raise PlanError(*_dedupe(problems))
    inexact = ((split_inexact,) if split_inexact else ()) + tuple(renorm_inexact)
    plan = Plan(arch_name, tuple(steps), tuple(e.name or "" for e in experts), config.experts_per_token, dtype,
                bcfg, tied, tuple(notes), expert_intermediate_size=dense_i // g if g > 1 else None,
                layout="fused" if fuse and not layout.native_fused else config.layout,
                cautions=tuple(cautions), tied_scores=config.gate_mode == "uniform",
                not_copied=tuple(extra), inexact=inexact, dense_layers=tuple(sorted(dense_layers)),
                norm_topk_prob=config.norm_topk_prob is not False)
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
        problems.append(f"base_model: the base is {str(dtype).removeprefix('torch.')}, which moe-upcycle does not "
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
