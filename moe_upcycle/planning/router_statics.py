"""ERNIE-4.5-MoE's router extras: its per-layer expert-score bias, and the config.json fields that place its experts.

ERNIE-4.5-MoE's router (transformers' ``Ernie4_5_MoeTopKRouter``) takes softmax probabilities over all experts,
picks the top k of ``probabilities + e_score_correction_bias`` (``mlp.moe_statics.e_score_correction_bias``, (1, E),
float32, a load-balancing statistic), and divides the picked probabilities by ``max(their sum, moe_norm_min)``.
With the bias at zero the choice is the plain top-k, and the weights sum to 1 whenever the top-k mass exceeds
``moe_norm_min`` (1e-12; the top-k mass is at least k/E), so identical experts reproduce the dense FFN. The zero
bias is planned as GLM-4-MoE's is, from the layout's ``router_bias`` (float32 whatever the output dtype: the router
computes in float32; `planning.plan`); `config_fields` writes
which layers are MoE layers in ERNIE's own keys (every layer: start 0, interval 1, end the last layer), its k
(``moe_k``, which llama.cpp's converter reads) and no shared experts.

It plans and writes nothing itself, and reads no tensors.
"""

from __future__ import annotations

from moe_upcycle.checkpoint import names
from moe_upcycle.planning.steps import Plan

def config_fields(layout: names.OutputLayout, plan: Plan) -> dict:
    """ERNIE-4.5-MoE's MoE placement and top-k fields (empty for other outputs)."""
    if layout.model_type != "ernie4_5_moe":
        return {}
    return {"moe_k": plan.experts_per_token, "moe_layer_start_index": 0, "moe_layer_interval": 1,
            "moe_layer_end_index": plan.num_layers - 1, "moe_num_shared_experts": 0, "moe_norm_min": 1e-12}
