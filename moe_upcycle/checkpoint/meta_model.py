"""Describe a dense model's tensors from its config.json alone: names, shapes, dtypes, no files (an MoE's too:
`describe_moe`, for a grown MoE's plan).

`describe_dense(config)` derives every tensor of a Llama/Mistral (or Qwen3.5, by layer kind) checkpoint
from the config's dimensions, using the key templates of `names`; `meta_sources(refs)` opens every model a recipe
names this way (only ``config.json`` has to be on disk), so ``moe-upcycle plan --from-config``
plans a Mixtral-8x7B before a byte of its weights is downloaded, in milliseconds. It does not
read or invent weights: reading a tensor of a meta checkpoint gives a ``meta`` tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.dense_config import DenseConfig, dense_config
from moe_upcycle.checkpoint.source import Checkpoint, meta_checkpoint, open_sources, read_config
from moe_upcycle.checkpoint.lora import reference_parts, resolve_adapter
from moe_upcycle.checkpoint.model_refs import resolve_model
from moe_upcycle.checkpoint.moe_base import DENSE_OF

Dims = dict[str, int]
# per-layer tensor suffix -> shape from the model's dimensions (H hidden, I intermediate,
# Q = heads * head_dim, KV = kv_heads * head_dim); one row per entry of names.LLAMA_LAYER + the MLP
LAYER_SHAPES: dict[str, Callable[[Dims], tuple[int, ...]]] = {
    "input_layernorm.weight": lambda d: (d["H"],),
    "post_attention_layernorm.weight": lambda d: (d["H"],),
    "self_attn.q_proj.weight": lambda d: (d["Q"], d["H"]),
    "self_attn.k_proj.weight": lambda d: (d["KV"], d["H"]),
    "self_attn.v_proj.weight": lambda d: (d["KV"], d["H"]),
    "self_attn.o_proj.weight": lambda d: (d["H"], d["Q"]),
    "mlp.gate_proj.weight": lambda d: (d["I"], d["H"]),
    "mlp.up_proj.weight": lambda d: (d["I"], d["H"]),
    "mlp.down_proj.weight": lambda d: (d["H"], d["I"]),
}
# optional biases, switched on by config flags (Llama's attention_bias / mlp_bias)
BIAS_SHAPES: dict[str, tuple[str, Callable[[Dims], tuple[int, ...]]]] = {
    "self_attn.q_proj.bias": ("attention_bias", lambda d: (d["Q"],)),
    "self_attn.k_proj.bias": ("attention_bias", lambda d: (d["KV"],)),
    "self_attn.v_proj.bias": ("attention_bias", lambda d: (d["KV"],)),
    "self_attn.o_proj.bias": ("attention_bias", lambda d: (d["H"],)),
    "mlp.gate_proj.bias": ("mlp_bias", lambda d: (d["I"],)),
    "mlp.up_proj.bias": ("mlp_bias", lambda d: (d["I"],)),
    "mlp.down_proj.bias": ("mlp_bias", lambda d: (d["H"],)),
}


def _qwen3_5_layer(cfg: DenseConfig, kind: str, dims: Dims) -> dict[str, tuple[int, ...]]:
    """One Qwen3.5 layer's token-mixer tensors: a Gated DeltaNet (``linear_attention``) or gated full attention."""
    if kind == "full_attention":  # q_proj holds each head's query and its output gate
        return {"self_attn.q_proj.weight": (2 * dims["Q"], dims["H"]),
                "self_attn.k_proj.weight": (dims["KV"], dims["H"]), "self_attn.v_proj.weight": (dims["KV"], dims["H"]), "self_attn.o_proj.weight": (dims["H"], dims["Q"]),
                "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,)}
    nk, nv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    conv = 2 * nk * dk + nv * dv  # q, k and v channels
    return {"linear_attn.A_log": (nv,), "linear_attn.conv1d.weight": (conv, 1, cfg["linear_conv_kernel_dim"]),
            "linear_attn.dt_bias": (nv,), "linear_attn.in_proj_a.weight": (nv, dims["H"]),
            "linear_attn.in_proj_b.weight": (nv, dims["H"]), "linear_attn.in_proj_qkv.weight": (conv, dims["H"]),
            "linear_attn.in_proj_z.weight": (nv * dv, dims["H"]), "linear_attn.norm.weight": (dv,),
            "linear_attn.out_proj.weight": (dims["H"], nv * dv)}


def describe_dense(config: Mapping, where: str = "config.json") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a dense checkpoint with this config holds, in Hugging Face order.

    Args:
        config: a ``config.json`` of a supported dense family (llama, mistral): its checked view, or a
            dict, checked here (`dense_config`).
        where: names the config in messages.

    Returns:
        key -> (shape, dtype); the dtype is the config's ``torch_dtype``/``dtype`` (else float32).

    Raises:
        PlanError: the model_type is not a supported dense family.
        SourceError: a field of the config has the wrong type or is out of bounds.

    Example:
        >>> t = describe_dense({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        ...                     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300})
        >>> len(t), t["model.layers.1.self_attn.k_proj.weight"][0]
        (21, (64, 64))
    """
    names.input_family(config.get("model_type", ""), where)
    cfg = config if isinstance(config, DenseConfig) else dense_config(dict(config), where)
    hidden, heads, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    dims = {"H": hidden, "I": cfg.intermediate_size, "Q": heads * head_dim, "KV": cfg.num_key_value_heads * head_dim}
    # torch_dtype first (transformers 4's name), as transformers 4 reads it; float32 when neither names one
    dtype = next(iter(cfg.stated_dtypes.values()), torch.float32)
    vocab = cfg.vocab_size

    shapes: dict[str, tuple[int, ...]] = {names.EMBED: (vocab, hidden)}
    for layer in range(cfg.num_hidden_layers):
        for suffix, shape in LAYER_SHAPES.items():
            if cfg.model_type == "qwen3_5_text" and suffix.startswith("self_attn."):
                continue  # by layer kind, below
            shapes[f"model.layers.{layer}.{suffix}"] = shape(dims)
        if cfg.model_type == "qwen3_5_text":
            kind = cfg["layer_types"][layer] if isinstance(cfg.get("layer_types"), list) else "full_attention"
            shapes.update({f"model.layers.{layer}.{k}": v for k, v in _qwen3_5_layer(cfg, kind, dims).items()})
        for suffix, (flag, shape) in BIAS_SHAPES.items():
            if getattr(cfg, flag):
                shapes[f"model.layers.{layer}.{suffix}"] = shape(dims)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes[names.LM_HEAD] = (vocab, hidden)
    return {k: (s, dtype) for k, s in shapes.items()}


def describe_moe(cfg: DenseConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor an MoE checkpoint of a family moe-upcycle writes (and grows) holds, from its config.json: the
    dense layer tensors, then per MoE layer the router and one tensor per expert matrix (the names of
    `names.OUTPUT_LAYOUTS`), the shared expert and its gate where the config gives one a size, the dense MLP of
    the layers that keep one (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``).

    Example:
        >>> cfg = dense_config({"model_type": "qwen2_moe", "hidden_size": 32, "intermediate_size": 64, "vocab_size": 9,
        ...     "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "moe_intermediate_size": 16,
        ...     "shared_expert_intermediate_size": 24, "mlp_only_layers": [0]}, "config.json")
        >>> t = describe_moe(cfg)
        >>> t["model.layers.1.mlp.experts.3.down_proj.weight"][0], t["model.layers.1.mlp.shared_expert_gate.weight"][0]
        ((32, 16), (1, 32))
        >>> "model.layers.0.mlp.gate.weight" in t, t["model.layers.0.mlp.up_proj.weight"][0]
        (False, (64, 32))
    """
    layout = names.OUTPUT_LAYOUTS[cfg.model_type]
    dense = {k: v for k, v in _dense_shapes(cfg).items() if ".mlp." not in k}
    dtype = next(iter(cfg.stated_dtypes.values()), torch.float32)
    hidden = cfg.hidden_size
    count = next((cfg[k] for k in (layout.experts_key, "num_local_experts", "num_experts") if cfg.get(k)), 0)
    size = cfg.get(layout.expert_size_key) or cfg.intermediate_size
    shared = cfg.get("shared_expert_intermediate_size") if layout.shared_expert else None
    step, only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    shapes: dict[str, tuple[int, ...]] = {}
    for key, shape in dense.items():
        shapes[key] = shape
        layer = names.split_layer(key)[1]
        if layer is None or not key.endswith("post_attention_layernorm.weight"):
            continue
        if layer in only or (layer + 1) % step:  # a dense layer (Qwen MoE's rule)
            for proj in names.PROJS:
                shapes[names.fill(names.DENSE_MLP, layer=layer, proj=proj)] = (
                    (hidden, cfg.intermediate_size) if proj == "down_proj" else (cfg.intermediate_size, hidden))
            continue
        shapes[names.fill(layout.router, layer=layer)] = (count, hidden)
        for e in range(count):
            for proj in names.PROJS:
                shapes[names.fill(layout.expert[proj], layer=layer, expert=e)] = (
                    (hidden, size) if proj == "down_proj" else (size, hidden))
        if shared:
            for proj in names.PROJS:
                shapes[names.fill(layout.shared_expert[proj], layer=layer)] = (
                    (hidden, shared) if proj == "down_proj" else (shared, hidden))
            shapes[names.fill(layout.shared_expert_gate, layer=layer)] = (1, hidden)
    return {k: (s, dtype) for k, s in shapes.items()}


def _dense_shapes(cfg: DenseConfig) -> dict[str, tuple[int, ...]]:
    """The Llama-named tensors of `cfg` whatever its model_type (q/k/v biases of Qwen2-MoE, q/k norms of Qwen3-MoE)."""
    head = cfg.head_dim
    d = {"H": cfg.hidden_size, "I": cfg.intermediate_size, "Q": cfg.num_attention_heads * head,
         "KV": cfg.num_key_value_heads * head}
    # attention biases: Qwen2-MoE's q/k/v (always in transformers 4; qkv_bias in 5), Qwen3-MoE's q/k/v/o with
    # attention_bias, Mixtral's none
    biases = (names.QKV_BIAS if cfg.model_type == "qwen2_moe" and cfg.get("qkv_bias", True) is not False else
              names.QKV_BIAS + names.O_BIAS if cfg.model_type == "qwen3_moe" and cfg.attention_bias else ())
    shapes: dict[str, tuple[int, ...]] = {names.EMBED: (cfg.vocab_size, cfg.hidden_size)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        for suffix, shape in LAYER_SHAPES.items():
            shapes[p + suffix] = shape(d)
        for suffix in biases:
            shapes[p + suffix] = BIAS_SHAPES[suffix][1](d)
        if cfg.model_type == "qwen3_moe":
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (head,)
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes[names.LM_HEAD] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def meta_source(ref: str, field_name: str) -> Checkpoint:
    """A checkpoint described from the ``config.json`` of `ref` alone (weights need not exist).

    Raises:
        SourceError: `ref` is not a local folder or cached hub id, or has no usable config.json.
    """
    model_ref, adapter_ref = reference_parts(ref, field_name)  # a LoRA changes no shape: model+adapter is planned as the model
    path = resolve_model(model_ref, field_name)
    if adapter_ref is not None:
        resolve_adapter(adapter_ref, field_name)
    config = read_config(path, field_name)  # checked: every dimension is a positive integer
    if config.model_type in names.OUTPUT_LAYOUTS and config.model_type in DENSE_OF:  # an MoE base to grow (`grow`)
        return meta_checkpoint(ref, config, describe_moe(config))
    return meta_checkpoint(ref, config, describe_dense(config, f"{field_name} ({path / 'config.json'})"))


def meta_sources(refs: dict[str, str]) -> dict[str, Checkpoint]:
    """Every model the recipe names (`recipe.resolve.source_refs`), described from config.json only.

    Raises:
        SourceError: every model whose config could not be read, together.
    """
    return open_sources(refs, meta_source)
