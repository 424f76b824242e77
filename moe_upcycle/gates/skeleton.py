"""The base model built on the meta device from its config.json: transformers' own modules, no weights.

`build_skeleton` makes the ``...ForCausalLM`` as ``AutoModelForCausalLM.from_config`` builds it under accelerate's
``init_empty_weights``: every parameter on the meta device (no memory), every buffer real (the rotary frequencies,
computed as ``from_pretrained`` computes them). Each decoder layer is transformers' own module, so a layer run with
the checkpoint's tensors computes exactly what the whole loaded model computes, in every family and in transformers
4.57 and 5. `layer_keys` names the checkpoint tensors one layer needs; `record_layer_kwargs` runs the model's own
forward with its decoder layers swapped for recorders, so the keyword arguments each layer receives (the causal or
sliding-window mask of its attention type, rotary cos/sin, positions) are the model's own.

It reads no tensor and runs no layer: `stream` does, one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from moe_upcycle.errors import SourceError, reraise_if_out_of_memory

ROUTER_INPUT = "post_attention_layernorm"  # the module whose output each layer's router scores
MLP = "mlp"  # the part of a layer after the router input: not needed in the last layer


@dataclass
class Skeleton:
    """A base model whose parameters are on the meta device.

    Attributes:
        model: the ``...ForCausalLM`` (parameters meta, buffers real).
        decoder: its base model (``model.model``), whose forward `record_layer_kwargs` runs.
        layers: the decoder layers, in order.
        norms: each layer's ``post_attention_layernorm``.
        layer_prefix: checkpoint key prefix of layer l's tensors is ``f"{layer_prefix}{l}."``.
        embed_key: checkpoint key of the input embedding.
        dtype: the compute dtype, as ``from_pretrained(dtype=...)`` would load the weights.
    """

    model: torch.nn.Module
    decoder: torch.nn.Module
    layers: list[torch.nn.Module]
    norms: list[torch.nn.Module]
    layer_prefix: str
    embed_key: str
    dtype: torch.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def num_embeddings(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)


def build_skeleton(path: Path, dtype: torch.dtype) -> Skeleton:
    """The base model of folder `path` on the meta device, in `dtype`.

    Raises:
        SourceError: transformers cannot build the model from config.json, or its layers have no
            ``post_attention_layernorm`` (not a Llama-style decoder).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path))
        with init_empty_weights():  # parameters on meta; buffers (rotary inv_freq) computed for real
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    except Exception as exc:
        reraise_if_out_of_memory(exc)
        raise SourceError(f"base_model: building {path} from its config.json with transformers for hidden-state gates "
                          f"failed ({type(exc).__name__}: {exc}); use gate_mode: random or cheap_embed, or fix the "
                          f"model folder") from None
    decoder = model.base_model
    layers = list(getattr(decoder, "layers", None) or [])
    norms = [getattr(layer, ROUTER_INPUT, None) for layer in layers]
    if not norms or any(n is None for n in norms):
        raise SourceError(f"base_model: {path} has no {ROUTER_INPUT} in its decoder layers; hidden-state gates "
                          f"need a Llama-style model")
    names = {id(p): n for n, p in model.named_parameters()}
    layer_name = next(n for n, m in model.named_modules() if m is layers[0])  # "model.layers.0"
    return Skeleton(model, decoder, layers, norms, layer_name[:-1], names[id(model.get_input_embeddings().weight)],
                    dtype)


def layer_keys(skeleton: Skeleton, layer: int, router_input_only: bool = False) -> dict[str, str]:
    """Parameter name within layer `layer` -> its checkpoint key, e.g. ``self_attn.q_proj.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``. With `router_input_only`, the MLP's are left out: a forward that
    stops at the router input never reaches it."""
    return {name: f"{skeleton.layer_prefix}{layer}.{name}" for name, _ in skeleton.layers[layer].named_parameters()
            if not (router_input_only and name.split(".", 1)[0] == MLP)}


def move_buffers(skeleton: Skeleton, device: torch.device) -> None:
    """Put the model's real buffers (rotary frequencies) on `device`; parameters stay on meta."""
    for module in skeleton.model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta" and buffer.device != device:
                module._buffers[name] = buffer.to(device)


class _Recorded(Exception):
    """Raised by the last recorder: the model's forward has handed every layer its arguments."""


class _Recorder(torch.nn.Module):
    """Stands in for decoder layer `index`: keeps the hidden states and keyword arguments the model passes it."""

    def __init__(self, index: int, layer: torch.nn.Module, sink: dict, last: bool):
        super().__init__()
        self.index, self.sink, self.last = index, sink, last
        if hasattr(layer, "attention_type"):  # transformers 4.57 picks the layer's mask by it
            self.attention_type = layer.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.setdefault("first", hidden_states)
        self.sink[self.index] = (args, kwargs)
        if self.last:
            raise _Recorded
        return hidden_states


def record_layer_kwargs(skeleton: Skeleton, embeds: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
    """Run the decoder's own forward on `embeds` with recorders for layers; no weight is touched.

    Args:
        embeds: (B, T, H) input embeddings in the compute dtype, on the compute device.
        attention_mask: (B, T) 1 for tokens, 0 for padding.
        position_ids: (B, T), or None for the model's default (0..T-1 whatever the padding).

    Returns:
        (layer 0's input hidden states (B, T, H) as the model makes them from `embeds`, each layer's other
        arguments (positional, keyword): mask, rotary cos/sin, positions — tensors shared between layers, as in
        the model).
    """
    sink: dict = {}
    n = len(skeleton.layers)
    recorders = torch.nn.ModuleList([_Recorder(i, layer, sink, i == n - 1) for i, layer in enumerate(skeleton.layers)])
    real = skeleton.decoder.layers
    skeleton.decoder.layers = recorders
    try:
        kwargs = {"position_ids": position_ids} if position_ids is not None else {}
        skeleton.decoder(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False, **kwargs)
    except _Recorded:
        pass
    finally:
        skeleton.decoder.layers = real
    if n - 1 not in sink:
        raise SourceError(f"base_model: the decoder's forward did not reach its {n} layers; hidden-state gates cannot "
                          f"stream this model")
    return sink["first"], [sink[i] for i in range(n)]
