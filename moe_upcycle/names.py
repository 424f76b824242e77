"""The one table of tensor names: dense input families and MoE output layouts.

Names are templates with ``{layer}`` and ``{expert}`` holes, filled by `fill`. `split_layer`
turns a concrete key such as ``model.layers.3.self_attn.q_proj.weight`` back into
``("model.layers.{layer}.self_attn.q_proj.weight", 3)``. Nothing here reads tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .errors import PlanError

DENSE_MLP = "model.layers.{layer}.mlp.{proj}.weight"
DENSE_MLP_BIAS = "model.layers.{layer}.mlp.{proj}.bias"
PROJS = ("gate_proj", "up_proj", "down_proj")  # SwiGLU: down(act(gate(x)) * up(x))
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class InputFamily:
    """A dense architecture whose MLP is a gate/up/down SwiGLU."""

    model_type: str
    class_name: str
    # per-layer non-MLP tensors it may have beyond the Llama set (e.g. q/k biases, q/k norms)
    extra_layer_tensors: tuple[str, ...] = ()


@dataclass(frozen=True)
class OutputLayout:
    """How one MoE architecture names its router and experts."""

    model_type: str
    class_name: str
    router: str
    expert: dict[str, str]  # dense proj name -> expert template
    # per-layer non-MLP tensors the output can hold (suffix after "model.layers.{layer}.")
    layer_tensors: tuple[str, ...]


LLAMA_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
)

INPUT_FAMILIES: dict[str, InputFamily] = {
    "llama": InputFamily("llama", "LlamaForCausalLM"),
    "mistral": InputFamily("mistral", "MistralForCausalLM"),
}

OUTPUT_LAYOUTS: dict[str, OutputLayout] = {
    "mixtral": OutputLayout(
        model_type="mixtral",
        class_name="MixtralForCausalLM",
        router="model.layers.{layer}.block_sparse_moe.gate.weight",
        expert={
            "gate_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
            "down_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
            "up_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        },
        layer_tensors=LLAMA_LAYER,
    ),
}


def fill(template: str, layer: Optional[int] = None, expert: Optional[int] = None, **extra: str) -> str:
    """Fill a name template.

    Example:
        >>> fill(OUTPUT_LAYOUTS["mixtral"].expert["gate_proj"], layer=3, expert=1)
        'model.layers.3.block_sparse_moe.experts.1.w1.weight'
    """
    return template.format(layer=layer, expert=expert, **extra)


_LAYER_RE = re.compile(r"^(model\.layers\.)(\d+)(\..+)$")


def split_layer(key: str) -> tuple[str, Optional[int]]:
    """Pull the layer index out of a key.

    Example:
        >>> split_layer("model.layers.12.mlp.up_proj.weight")
        ('model.layers.{layer}.mlp.up_proj.weight', 12)
        >>> split_layer("model.norm.weight")
        ('model.norm.weight', None)
    """
    m = _LAYER_RE.match(key)
    if not m:
        return key, None
    return m.group(1) + "{layer}" + m.group(3), int(m.group(2))


def input_family(model_type: str, where: str) -> InputFamily:
    """Look up a dense family by `model_type`, or fail listing what is supported."""
    try:
        return INPUT_FAMILIES[model_type]
    except KeyError:
        supported = ", ".join(f"{f.class_name} ({k})" for k, f in INPUT_FAMILIES.items())
        raise PlanError(f"{where}: model_type {model_type!r} is not supported as input; supported: {supported}") from None


def output_layout(name: str, where: str = "architecture") -> OutputLayout:
    """Look up an MoE output layout by name, or fail listing what is supported."""
    try:
        return OUTPUT_LAYOUTS[name]
    except KeyError:
        raise PlanError(f"{where}: {name!r} is not a supported output architecture; "
                        f"supported: {', '.join(OUTPUT_LAYOUTS)}") from None
