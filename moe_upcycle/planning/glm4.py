"""GLM-4-MoE (``glm4_moe``) outputs: what differs from the Qwen MoE outputs, and why copies stay exact.

transformers' ``Glm4MoeMoE`` (5.x and 4.57 alike) computes, per token x::

    s = sigmoid(W x)                                  # (E,) each expert's independent affinity
    chosen = top-k of (s + e_score_correction_bias)   # within the topk_group best of n_group groups
    w_e = s_e / sum_{chosen} s  (norm_topk_prob)      # else w_e = s_e
    y = routed_scaling_factor * sum_{chosen} w_e E_e(x)  +  S(x)

with S one ungated MLP of width ``moe_intermediate_size x n_shared_experts``. We write
``e_score_correction_bias`` as zeros (aux-loss-free balancing starts neutral), ``n_group: 1`` and
``topk_group: 1`` (all experts in one group: the group-limited choice is plain top-k of s, the
ranking a softmax router gives too, since sigmoid is increasing), and ``routed_scaling_factor: 1``.

**Exact copies.** With ``norm_topk_prob: true`` the chosen w_e sum to 1, so N copies of the dense FFN F
with ``residual_scale: r`` give ``y = r F(x) + (sum_j s_j) F(x)`` for shared experts j with
``residual_scale: s_j``: exact when r + sum_j s_j = 1. Without shared experts that is the default
(r = 1; ``n_shared_experts: 0``, whose 0-wide shared MLP transformers still builds: its tensors are written
0-wide, so that the checkpoint has every tensor the model has); with one, the split ``r = 1/2, s = 1/2`` (powers of
two scale without rounding, in every dtype). Unlike Qwen2-MoE there is no shared-expert gate, so the
shared half is added at full weight. `exactness_notes` says which case a build is.

**Attention.** ``Glm4MoeAttention`` is Llama's (rotate-half rope, like ``apply_rotary_pos_emb`` in
Llama) when ``partial_rotary_factor`` is 1; q/k/v carry biases when ``attention_bias`` (Qwen2), o_proj
never; ``use_qk_norm`` adds Qwen3's per-head RMSNorm (head_dim wide, ``rms_norm_eps``) before rope.

**Prompt and hidden-state routers.** Their rows are computed as for softmax routers (unit directions: the
expert's prompt centroid), but a sigmoid scores each expert on its own, not against the others, and
saturates: the default row length (a logit gap of about 4 nats, logits up to ~16 for a token along its
expert's row) would round sigmoid to 1 for every well-matched expert, tying them. So without ``gate_scale``
the rows are a quarter as long (`SIGMOID_SHRINK`, a power of two: the same directions, exactly): sigmoid(w.x)
is then each expert's affinity with x — about sigmoid(4 cos(x, centroid)), between 0.02 and 0.98 — and the
choice is the top-k of it, the same ranking the softmax router gives (a positive scale keeps the order).

**Dense layers.** ``first_k_dense_replace: k`` makes layers 0..k-1 dense ``Glm4MoeMLP`` (intermediate_size
wide) and every later layer MoE: `misfits` refuses any other ``moe_layers:`` pattern.

Reads the plan and config only; writes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_upcycle.checkpoint import names
from moe_upcycle.planning.rope import rope_fields

if TYPE_CHECKING:
    from moe_upcycle.planning.steps import Plan
    from moe_upcycle.recipe.schema import UpcycleConfig


SIGMOID_SHRINK = 4.0  # default prompt / hidden-state rows are divided by it for sigmoid routers


def sigmoid_rows(layout: names.OutputLayout, gates: dict, mode: str, scale_given: bool, prompt_modes: tuple) -> dict:
    """Default-length prompt / hidden-state router rows made for a sigmoid router (see the module docstring).

    Example:
        >>> import torch
        >>> sigmoid_rows(names.OUTPUT_LAYOUTS["glm4_moe"], {0: torch.ones(2, 2)}, "hidden", False, ("hidden",))[0]
        tensor([[0.2500, 0.2500],
                [0.2500, 0.2500]])
    """
    if layout.router_scoring != "sigmoid" or scale_given or mode not in prompt_modes:
        return gates
    return {layer: rows / SIGMOID_SHRINK for layer, rows in gates.items()}


def misfits(layout: names.OutputLayout, config: "UpcycleConfig", dense: tuple[int, ...],
            chosen_text: str) -> list[tuple[str, str]]:
    """Why a GLM-4-MoE layout cannot hold this build: dense layers that are not a prefix, a shared-expert gate.

    Example:
        >>> lay = names.OUTPUT_LAYOUTS["glm4_moe"]
        >>> misfits(lay, None, (0, 1), "{every: 1, start: 2}"), misfits(lay, None, (1, 3), "[0, 2]")[0][1]
        ([], 'moe_layers')
    """
    out: list[tuple[str, str]] = []
    if not layout.leading_dense_only:
        return out
    if dense and tuple(dense) != tuple(range(len(dense))):
        out.append((f"{layout.label} keeps only its first layers dense (first_k_dense_replace: layers 0..k-1 "
                    f"dense, every later layer MoE), but moe_layers: {chosen_text} keeps layers "
                    f"{', '.join(map(str, dense))} dense; make the MoE layers a suffix (moe_layers: "
                    f"{{every: 1, start: N}}, or a list such as [2, 3]); qwen2_moe and qwen3_moe keep any layers dense "
                    f"(mlp_only_layers)", "moe_layers"))
    if config is not None and config.shared_expert_gate:
        out.append((f"{layout.label}'s shared experts are ungated (always added at full weight), but "
                    f"shared_expert_gate: {config.shared_expert_gate} is set; leave it out (with shared experts, "
                    f"set residual_scale for the exact split: routed 0.5, shared 0.5)", "shared_expert_gate"))
    return out


def config_fields(plan: "Plan") -> dict:
    """GLM-4-MoE's config.json fields that depend on the plan (the fixed ones are `names.OUTPUT_LAYOUTS` data).

    ``first_k_dense_replace`` (the dense prefix), ``n_shared_experts`` (shared width / expert width),
    ``use_qk_norm`` (the base has q/k norms), and ``partial_rotary_factor: 1`` inside ``rope_parameters`` too
    (transformers 5 reads it there; 4.57 and llama.cpp's converter read the top-level one).
    """
    layout = names.output_layout(plan.architecture)
    first_moe = plan.moe_layers[0] if plan.moe_layers else plan.num_layers
    top = {s.name: s for s in plan.steps}
    gate0 = top.get(names.fill(layout.expert["gate_proj"], layer=first_moe, expert=0))
    shared = top.get(names.fill(layout.shared_expert["gate_proj"], layer=first_moe))
    expert_width = gate0.shape[0] if gate0 else plan.base_config.intermediate_size
    fields = {
        "first_k_dense_replace": first_moe,
        "n_shared_experts": shared.shape[0] // expert_width if shared else 0,
        "use_qk_norm": any(s.name.endswith(names.QK_NORM) for s in plan.steps),
    }
    rope = rope_fields(plan.base_config).get("rope_parameters")
    if isinstance(rope, dict):
        fields["rope_parameters"] = {**rope, "partial_rotary_factor": layout.config["partial_rotary_factor"]}
    return fields


def exactness_notes(config: "UpcycleConfig", layout: names.OutputLayout) -> list[str]:
    """Plan notes saying what the routed and shared halves add up to (see the module docstring)."""
    rsf = layout.config["routed_scaling_factor"]
    head = (f"{layout.model_type}: sigmoid router (e_score_correction_bias zeros, n_group 1: plain top-k), "
            f"routed_scaling_factor {rsf:g}")
    shared = config.shared_experts
    routed = {e.residual_scale if e.residual_scale is not None else 1.0 for e in config.expert_list()}
    if not shared:
        line = head + "; no shared_experts, so n_shared_experts: 0 (a 0-wide shared MLP: 0-wide tensors)"
        s = 0.0
    else:
        s = sum(e.residual_scale if e.residual_scale is not None else 1.0 for e in shared)
        line = (head + f"; each MoE layer outputs {'/'.join(f'{rsf * r:g}' for r in sorted(routed))} x routed + "
                f"{s:g} x shared (the shared MLP is ungated)")
    refs = {e.source_model for e in config.expert_list()} | {e.source_model for e in shared}
    if refs != {config.base_model} or len(routed) != 1 or config.norm_topk_prob is False:
        return [line]
    factor = rsf * next(iter(routed)) + s
    if factor == 1:
        return [line + "; for these copies of base_model that is exactly the dense FFN"]
    fix = (f"set residual_scale: {(1 - s) / rsf:g} on the routed experts" if s < 1 else
           "set residual_scale on the routed and shared experts so that they add up to 1 (e.g. 0.5 and 0.5)")
    return [line + f"; for these copies of base_model that is {factor:g} x the dense FFN, so it will not reproduce "
                   f"the dense model — {fix} for the exact split"]


def window_notes(layout: names.OutputLayout, base_config: dict) -> list[str]:
    """A caution when the dense base attends within a sliding window, which ``Glm4MoeAttention`` does not have."""
    from moe_upcycle.planning import windows

    if not layout.leading_dense_only:
        return []
    sliding = [w for w in windows.dense_windows(base_config) if w]
    if not sliding:
        return []
    return [f"{layout.model_type} has no sliding-window attention: the base attends within {min(sliding)} tokens on "
            f"{len(sliding)} layer(s), this MoE over the whole context, so the two agree on texts up to "
            f"{min(sliding)} tokens and differ beyond; use architecture: mixtral (or qwen2_moe) to keep the window"]
