"""The model card's recipe block: every key of the recipe with the value the build used, defaults marked.

A reader of a card cannot run ``moe-upcycle`` against the author's folders, so the block says what
was built, not only what was written: keys left to their default are shown with the value they
resolved to (``architecture: mixtral  # default: ...``, ``dtype``, ``router_aux_loss_coef``,
``report_init_drift``, the drop ratio of ``expert_init``...), and a router key the gate mode does
not read says so. Local folders and files are shown by name only (their paths relative to this
folder are in ``moe_upcycle.json``); hub ids as written. ``output`` is left out: the card is in
the output. Each expert lists the keys its recipe entry sets, with its resolved name.

It reads the validated recipe and the plan only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from moe_upcycle.checkpoint.names import output_layout
from moe_upcycle.gates.router import default_gate_scale
from moe_upcycle.planning.glm4 import SIGMOID_SHRINK
from moe_upcycle.planning import shared_experts
from moe_upcycle.planning.steps import Plan
from moe_upcycle.dtypes import dtype_name
from moe_upcycle.recipe.gate_keys import READERS
from moe_upcycle.recipe.params import HIDDEN_MODES
from moe_upcycle.recipe.resolved import resolved
from moe_upcycle.recipe.schema import UpcycleConfig

SHOWN_BY_NAME = ("positive_prompts_from", "negative_prompts_from", "calibration_text")
LEFT_OUT = ("output",)  # where the build wrote: this folder
# the keys of each expert_init method (the others are null for it)
INIT_KEYS = {"copy": (), "noise": ("scale", "absolute"), "drop": ("ratio",), "split": ("granularity", "shuffle")}


# what a grown MoE's defaults stand for: they come from its MoE base (`planning.grow`)
GROWN_DEFAULTS = {
    "gate_mode": lambda plan: (None, "default for a grown MoE: the base's routers, each copy with its expert's row"),
    "experts_per_token": lambda plan: (plan.experts_per_token, f"default for a grown MoE: {plan.grow.copies} × the "
                                                               f"base's {plan.grow.base.experts_per_token}"),
    "norm_topk_prob": lambda plan: (plan.norm_topk_prob, "default for a grown MoE: the base's"),
    "architecture": lambda plan: (plan.architecture, "default for a grown MoE: the base's"),
}


def recipe_block(config: UpcycleConfig, plan: Plan, shown_ref) -> str:
    """The YAML of the card's recipe section: one top-level key per line group, comments after defaults.

    Args:
        config: the recipe as built.
        plan: its plan (the architecture and dtype a default resolved to).
        shown_ref: a model reference -> how the card names it (`card_facts.Sources.shown`).
    """
    data = config.model_dump(mode="json")
    given = config.model_fields_set
    lines = []
    for key, value in data.items():
        if key in LEFT_OUT:
            continue
        value, why = _resolved(key, value, config, plan, shown_ref)
        comment = why if key not in given and why else "default" if key not in given else ""
        unread = _unread(key, config)
        if unread:
            comment = f"{comment}; {unread}" if comment else unread
        text = yaml.safe_dump({key: value}, sort_keys=False, allow_unicode=True, width=100).rstrip("\n")
        first, *rest = text.split("\n")
        lines += [first + (f"  # {comment}" if comment else ""), *rest]
    return "\n".join(lines)


def _resolved(key: str, value: Any, config: UpcycleConfig, plan: Plan, shown_ref) -> tuple[Any, str]:
    """(the value the build used, what a default stood for) for one top-level key."""
    if key == "base_model":
        return shown_ref(value), ""
    if key in ("experts", "shared_experts"):
        entries = config.experts if key == "experts" else config.shared_experts
        listed = config.expert_list() if key == "experts" else entries
        return [_expert(e, named.name if key == "experts" else None, shown_ref)
                for e, named in zip(entries, listed)], ""
    if plan.grow is not None and key in GROWN_DEFAULTS and key not in config.model_fields_set:  # `planning.grow`
        return GROWN_DEFAULTS[key](plan)
    if key == "architecture":
        return plan.architecture, "default: the output family for this base"
    if key == "dtype":
        return dtype_name(plan.dtype), "default: the base's"
    if key == "router_aux_loss_coef" and value is None:
        return 0.001, "default: Mixtral's"
    if key == "report_init_drift" and value is None:
        measured = resolved(config).checking.measures_drift(plan.total_bytes)
        return measured, "default: measured for non-copy inits of outputs up to 2 GB"
    if key == "shared_expert_gate" and value is None and config.shared_experts:
        return shared_experts.gate_init(config), "default: prompts when every shared expert has prompts"
    if key == "gate_scale" and value is None:
        return None, _default_scale(config, plan)
    if key == "moe_layers" and value is None:
        return None, f"default: {plan.moe_layers_text()}"
    if key == "norm_topk_prob" and value is None and plan.architecture != "mixtral":
        return plan.norm_topk_prob, "default: top-k router weights renormalised"
    if key == "expert_init":
        return _init(value), ""
    if key in SHOWN_BY_NAME and isinstance(value, str):
        return _file_name(value), ""
    return value, ""


def _expert(expert, name, shown_ref) -> dict:
    """An expert entry: the keys it sets (source shown by name or hub id, files by name) and its resolved name."""
    data = expert.model_dump(mode="json", exclude_defaults=True)
    out: dict = {"source_model": shown_ref(expert.source_model)}
    if name is not None or expert.name:
        out["name"] = name or expert.name
    for key, value in data.items():
        if key in ("source_model", "name"):
            continue
        out[key] = _file_name(value) if key in SHOWN_BY_NAME else _init(value) if key == "expert_init" else value
    return out


def _init(value: Any) -> Any:
    """An expert_init mapping with its method's keys only, the drop ratio's default filled in."""
    if not isinstance(value, dict):
        return value
    method = value.get("method", "copy")
    out = {"method": method, **{k: value.get(k) for k in INIT_KEYS.get(method, ())}}
    if method == "drop" and out.get("ratio") is None:
        out["ratio"] = 0.5  # `inits.slot_transforms`' default
    return out


def _default_scale(config: UpcycleConfig, plan: Plan) -> str:
    mode, source = config.gate_mode, config.gate_source
    if mode not in READERS["gate_scale"][source]:
        return ""
    if source == "mergekit":
        return "default: unit rows, as mergekit-moe writes them"
    sigmoid = output_layout(plan.architecture).router_scoring == "sigmoid"  # `glm4.sigmoid_rows`: a quarter
    if mode == "cheap_embed":
        scale = default_gate_scale(plan.base_config.hidden_size) / (SIGMOID_SHRINK if sigmoid else 1)
        return f"default: 16/sqrt(hidden){' / 4 (sigmoid router)' if sigmoid else ''} = {scale:.4g}"
    return "default: set per layer from the router inputs" + (", / 4 for the sigmoid router" if sigmoid else "")


def _unread(key: str, config: UpcycleConfig) -> str:
    """'not read by ...' for a router key the gate mode never reads, or for hidden-state settings of a mode that
    runs no model."""
    if key in READERS and config.gate_mode not in READERS[key][config.gate_source]:
        return f"not read by gate_mode {config.gate_mode}" + (" with gate_source: mergekit"
                                                             if config.gate_source == "mergekit" else "")
    if key in ("batch_size", "gate_dtype", "quantize") and config.gate_mode not in HIDDEN_MODES:
        return f"not read by gate_mode {config.gate_mode}, which runs no model"
    return ""


def _file_name(value: Any) -> Any:
    """A local file by its name (a shipped prompt-set name as it is)."""
    if not isinstance(value, str) or not value:
        return value
    return Path(os.path.expanduser(value)).name if ("/" in value or os.sep in value) else value
