"""The output's config.json, derived from the plan: what transformers (4.x and 5.x) will build.

`moe_config` derives the MoE config from the base's config.json (written so that transformers
4.x and 5.x both read it: legacy `rope_theta`/`torch_dtype` next to `rope_parameters`/`dtype`; rope scaling
respelled by `rope.rope_fields` so that llama.cpp's converter, vLLM and ExLlamaV2 read it too).
It is pure: `publish.model_files` writes it, `runtimes` judges it, `in_memory` builds a model from it.

`experts_implementation` picks the config's ``experts_implementation`` so that transformers 5
runs the output in its written dtype and in bf16 (what an fp32 checkpoint is most often loaded as): its default, ``grouped_mm``, needs every expert matrix row
(hidden and expert intermediate size times the dtype's bytes) to be a multiple of 16 bytes and
otherwise fails in ``generate`` with "strides should be multiple of 16 bytes" (bf16
stories260K: 172 x 2 = 344 bytes); ``eager`` loops over the hit experts and runs any shape on any
device (transformers 4.x ignores the field).
"""

from __future__ import annotations

from collections import ChainMap
from typing import Optional, Union

import torch

from moe_upcycle.checkpoint.names import output_layout
from moe_upcycle.dtypes import dtype_name
from moe_upcycle.planning import windows
from moe_upcycle.planning.arch import config_fields
from moe_upcycle.planning.grow import grown_config
from moe_upcycle.planning.rope import rope_fields
from moe_upcycle.planning.steps import Plan

# config.json fields the MoE inherits unchanged from the dense base
INHERITED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "sliding_window", "attention_dropout",
)  # rope fields: `rope.rope_fields`
# transformers' defaults (4.57 and 5.x alike) for the dense families' fields that change the computation;
# rope_theta (10000 for all four) is `rope.rope_fields`' business
FAMILY_DEFAULTS = {
    family: {"rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": positions}
    for family, positions in (("llama", 2048), ("mistral", 131072), ("qwen2", 32768), ("qwen3", 32768))
}
FAMILY_DEFAULTS["mistral"]["sliding_window"] = windows.MISTRAL_WINDOW  # `windows.dense_windows` reads it so
GROUPED_MM_ALIGN_BYTES = 16  # torch grouped_mm: strides must be multiples of 16 bytes
# config.json fields that switch training behaviour on in every forward pass, inference included, and so break
# a published model; a build writes each as false, `verify` fails a folder that carries one on. transformers 5.24
# and 4.57 measured (tests/test_verify.py, tests/test_tf4_cli.py).
TRAINING_SWITCHES = {
    "output_router_logits": (
        "transformers then adds the router aux loss in every forward pass, generate included, and a batch of "
        "prompts of different lengths fails to generate (transformers 5: \"The size of tensor a (2) must match the "
        "size of tensor b (...)\"; 4.57 fails on any prompt); a training loop asks for router logits in its forward "
        "calls instead: model(**batch, output_router_logits=True)"),
}


def experts_implementation(hidden: int, intermediate: int, dtype: torch.dtype) -> Optional[str]:
    """``"eager"`` when grouped_mm cannot run these expert shapes, else None (transformers' default).

    Example:
        >>> experts_implementation(64, 172, torch.bfloat16), experts_implementation(64, 172, torch.float32)
        ('eager', None)
    """
    row_bytes = (hidden * dtype.itemsize, intermediate * dtype.itemsize)
    return "eager" if any(b % GROUPED_MM_ALIGN_BYTES for b in row_bytes) else None


