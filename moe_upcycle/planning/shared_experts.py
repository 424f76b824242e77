"""The Qwen2-MoE shared expert: its planned tensors, its gate init, and when copy-upcycling is exact.

A Qwen2-MoE block computes, per token x (with ``norm_topk_prob: true``, so the top-k weights
w_e sum to 1)::

    y = sum_{e in top-k} w_e * E_e(x)  +  sigmoid(g . x) * S(x)

`shared_experts:` lists 0..n dense FFNs. The output has exactly one shared expert, so n of them
become one whose intermediate size is the sum: gate_proj and up_proj rows are concatenated
(n*I, H) and down_proj columns (H, n*I). An FFN is a sum over its intermediate neurons, so
S(x) = sum_j S_j(x) exactly: several shared experts behind one gate lose nothing. With none, the
shared expert is one all-zero neuron (intermediate size 1: llama.cpp refuses a 0-wide one) and adds
exactly nothing.

The gate g (1, H) is initialised (`shared_expert_gate:`) either

- ``constant``: tiny equal entries (`llamacpp.half_gate_value`), so sigmoid(g . x) = 1/2 for every
  token to fp32 rounding, and g . x is not 0 (llama.cpp evaluates the sigmoid as silu(z)/z, NaN at
  z = 0, which all-zero weights gave), or
- ``prompts``: the normalised mean token embedding of the shared experts' positive prompts (as
  `cheap_embed` does for routers), so the shared expert speaks up on text like its prompts.

**Exact copy-upcycling with shared experts.** Let every routed and shared expert be the base's
FFN F, routed experts carry ``residual_scale: r`` and shared expert j ``residual_scale: s_j``
(both scale down_proj, as in mergekit). With the constant gate::

    y = r * F(x) + 1/2 * (sum_j s_j) * F(x)

which equals the dense F(x) exactly when r + (sum_j s_j) / 2 = 1 — the exact split, e.g. one
shared expert with s = 1 and routed experts with r = 1/2 (half the FFN routed, half shared), or
two shared experts with s = 1/2 each and r = 1/2. Powers of two scale floating-point numbers
without rounding, so the output differs from the dense model only by summation order (~1e-7
relative in fp32). The deviation when it cannot be exact: with ``shared_expert_gate: prompts``
the gate varies per token and y - F(x) = (sigmoid(g . x) - 1/2) * (sum_j s_j) * F(x); no constant
scales remove that. `exactness_notes` puts the resulting factor in the plan's notes.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.planning import glm4
from moe_upcycle.planning.llamacpp import EMPTY_SHARED_EXPERT_SIZE
from moe_upcycle.planning.steps import Step, mergekit_transforms, source_layer
from moe_upcycle.recipe.params import PROMPT_MODES
from moe_upcycle.recipe.schema import UpcycleConfig


def gate_init(config: UpcycleConfig) -> str:
    """``shared_expert_gate`` as given, else ``prompts`` when a prompt gate mode has prompts for every shared expert."""
    if config.shared_expert_gate:
        return config.shared_expert_gate
    shared = config.shared_experts
    has_prompts = bool(shared) and all(e.positive_prompts for e in shared)
    return "prompts" if config.gate_mode in PROMPT_MODES and has_prompts else "constant"


def plan_steps(config: UpcycleConfig, sources: dict[str, Checkpoint], layout: names.OutputLayout, layer: int,
               dtype: torch.dtype, problems: list[str]) -> list[Step]:
    """One layer's shared-expert tensors and gate (none for outputs without a shared expert).

    Missing source tensors are appended to `problems`.
    """
    if not layout.shared_expert:
        return []
    hidden = sources[config.base_model].fields.hidden_size
    steps = []
    for proj in names.PROJS:
        name = names.fill(layout.shared_expert[proj], layer=layer)
        dim = 1 if proj == "down_proj" else 0  # gate/up: (I, H) rows; down: (H, I) columns
        parts = []
        for i, expert in enumerate(config.shared_experts):
            key = names.fill(names.DENSE_MLP, layer=source_layer(expert, layer), proj=proj)
            info = sources[expert.source_model].tensors.get(key)
            if info is None:
                problems.append(f"shared_experts[{i}] ({expert.source_model}): tensor {key!r} is missing")
                continue
            part_name = name if len(config.shared_experts) == 1 else f"{name}/shared_experts[{i}]"
            parts.append(Step(part_name, info.shape, dtype, "shared", (expert.source_model, key), layer,
                              transforms=mergekit_transforms(expert, proj)))
        if not config.shared_experts:
            # GLM-4-MoE: n_shared_experts 0 builds a 0-wide shared MLP, so its tensors are written 0-wide
            size = EMPTY_SHARED_EXPERT_SIZE if layout.shared_size_key else 0
            steps.append(Step(name, (hidden, size) if dim else (size, hidden), dtype, "zeros", layer=layer))
        elif len(parts) == 1:
            steps.append(parts[0])
        elif parts:
            shape = list(parts[0].shape)
            shape[dim] = sum(p.shape[dim] for p in parts)
            steps.append(Step(name, tuple(shape), dtype, "shared", layer=layer, parts=tuple(parts), part_dim=dim))
    if not layout.shared_expert_gate:  # GLM-4-MoE: the shared MLP is ungated
        return steps
    kind = "shared_gate" if gate_init(config) == "prompts" else "half_gate"
    steps.append(Step(names.fill(layout.shared_expert_gate, layer=layer), (1, hidden), dtype, kind, layer=layer))
    return steps


def exactness_notes(config: UpcycleConfig, layout: names.OutputLayout) -> list[str]:
    """Plan notes saying what the shared expert does to the FFN output (see the module docstring)."""
    if not layout.shared_expert:
        return []
    if not layout.shared_expert_gate:  # GLM-4-MoE: ungated shared MLP, sigmoid router
        return glm4.exactness_notes(config, layout)
    shared = config.shared_experts
    if not shared:
        return [f"{layout.model_type}: no shared_experts, so the shared expert is one all-zero neuron and adds nothing"]
    if gate_init(config) == "prompts":
        return ["shared_expert_gate: prompts varies per token, so the output is not the dense model's even for "
                "copies (it differs by (sigmoid(g.x) - 1/2) * sum(shared residual_scale) * FFN(x)); use "
                "shared_expert_gate: constant for an exact start"]
    routed = {e.residual_scale if e.residual_scale is not None else 1.0 for e in config.expert_list()}
    s = sum(e.residual_scale if e.residual_scale is not None else 1.0 for e in shared)
    line = (f"shared_expert_gate: constant (tiny equal weights, sigmoid = 1/2): each MoE layer outputs "
            f"{'/'.join(f'{r:g}' for r in sorted(routed))} x routed + 1/2 x {s:g} x shared")
    refs = {e.source_model for e in config.expert_list()} | {e.source_model for e in shared}
    if refs != {config.base_model} or len(routed) != 1:
        return [line]
    factor = next(iter(routed)) + s / 2
    if factor == 1:
        return [line + "; for these copies of base_model that is exactly the dense FFN (the exact split)"]
    return [line + f"; for these copies of base_model that is {factor:g} x the dense FFN, so it will not reproduce "
                   f"the dense model — set residual_scale: {1 - s / 2:g} on the routed experts for the exact split"]


def shared_gate(gates: Optional[dict[int, torch.Tensor]], step: Step) -> torch.Tensor:
    """The computed gate for a ``shared_gate`` step."""
    if not gates or step.layer not in gates:
        raise RuntimeError(f"{step.name}: no shared expert gate computed; pass "
                           f"gates.router.compute_gate_rows(...).shared to iter_tensors")
    return gates[step.layer]
