"""Router weights of a grown MoE (`planning.grow`): the base's rows, repeated, and rows for added experts.

- Copies (``num_experts: m × E``, ``gate_mode`` left out): output row ``j`` is the base's row ``j mod E``,
  read from the base's router and returned in fp32 (exact: a bf16 row passes through fp32 unchanged).
- Added dense experts: the base's E rows, unchanged, then one row per new expert. Its direction is the
  mean router input of its positive prompts (minus that of its negatives, when it has any) — the router
  input of the MoE base itself (each layer's ``post_attention_layernorm`` output, real tokens only), so a
  new row is measured on the same inputs the base's rows score; its length is the mean norm of the base's
  rows at that layer, so it competes with them on equal terms. The MoE base is loaded whole with
  transformers (`moe_router_inputs`, one prompt at a time): the streamed skeleton (`stream`) reads the tensors of
  dense layers only, and an MoE layer's experts are stored under other names than transformers 5's fused modules.

An explicit ``gate_mode`` for copies (random, uniform...) is not made here: `router.compute_gate_rows` makes it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.dtypes import DTYPES
from moe_upcycle.errors import ConfigError
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.params import GateParams


def grown_gates(params: GateParams, plan: Plan, base: Checkpoint) -> dict[int, torch.Tensor]:
    """Router weights (num_experts, hidden), fp32, for every MoE layer of the grown model.

    Raises:
        ConfigError: an added expert without positive prompts (its row would have no direction).
    """
    info = plan.grow
    rows = {layer: base.read(info.base.router_key(layer)).float().repeat(info.copies, 1)
            for layer in plan.moe_layers}  # (m·E, H): row j is the base's row j mod E
    if not info.added:
        return rows
    missing = [f"experts[{i}].positive_prompts" for i, e in enumerate(params.experts) if not e.positive]
    if missing:
        raise ConfigError(*[f"{m}: an added expert's router row is made from its prompts on the MoE's router "
                            f"inputs; give it positive_prompts" for m in missing])
    new = added_rows(params, plan, base, rows)
    return {layer: torch.cat([rows[layer], new[layer]]) for layer in plan.moe_layers}


def added_rows(params: GateParams, plan: Plan, base: Checkpoint,
               base_rows: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """One row per added expert and MoE layer, (n_added, H) fp32 (see the module doc)."""
    positive = moe_router_inputs(base, [e.positive for e in params.experts], plan.moe_layers, params.dtype)
    negative = moe_router_inputs(base, [e.negative for e in params.experts], plan.moe_layers, params.dtype)
    out = {}
    for layer in plan.moe_layers:
        direction = positive[layer] - negative[layer]  # (n, H); an expert without negatives has zeros there
        unit = direction / direction.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        out[layer] = unit * base_rows[layer].norm(dim=1).mean()
    return out


def moe_router_inputs(base: Checkpoint, prompt_sets: Sequence[Sequence[str]], layers: Sequence[int],
                      dtype: Optional[str] = None) -> dict[int, torch.Tensor]:
    """Per layer, (len(prompt_sets), H) fp32: for each set, the mean over its prompts of each prompt's mean router
    input (the layer's ``post_attention_layernorm`` output over the prompt's tokens); zeros for an empty set.

    The MoE base runs whole on the CPU, one prompt at a time (no padding: every token is a real one).
    """
    from transformers import AutoModelForCausalLM

    from moe_upcycle.errors import SourceError
    from moe_upcycle.gates.batches import load_tokenizer

    torch_dtype = DTYPES.get(dtype or "", torch.float32)
    tokenizer = load_tokenizer(base.path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch_dtype).eval()
    except (OSError, ValueError, RuntimeError) as exc:
        raise SourceError(f"base_model: {base.path}: the MoE base does not load in transformers ({exc}); the added "
                          f"experts' router rows are measured on it") from None
    decoder_layers = model.model.layers
    seen: dict[int, torch.Tensor] = {}
    hooks = [decoder_layers[layer].post_attention_layernorm.register_forward_hook(
        lambda _m, _a, out, layer=layer: seen.__setitem__(layer, out[0].float().mean(dim=0)))  # (T, H) -> (H,)
        for layer in layers]
    hidden = model.config.hidden_size
    out = {layer: torch.zeros(len(prompt_sets), hidden) for layer in layers}
    try:
        with torch.inference_mode():
            for i, prompts in enumerate(prompt_sets):
                for text in prompts:
                    ids = tokenizer(text, return_tensors="pt").input_ids[:, :4096]
                    model(input_ids=ids)
                    for layer in layers:
                        out[layer][i] += seen[layer] / len(prompts)
    finally:
        for hook in hooks:
            hook.remove()
    return out
