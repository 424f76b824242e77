"""Plan the growth of an existing MoE ("expert upcycling"): more experts, from the base's own or from dense fine-tunes.

Two recipes grow an MoE base (`checkpoint.moe_base`: Mixtral, Qwen2-MoE, Qwen3-MoE):

- ``num_experts: m × E`` copies each of the base's E experts m times, each with its router row. Output
  expert ``j`` is base expert ``j mod E``: experts 0..E-1 are the base's, byte for byte, and ``expert_init``
  (noise, drop) applies to the copies E..mE-1 only. With the base's routers (``gate_mode`` left out) and
  ``experts_per_token: m × k`` (the default here) the grown model computes the base's function: the m
  copies of an expert get m equal logits, the softmax gives each p_e/m, the top-(mk) holds every copy of
  the top-k experts and their weights add up to p_e (renormalised or not: the same ratios). A count that
  is no multiple of E is refused (which experts would get the extra copies is no rule that keeps the
  function); any other ``experts_per_token`` or an explicit ``gate_mode`` builds and is said not exact.
- ``experts:`` lists NEW experts, dense fine-tunes of the MoE's own dense model: the base's E experts and
  their router rows are kept first, byte for byte, and each new expert's row is computed from its prompts
  on the router inputs of the MoE base itself (`gates.grow_rows`), scaled to the base rows' norms.

Everything else — attention, norms, embeddings, head, shared experts and their gates, dense layers — is
copied. The output is the base's own architecture and config.json (`grown_config`). Like `plan.make_plan`,
this is pure: headers and config.json only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.moe_base import MoeBase, dense_family_problem, is_moe, moe_base
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.dtypes import DTYPES, dtype_name
from moe_upcycle.errors import PlanError
from moe_upcycle.planning import fused, inits
from moe_upcycle.planning.steps import Plan, Step, source_layer
from moe_upcycle.recipe.resolved import resolved
from moe_upcycle.recipe.schema import UpcycleConfig

BASE_ROUTERS = "base routers"  # how the router rows are made when gate_mode is left out
COPY_GATE_MODES = ("random", "uniform_random", "uniform")  # explicit modes that replace every router row
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers transformers recomputes


@dataclass(frozen=True)
class GrowInfo:
    """What grows, for the gate stage, the output's config.json, the plan's lines and `verify`.

    Attributes:
        base: the MoE base, described.
        base_ref: its reference in the recipe.
        copies: m, how many times each base expert is in the output (1 when experts are added).
        added: the references of the added dense experts, in output order after the base's.
        router: ``base routers`` (rows copied, new rows from prompts) or the explicit gate_mode.
        exact: the grown model computes the base's function (copies, base routers, m × k, no init).
    """

    base: MoeBase
    base_ref: str
    copies: int
    added: tuple[str, ...]
    router: str
    exact: bool

    @property
    def num_experts(self) -> int:
        return self.base.num_experts * self.copies + len(self.added)

    def line(self) -> str:
        """What grows, as ``plan`` shows it."""
        e = self.base.num_experts
        how = (f"each expert ×{self.copies}, with its router row" if self.copies > 1 else
               f"the base's {e} kept, {len(self.added)} added from dense fine-tunes" if self.added else "none added")
        return f"grows {e} experts → {self.num_experts} ({how})"


def is_grow(base: Checkpoint) -> bool:
    """Whether a build on `base` grows an MoE (the base is one)."""
    return is_moe(base)


def left_out(config: UpcycleConfig) -> tuple[str, ...]:
    """The recipe fields whose default a grown MoE resolves from its base (the base's routers, m × k), that the
    recipe left out: the manifest records them left out, so that re-planning the build resolves them the same."""
    return tuple(f for f in ("gate_mode", "experts_per_token") if f not in config.model_fields_set)


def make_grow_plan(config: UpcycleConfig, sources: dict[str, Checkpoint]) -> Plan:
    """Plan a grown MoE (see the module doc).

    Raises:
        PlanError: every problem at once: recipe fields that do not apply to a grown MoE, a count that is no
            multiple of the base's experts, an added expert of another family or another size.
    """
    ckpt = sources[config.base_model]
    base = moe_base(ckpt)
    cfg = ckpt.fields
    problems = _recipe_problems(config, base)
    e_count = base.num_experts
    added = list(config.experts)
    copies = 1
    if config.num_experts is not None:
        n = config.num_experts
        if n < e_count or n % e_count:
            multiples = ", ".join(f"{e_count * i} (each ×{i})" for i in (2, 3, 4))
            problems.append(f"num_experts: {n} is {'fewer than' if n < e_count else 'no multiple of'} the base's "
                            f"{e_count} experts; growing copies every expert (with its router row) the same number "
                            f"of times, which keeps the base's function — use {multiples}, or list new experts "
                            f"(dense fine-tunes) under experts:")
        copies = max(1, n // e_count)
    for i, expert in enumerate(added):
        problems += _added_problems(config, base, sources, i, expert)
    explicit_mode = "gate_mode" in config.model_fields_set
    if explicit_mode and not added and config.gate_mode not in COPY_GATE_MODES:
        problems.append(f"gate_mode: {config.gate_mode} needs prompts per expert, and copies of the base's experts "
                        f"have none; leave gate_mode out (the base's routers, copied: exact) or use "
                        f"{', '.join(COPY_GATE_MODES)}")
    if added and explicit_mode and config.gate_mode != "hidden":
        problems.append(f"gate_mode: {config.gate_mode} with added experts: the base's router rows are kept and the "
                        f"new experts' rows come from their prompts on the MoE's router inputs (hidden); leave "
                        f"gate_mode out or write hidden")
    if config.layout == "fused" and (problem := fused.installed_transformers_problem()):
        problems.append(problem)
    if problems:
        raise PlanError(*problems)

    k = config.experts_per_token if "experts_per_token" in config.model_fields_set else copies * base.experts_per_token
    n_total = e_count * copies + len(added)
    if k > n_total:
        raise PlanError(f"experts_per_token: {k} is more than the grown model's {n_total} experts")
    router = config.gate_mode if explicit_mode and not added else BASE_ROUTERS
    dtype = DTYPES[config.dtype] if config.dtype else _dtype(ckpt)
    init_of = resolved(config).inits
    copy_transforms = any(inits.slot_transforms(init_of[j], "gate_proj", j) for j in range(e_count, n_total)) \
        if not added else False
    exact = not added and router == BASE_ROUTERS and k == copies * base.experts_per_token and not copy_transforms
    info = GrowInfo(base, config.base_model, copies, tuple(e.source_model for e in added), router, exact)

    steps = _steps(config, base, ckpt, sources, info, dtype, init_of)
    if config.layout == "fused":
        steps = fused.fuse_experts(steps, base.layout, n_total)
    names_out = tuple(f"expert_{j}" if j < e_count else f"expert_{j % e_count}_copy{j // e_count}"
                      for j in range(e_count * copies))
    names_out += tuple(e.name or f"expert_{e_count * copies + i}" for i, e in enumerate(added))  # never a path
    notes, inexact = _notes(info, k, router, copy_transforms, init_of)
    return Plan(base.model_type, tuple(steps), names_out, k, dtype, cfg, cfg.tie_word_embeddings, tuple(notes),
                expert_intermediate_size=base.expert_size if base.expert_size != cfg.intermediate_size else None,
                layout=config.layout, cautions=tuple(inexact), inexact=tuple(inexact),
                tied_scores=router == "uniform", dense_layers=base.dense_layers, norm_topk_prob=base.norm_topk_prob,
                grow=info)


def _recipe_problems(config: UpcycleConfig, base: MoeBase) -> list[str]:
    """Recipe fields a grown MoE cannot take: the base decides them."""
    out = []
    if config.architecture is not None and config.architecture != base.model_type:
        out.append(f"architecture: {config.architecture}, but the base is a {base.model_type} MoE, which a grown MoE "
                   f"stays; leave architecture out")
    if config.moe_layers is not None:
        out.append("moe_layers: the base's MoE layers stay its MoE layers; leave moe_layers out")
    if config.shared_experts:
        out.append("shared_experts: the base's shared expert (if any) is kept as it is; leave shared_experts out")
    if config.attention_from != "base":
        out.append(f"attention_from: {config.attention_from} — the MoE base's attention is kept; leave it out")
    if config.expert_init.method == "split":
        out.append("expert_init: split would change the base's expert size; use copy, noise or drop")
    if config.norm_topk_prob is not None and config.norm_topk_prob != base.norm_topk_prob:
        out.append(f"norm_topk_prob: {str(config.norm_topk_prob).lower()}, but the base has "
                   f"{str(base.norm_topk_prob).lower()}, which its routers were trained with; leave it out")
    return out


def _added_problems(config: UpcycleConfig, base: MoeBase, sources: dict[str, Checkpoint], i: int,
                    expert) -> list[str]:
    """Why experts[i] (a dense fine-tune) cannot be a new expert of `base`."""
    label = f"experts[{i}] ({expert.source_model})"
    if expert.source_model == config.base_model:
        return [f"experts[{i}]: the base's own experts are kept, all of them; list only new experts (dense "
                f"fine-tunes of the MoE's dense model), or use num_experts: to copy the base's"]
    src = sources[expert.source_model]
    if not expert.positive_prompts:
        return [f"experts[{i}].positive_prompts: none given; an added expert's router row is made from its prompts on "
                f"the MoE's router inputs — give a few texts it should handle"]
    family = dense_family_problem(base, src, label)
    if family:
        return [family]
    have, want = src.fields, sources[config.base_model].fields
    out = [f"{label}: {key} is {have[key]}, the MoE base has {want[key]}; a new expert must fit the base's layers"
           for key in ("hidden_size", "num_hidden_layers") if have[key] != want[key] and not expert.layers]
    if have.intermediate_size != base.expert_size:
        out.append(f"{label}: its FFN has intermediate_size {have.intermediate_size}, the base's experts "
                   f"{base.expert_size} ({base.layout.expert_size_key}); an added expert must have the experts' size "
                   f"(a Qwen MoE's experts are narrower than its dense model's FFN)")
    if not out:
        for layer in base.moe_layers:
            for proj in names.PROJS:
                key = names.fill(names.DENSE_MLP, layer=source_layer(expert, layer), proj=proj)
                if key not in src.tensors:
                    out.append(f"{label}: tensor {key!r} is missing from {src.path or src.ref}")
    return out


def _steps(config: UpcycleConfig, base: MoeBase, ckpt: Checkpoint, sources: dict[str, Checkpoint], info: GrowInfo,
           dtype: torch.dtype, init_of: list) -> list[Step]:
    """Every output tensor: the base's copied, its experts placed m times (grouped by source), new experts after."""
    e_count, copies, ref = base.num_experts, info.copies, config.base_model
    n_total = info.num_experts
    expert_keys = {base.expert_key(layer, e, proj): (layer, e, proj)
                   for layer in base.moe_layers for e in range(e_count) for proj in names.PROJS}
    routers = {base.router_key(layer): layer for layer in base.moe_layers}
    per_layer: dict[Optional[int], list[str]] = {}
    for key in ckpt.tensors:
        if key.endswith(IGNORED_SUFFIXES) or key in expert_keys:
            continue
        per_layer.setdefault(names.split_layer(key)[1], []).append(key)

    def copied(key: str) -> Step:
        info_ = ckpt.tensors[key]
        return Step(key, tuple(info_.shape), dtype, "copy", (ref, key), names.split_layer(key)[1])

    steps = [copied(k) for k in per_layer.get(None, []) if k == names.EMBED]
    for layer in range(ckpt.fields.num_hidden_layers):
        for key in per_layer.get(layer, []):
            if key in routers:
                steps.append(Step(key, (n_total, ckpt.fields.hidden_size), dtype, "router", layer=layer))
            else:
                steps.append(copied(key))
        if layer not in base.moe_layers:
            continue
        for proj in names.PROJS:
            for e in range(e_count):
                key = base.expert_key(layer, e, proj)
                shape = tuple(ckpt.tensors[key].shape)
                for c in range(copies):
                    j = c * e_count + e
                    transforms = tuple(inits.slot_transforms(init_of[j], proj, j)) if c else ()
                    steps.append(Step(base.expert_key(layer, j, proj), shape, dtype, "expert", (ref, key), layer, j,
                                      transforms))
            for i, expert in enumerate(config.experts):
                j = e_count + i
                key = names.fill(names.DENSE_MLP, layer=source_layer(expert, layer), proj=proj)
                transforms = inits.slot_transforms(init_of[i], proj, j)
                if expert.residual_scale is not None and proj == "down_proj" and expert.residual_scale != 1.0:
                    transforms.append(("scale", float(expert.residual_scale)))
                shape = tuple(sources[expert.source_model].tensors[key].shape)
                steps.append(Step(base.expert_key(layer, j, proj), shape,
                                  dtype, "expert", (expert.source_model, key), layer, j, tuple(transforms)))
    steps += [copied(k) for k in per_layer.get(None, []) if k != names.EMBED]
    return steps


def _notes(info: GrowInfo, k: int, router: str, copy_transforms: bool, init_of: list) -> tuple[list[str], list[str]]:
    """The plan's notes on what grows, and the cautions saying where the grown model is not the base's function."""
    base, m = info.base, info.copies
    e_count = base.num_experts
    notes = [info.line()]
    inexact: list[str] = []
    if m > 1:
        notes.append(f"experts 0-{e_count - 1} are the base's, byte for byte; expert j ≥ {e_count} is a copy of base "
                     f"expert j mod {e_count}")
        notes.append(f"router: {router}" + (" (gate_mode left out: each copy gets its expert's row)"
                                            if router == BASE_ROUTERS else " (every row replaced)"))
    if info.added:
        notes.append(f"router: the base's {e_count} rows kept; the {len(info.added)} new rows from the new experts' "
                     f"prompts on the MoE base's router inputs, scaled to the base rows' mean norm")
        inexact.append(f"{len(info.added)} added expert(s) compete with the base's in the top-{k}: the grown model is "
                       f"not the base's function (the base's experts and rows are unchanged)")
    want = m * base.experts_per_token
    if info.exact:
        notes.append(f"experts_per_token {k} = {m} × the base's {base.experts_per_token}: the grown model computes "
                     f"the base's function (exact)")
    elif not info.added:
        if k != want:
            inexact.append(f"experts_per_token: {k}, not {m} × the base's {base.experts_per_token} = {want}: a token "
                           f"reaches {'fewer' if k < want else 'more'} copies than the base's top-{base.experts_per_token}"
                           f" hold, so the grown model is not the base's function (use {want} for exact)")
        if router != BASE_ROUTERS:
            inexact.append(f"gate_mode: {router} replaces the base's trained routers: not the base's function; leave "
                           f"gate_mode out to copy them")
        if copy_transforms:
            method = init_of[e_count].method if len(init_of) > e_count else "init"
            inexact.append(f"expert_init {method} changes the copies (experts {e_count}-{info.num_experts - 1}; the "
                           f"base's stay byte for byte): not the base's function — by the size of the change")
    return notes + inexact, inexact


def _dtype(ckpt: Checkpoint) -> torch.dtype:
    """The base's dtype: its config.json's, else its embedding's."""
    stated = ckpt.fields.stated_dtypes
    if stated:
        return next(iter(stated.values()))
    info = ckpt.tensors.get(names.EMBED)
    return info.dtype if info is not None and info.dtype in DTYPES.values() else torch.float32


def grown_config(plan: Plan, router_aux_loss_coef: Optional[float] = None,
                 router_jitter_noise: Optional[float] = None) -> dict:
    """The grown model's config.json: the base's, with its expert count (every key the base spells it with, and
    the family's own),
    top-k and dtype changed; training switches off. Every other field is the base's value, unchanged.

    Example:
        >>> cfg = grown_config(plan)  # doctest: +SKIP
        >>> cfg["num_local_experts"], cfg["num_experts_per_tok"]  # doctest: +SKIP
        (16, 4)
    """
    info: GrowInfo = plan.grow
    cfg = dict(plan.base_config.raw)
    # every spelling the base has, and the family's own (transformers 5 saves Qwen3-MoE's count as
    # num_local_experts only, which transformers 4.57 and `verify` do not read)
    for key in dict.fromkeys((*info.base.experts_key, info.base.layout.experts_key)):
        cfg[key] = info.num_experts
    cfg["num_experts_per_tok"] = plan.experts_per_token
    dtype = dtype_name(plan.dtype)
    for key in ("dtype", "torch_dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = dtype
    cfg["output_router_logits"] = False
    if "head_dim" not in cfg:  # the value transformers derives (hidden / heads), which runtime checks read
        cfg["head_dim"] = plan.base_config.head_dim
    if router_aux_loss_coef is not None:
        cfg["router_aux_loss_coef"] = router_aux_loss_coef
    if router_jitter_noise is not None and "router_jitter_noise" in cfg:
        cfg["router_jitter_noise"] = router_jitter_noise
    return dict(sorted(cfg.items()))