def experts_implementation_for(config: dict, dtype: Union[torch.dtype, str]) -> Optional[str]:
    """`experts_implementation` for an MoE config.json dict (its hidden and expert intermediate sizes).

    Example:
        >>> experts_implementation_for({"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 172},
        ...                            torch.bfloat16)
        'eager'
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    expert_size = config[output_layout(config["model_type"]).expert_size_key]
    return experts_implementation(int(config["hidden_size"]), int(expert_size), dtype)


def head_dim_differs(config: dict) -> bool:
    """The config's head_dim is not hidden_size / num_attention_heads (Mistral-Nemo, Qwen3): loaders that
    derive head_dim from the hidden size (Qwen2-MoE in transformers 4.x, vLLM, llama.cpp) cannot hold it."""
    head_dim = config.get("head_dim")
    return bool(head_dim) and head_dim * config["num_attention_heads"] != config["hidden_size"]


def moe_config(plan: Plan, router_aux_loss_coef: Optional[float] = None, router_jitter_noise: float = 0.0) -> dict:
    """The output config.json as a dict.

    Args:
        plan: the build plan (expert sizes are read from its planned tensors, so split experts are described as written).
        router_aux_loss_coef: load-balancing loss weight (None: 0.001, Mixtral's default).
        router_jitter_noise: multiplicative jitter on router inputs during training (0: off).

    Example:
        >>> cfg = moe_config(plan)  # doctest: +SKIP
        >>> cfg["num_local_experts"], cfg["architectures"]  # doctest: +SKIP
        (4, ['MixtralForCausalLM'])
    """
    if plan.grow is not None:  # a grown MoE: the base's own config.json, more experts (`grow.grown_config`)
        cfg = grown_config(plan, router_aux_loss_coef, router_jitter_noise or None)
        sizes = cfg["hidden_size"], plan.grow.base.expert_size
        implementation = experts_implementation(*sizes, plan.dtype) or experts_implementation(*sizes, torch.bfloat16)
        return {**cfg, "experts_implementation": implementation} if implementation else cfg
    # a field the base leaves out is its family's default, which the output class may not share (Mixtral:
    # rms_norm_eps 1e-5, rope_theta 1e6, max_position_embeddings 131072): write the dense model's value
    # (a lookup, not a copy: only the fields read here are read, each checked by `dense_config`)
    base = ChainMap(plan.base_config, FAMILY_DEFAULTS.get(plan.base_config.model_type, {}))
    layout = output_layout(plan.architecture)
    cfg = {k: base[k] for k in INHERITED if k in base}
    # null is "the family default" in the base (Mistral configs may say "head_dim": null; 4.x's MistralConfig
    # holds None in memory), but Qwen-MoE classes multiply it: write the value the dense model uses
    defaults = {"head_dim": plan.base_config.head_dim, "num_key_value_heads": plan.base_config.num_key_value_heads}
    cfg.update({k: v for k, v in defaults.items() if cfg.get(k) is None})
    cfg["tie_word_embeddings"] = plan.tied_embeddings
    # transformers 5 keeps rope settings in rope_parameters; 4.x reads rope_theta / rope_scaling; llama.cpp's
    # converter, vLLM and ExLlamaV2 read fewer spellings: one that all of them read
    cfg.update(rope_fields(base))
    cfg.setdefault("sliding_window", None)
    dtype = dtype_name(plan.dtype)
    cfg.update(
        architectures=[layout.class_name],
        model_type=layout.model_type,
        num_experts_per_tok=plan.experts_per_token,
        router_aux_loss_coef=0.001 if router_aux_loss_coef is None else router_aux_loss_coef,
        # a training switch, always false in a published config (`TRAINING_SWITCHES`)
        output_router_logits=False,
        dtype=dtype,
        torch_dtype=dtype,
    )
    cfg.update(config_fields(plan))  # per architecture: expert count/size keys, shared expert, biases
    # checked in bf16 too: an fp32 checkpoint is most often loaded as bf16 (route does on a GPU), as
    # `upcycle_model` checks for a model trained in fp32 and saved in bf16
    sizes = cfg["hidden_size"], cfg[layout.expert_size_key]
    implementation = experts_implementation(*sizes, plan.dtype) or experts_implementation(*sizes, torch.bfloat16)
    if implementation:
        cfg["experts_implementation"] = implementation
    if "router_jitter_noise" in cfg:
        cfg["router_jitter_noise"] = router_jitter_noise
    return dict(sorted(cfg.items()))
