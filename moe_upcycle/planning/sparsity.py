"""What the plan says about where the experts are and how their router weights combine.

Two recipe settings change the MoE blocks without changing a tensor's bytes:

- ``moe_layers:`` (the sparse-upcycling recipe: every other layer). A layer left out keeps the base's
  dense MLP, copied byte for byte, with no router and no shared expert; transformers builds it from
  ``mlp_only_layers`` / ``decoder_sparse_step`` (`arch.sparse_layer_fields`). Only Qwen MoE outputs
  have such layers: Mixtral makes every layer an MoE layer and is refused (`arch.misfits`).
- ``norm_topk_prob: false`` (Qwen MoE outputs). The top-k softmax weights are then used as they are,
  summing to less than 1 unless every expert is active; Qwen1.5-MoE ships so, and llama.cpp's
  qwen2moe always computes so. Copies of the dense FFN then give ``mass x FFN(x)``, not FFN(x).

`layer_notes` and `renormalisation_notes` put that into the plan's notes (and its cautions, where the
MoE will not start as the dense model). The plan itself places the tensors; nothing here reads them.
"""

from __future__ import annotations

from moe_upcycle.checkpoint import names
from moe_upcycle.recipe.layer_words import moe_and_dense_said
from moe_upcycle.recipe.params import MoeLayers
from moe_upcycle.recipe.schema import UpcycleConfig


def layer_notes(config: UpcycleConfig, chosen: MoeLayers, num_layers: int) -> list[str]:
    """One note naming the MoE layers and the dense ones, when the recipe chose layers."""
    if not chosen.given:
        return []
    moe, dense = chosen.layers(num_layers), chosen.dense_layers(num_layers)
    if not dense:
        return [f"moe_layers: {chosen.text()} is every one of the {num_layers} layers: the same as leaving it out"]
    where = "from base_model, not averaged" if config.attention_from == "average" else "from base_model"
    shared = "; the shared expert is in the MoE layers only" if config.shared_experts else ""
    return [f"moe_layers: {chosen.text()}: {moe_and_dense_said(moe, num_layers)} ({where}, copied unchanged){shared}"]


def renormalisation_notes(config: UpcycleConfig, layout: names.OutputLayout, num_experts: int) -> tuple[list[str],
                                                                                                    list[str]]:
    """(notes, cautions) for ``norm_topk_prob: false``: what it does to the MoE's output at init.

    A caution (the MoE will not start as the dense model) when fewer than all experts are active.
    """
    if config.norm_topk_prob is not False or "norm_topk_prob" not in layout.config:
        return [], []
    k = config.experts_per_token
    if k >= num_experts:
        return [f"norm_topk_prob: false changes nothing at init: with all {num_experts} experts active the top-{k} "
                f"weights are the whole softmax and already sum to 1"], []
    caution = (f"norm_topk_prob: false: the top-{k} router weights of each MoE layer are used as they are, not "
               f"renormalised (Qwen1.5-MoE's setting; llama.cpp's qwen2moe always computes so), so the routed "
               f"output is scaled by the top-{k} softmax mass, below 1 for every token: the MoE does not start as "
               f"the dense model, even with copies of its FFN; it does with norm_topk_prob: true (the default) or "
               f"experts_per_token: {num_experts}")
    return [caution], [caution]
