"""Router weights of a grown MoE (`planning.grow`): the base's rows, repeated, and rows for added experts.

- Copies (``num_experts: m × E``, ``gate_mode`` left out): output row ``j`` is the base's row ``j mod E``,
  read from the base's router and returned in fp32 (exact: a bf16 row passes through fp32 unchanged).
- Added dense experts: the base's E rows, unchanged, then one row per new expert. Its direction is the
  mean router input of its positive prompts (minus that of its negatives, when it has any) — the router
  input of the MoE base itself (each layer's ``post_attention_layernorm`` output, real tokens only), so a
  new row is measured on the same inputs the base's rows score; its length is the mean norm of the base's
  rows at that layer, so it competes with them on equal terms. The MoE base is loaded whole with
  transformers (`capture.load_base`); the streamed skeleton (`stream`) runs dense layers only.

An explicit ``gate_mode`` for copies (random, uniform...) is not made here: `router.compute_gates` makes it.
"""

from __future__ import annotations

import torch

from moe_upcycle.checkpoint.source import Checkpoint
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
    from moe_upcycle.gates.capture import load_base
    from moe_upcycle.gates.hidden_gates import prompt_router_inputs

    loaded = load_base(base.path, params.device, params.dtype)
    positive, negative, _ = prompt_router_inputs(loaded, params.experts, "mean", params.batch_size)
    del loaded
    has_negative = torch.tensor([bool(e.negative) for e in params.experts])
    out = {}
    for layer in plan.moe_layers:
        direction = positive[layer] - torch.where(has_negative[:, None], negative[layer], 0)  # (n, H)
        unit = direction / direction.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        out[layer] = unit * base_rows[layer].norm(dim=1).mean()
    return out
