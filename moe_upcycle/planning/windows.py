"""Attention windows: which layers of the dense base attend through a sliding window.

A ``sliding_window`` in config.json does not mean the same in every family (transformers 5):
Llama ignores it; Mistral applies it to every layer; Qwen2/Qwen3 apply it only with
``use_sliding_window: true``, to the layers ``layer_types`` marks ``sliding_attention`` (or, without
``layer_types``, to the layers from ``max_window_layers`` on). Every MoE output applies its
``sliding_window`` to every layer (Qwen-MoE: when ``use_sliding_window``), so copying the field
unchanged gives a Llama base, or a published Qwen2.5 config (``sliding_window: 131072,
use_sliding_window: false``), a window its dense model never had. `dense_windows` says what the
base really does; `arch.config_fields` writes "no window" when it is none anywhere and, for the
Qwen MoE outputs, which layers slide; `arch.misfits` refuses an output with one window for every
layer (Mixtral, Qwen3-MoE) when the base slides only some.

It reads config.json values only.
"""

from __future__ import annotations

from typing import Optional

from moe_upcycle.checkpoint import names

QWEN_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2/Qwen3 default for a config without the field
MISTRAL_WINDOW = 4096  # transformers' (4.57 and 5) MistralConfig default: a config without the key slides


def dense_windows(base: dict) -> list[Optional[int]]:
    """The attention window of each layer of the dense base as transformers runs it (None: full).

    Example:
        >>> dense_windows({"model_type": "llama", "num_hidden_layers": 2, "sliding_window": 4})
        [None, None]
        >>> dense_windows({"model_type": "qwen2", "num_hidden_layers": 2, "sliding_window": 4,
        ...                "use_sliding_window": True, "max_window_layers": 1})
        [None, 4]
    """
    n = int(base["num_hidden_layers"])
    window = base.get("sliding_window", MISTRAL_WINDOW if base.get("model_type") == "mistral" else None)
    window = window or None  # 0 and null are no window
    rule = names.INPUT_FAMILIES[base["model_type"]].window_rule if base.get("model_type") in names.INPUT_FAMILIES \
        else "none"
    if rule == "all":
        return [window] * n
    if rule == "qwen":
        window = window if base.get("use_sliding_window") else None
        types = base.get("layer_types")
        if isinstance(types, list) and len(types) == n:
            return [window if t == "sliding_attention" else None for t in types]
        first = base.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
        return [window if isinstance(first, int) and i >= first else None for i in range(n)]
    return [None] * n


def no_window_fields(layout: "names.OutputLayout", num_layers: int) -> dict:
    """config.json fields that make `layout` attend over the full context on every layer."""
    fields: dict = {"sliding_window": None}
    if "layer_types" in layout.inherit:
        fields.update(use_sliding_window=False, layer_types=["full_attention"] * num_layers)
    return fields
