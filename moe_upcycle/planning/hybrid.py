"""Hybrid-attention outputs: which tensors each layer needs when the layers are not all alike.

Qwen3.5 mixes two kinds of layer, named by ``layer_types`` in config.json: ``linear_attention``
(a Gated DeltaNet: ``linear_attn.in_proj_qkv``, ``in_proj_z``, ``in_proj_a/b``, ``conv1d``,
``A_log``, ``dt_bias``, ``norm``, ``out_proj``) and ``full_attention`` (q/k/v/o with q/k norms; q_proj
also holds the output gate, so it is twice a Qwen3's width). Upcycling touches only the MLP: both kinds
are copied as they are, and the MoE's config.json keeps ``layer_types`` and the linear-attention sizes,
so Qwen3.5-MoE builds the same module in every layer. An output's `names.OutputLayout.layer_kinds` says
which tensors each kind needs; `required_tensors` answers for one layer, `problems` checks the base's
``layer_types`` before anything is planned, and `family_misfit` keeps other families out (a Qwen3
attention is not a Qwen3.5 one, though its tensors have the same names).

It reads config.json values only; it plans and writes nothing.
"""

from __future__ import annotations

from typing import Mapping, Optional

from moe_upcycle.checkpoint import names


def layer_types(base: Mapping) -> Optional[list]:
    """The base's ``layer_types`` when it is a list as long as the model is deep, else None."""
    types = base.get("layer_types")
    n = base.get("num_hidden_layers")
    return list(types) if isinstance(types, list) and len(types) == n else None


def problems(layout: names.OutputLayout, base: Mapping, where: str) -> list[str]:
    """What in the base's ``layer_types`` a hybrid `layout` cannot build (none for other layouts).

    Example:
        >>> lay = names.OUTPUT_LAYOUTS["qwen3_5_moe_text"]
        >>> problems(lay, {"num_hidden_layers": 2, "layer_types": ["linear_attention", "sliding_attention"]}, "b")
        ["b: config.json layer_types[1] is 'sliding_attention', which Qwen3.5-MoE does not build (it builds \
linear_attention, full_attention); give the dense model's own config.json"]
    """
    if not layout.layer_kinds:
        return []
    types = layer_types(base)
    if types is None:
        return [f"{where}: config.json has no layer_types list with one entry per layer "
                f"({base.get('num_hidden_layers')} layers), which says which layers of a {layout.label} are linear "
                f"and which full attention; give the dense model's own config.json"]
    return [f"{where}: config.json layer_types[{i}] is {t!r}, which {layout.label} does not build (it builds "
            f"{', '.join(layout.layer_kinds)}); give the dense model's own config.json"
            for i, t in enumerate(types) if t not in layout.layer_kinds]


def required_tensors(layout: names.OutputLayout, base: Mapping, layer: int) -> tuple[str, ...]:
    """The per-layer tensor suffixes layer `layer` of the base must have for `layout`.

    Example:
        >>> lay = names.OUTPUT_LAYOUTS["qwen3_5_moe_text"]
        >>> required_tensors(lay, {"num_hidden_layers": 1, "layer_types": ["linear_attention"]}, 0)[2]
        'linear_attn.A_log'
    """
    types = layer_types(base) if layout.layer_kinds else None
    kind = layout.layer_kinds.get(types[layer], ()) if types else ()
    return layout.layer_tensors + kind


def family_misfit(layout: names.OutputLayout, model_type: str) -> Optional[str]:
    """Why `layout` cannot hold a base of `model_type` whatever its tensors are called, or None."""
    family = names.INPUT_FAMILIES.get(model_type)
    if family is not None and family.only_outputs and layout.model_type not in family.only_outputs:
        return (f"{layout.label} does not compute what a {family.class_name} computes (its multipliers and "
                f"logits_scaling have no place there); use architecture: {' or '.join(family.only_outputs)}")
    if not layout.input_families or model_type in layout.input_families:
        return None
    wanted = ", ".join(names.INPUT_FAMILIES[f].class_name for f in layout.input_families)
    return (f"{layout.label} holds the layers of a {wanted} only (its attention is not a {model_type}'s, though "
            f"the tensors may share names)")


def config_fields(layout: names.OutputLayout, base: Mapping) -> dict:
    """config.json fields of a hybrid output beyond `layout.inherit`: the base's ``layer_types``, as it is."""
    types = layer_types(base) if layout.layer_kinds else None
    return {"layer_types": types} if types else {}
