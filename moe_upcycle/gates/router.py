"""Router (gate) weights: one (num_experts, hidden) matrix per layer.

Modes handled here need at most one tensor of the base (the embedding matrix):

- ``random``: normal with std `router_init_std` (default 0.02, the usual init of a linear layer
  in these models — mergekit uses 1.0, which saturates the softmax).
- ``uniform_random``: what ``nn.Linear`` does by default, U(-1/sqrt(H), 1/sqrt(H)).
- ``uniform``: zeros, so every expert gets exactly the same score (uniform routing).
- ``cheap_embed``: masked mean of each prompt's token embeddings, averaged over the expert's
  positive prompts, minus the mean of its negative prompts; centred over experts with
  ``gate_center``; normalised and scaled.

With ``expert_init: split`` the rows are tied within each virtual group of G experts
(`inits.tie_router_rows`), which is what keeps a split model function-preserving at init.

Hidden-state modes (``hidden``, ``hidden_avg``, ``hidden_last``, ``kmeans``) run the base model
and live in `hidden_gates`. With ``gate_source: mergekit`` every mode is computed as mergekit-moe
0.1.5 computes it, in `mergekit_gates`. `compute_gate_rows` gives a build every row it writes (routers and the
shared-expert gate) for its MoE layers, streaming the base at most once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.errors import ConfigError, reraise_if_out_of_memory
from moe_upcycle.planning import glm4, inits
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.params import HIDDEN_MODES, PROMPT_MODES, ExpertPrompts, GateParams
from moe_upcycle.inputs.text import check_token_ids

if TYPE_CHECKING:
    from moe_upcycle.gates.self_check import SelfCheck

__all__ = ["PROMPT_MODES", "GateRows", "compute_gate_rows", "cheap_embed_rows",
           "default_gate_scale", "normalise_rows", "check_prompts"]


def default_gate_scale(hidden_size: int) -> float:
    """Length given to each unit gate row when `gate_scale` is not set.

    The router input is an RMS-normalised hidden state, whose length is about sqrt(H) (times
    the norm weights). With rows of length 16/sqrt(H), a cosine gap of 0.25 between the best
    and second-best expert gives a logit gap of about 4 — decisive (softmax ≈ 0.98 for two
    experts) without saturating it for inputs that match no expert well.
    """
    return 16.0 / math.sqrt(hidden_size)


@dataclass(frozen=True)
class GateRows:
    """What the gates give a build: the routers, MoE layer -> (num_experts, hidden) fp32, the shared-expert gates,
    MoE layer -> (1, hidden) fp32 (empty unless the plan has ``shared_gate`` steps; dense layers have no entry), and
    the routing self-check (`self_check`; None unless native hidden-state prompt rows were made)."""

    routers: dict[int, torch.Tensor]
    shared: dict[int, torch.Tensor]
    self_check: Optional["SelfCheck"] = None


def compute_gate_rows(params: GateParams, plan: Plan, base: Checkpoint,
                      device: Optional[torch.device] = None) -> GateRows:
    """Every gate row a build writes, for the MoE layers only (`Plan.moe_layers`), the base streamed at most once.

    `device` (default CPU) is where ``random``/``uniform_random``/``uniform`` rows are drawn, with a
    generator of that device seeded with ``params.seed`` (CPU and CUDA draw different rows). Those modes draw
    every layer's rows in turn and keep the MoE layers', so a layer's router is the same whichever other layers
    are MoE layers; the hidden-state modes reduce the MoE layers' router inputs only and stop after the last.

    The shared-expert gate (``shared_expert_gate: prompts``) is the normalised mean token embedding of the shared
    experts' positive prompts (as `cheap_embed` does for routers; see `planning.shared_experts`); with
    ``gate_source: mergekit`` and one shared expert, its row as mergekit computes it, in the routers' stream.

    Raises:
        ConfigError: prompts missing for a prompt-based mode, or a mode not available.
    """
    check_prompts(params)
    wants_shared = any(s.kind == "shared_gate" for s in plan.steps)
    if params.source == "mergekit":
        from moe_upcycle.gates.mergekit_gates import compute_mergekit_gates

        routers, shared = compute_mergekit_gates(params, plan, base, wants_shared and len(params.shared_experts) == 1)
        if shared or not wants_shared:
            return GateRows(routers, shared)
        return GateRows(routers, _shared_embedding_gates(params, plan, base))
    routers, checked = _native_routers(params, plan, base, device)
    return GateRows(routers, _shared_embedding_gates(params, plan, base) if wants_shared else {}, checked)


def _native_routers(params: GateParams, plan: Plan, base: Checkpoint, device: Optional[torch.device]
                    ) -> tuple[dict[int, torch.Tensor], Optional["SelfCheck"]]:
    """`_routers`, with a sigmoid router's (GLM-4-MoE's) shorter default rows (`glm4.sigmoid_rows`; the self-check's
    top-1 counts do not depend on a row's length)."""
    gates, checked = _routers(params, plan, base, device)
    return glm4.sigmoid_rows(names.output_layout(plan.architecture), gates, params.mode, bool(params.scale),
                             PROMPT_MODES + HIDDEN_MODES), checked


def _routers(params: GateParams, plan: Plan, base: Checkpoint, device: Optional[torch.device]
             ) -> tuple[dict[int, torch.Tensor], Optional["SelfCheck"]]:
    """Native routers (``gate_source: native``) of the MoE layers, and the hidden-state prompt modes' self-check."""
    experts = params.experts
    num_experts, hidden = len(experts), plan.base_config.hidden_size
    mode = params.mode
    moe_layers = list(plan.moe_layers)
    gen = torch.Generator(device=device or "cpu").manual_seed(params.seed)
    group_size = params.group_size  # > 1 for expert_init: split
    if mode == "cheap_embed":
        rows = inits.tie_router_rows(cheap_embed_rows(experts, base), group_size, reduce="mean")  # (E, H)
        if params.center:  # remove what every expert's prompts share, as `hidden_gates.gate_rows` does
            rows = rows - rows.mean(dim=0, keepdim=True)
        shared = normalise_rows(rows, params.scale or default_gate_scale(hidden))
        return {layer: shared.clone() for layer in moe_layers}, None
    if mode in HIDDEN_MODES:
        from moe_upcycle.gates.hidden_gates import checked_hidden_gates

        if base.path is None:
            raise ConfigError(f"gate_mode: {mode} runs the base model, which needs a checkpoint folder")
        one_row_each = len(plan.expert_names) == len(experts)  # not split experts' tied rows
        return checked_hidden_gates(params, plan.num_layers, base, moe_layers,
                                    plan.expert_names if one_row_each else None)
    gates: dict[int, torch.Tensor] = {}
    for layer in range(plan.num_layers):  # every layer drawn in turn, the MoE layers' kept
        if mode == "random":
            g = torch.randn(num_experts, hidden, generator=gen, device=gen.device) * params.init_std
        elif mode == "uniform_random":
            bound = 1.0 / math.sqrt(hidden)
            g = torch.rand(num_experts, hidden, generator=gen, device=gen.device) * (2 * bound) - bound
        else:  # uniform
            g = torch.zeros(num_experts, hidden, device=gen.device)
        if layer in plan.moe_layers:
            gates[layer] = inits.tie_router_rows(g, group_size, reduce="first")
    return gates, None


def check_prompts(params: GateParams) -> None:
    """Prompt-based gate modes need positive prompts for every expert."""
    if params.mode not in PROMPT_MODES:
        return
    if params.copies:
        raise ConfigError(f"gate_mode: {params.mode} needs prompts, but num_experts gives copies without "
                          f"prompts; use gate_mode: random (or uniform, uniform_random; random is the default for "
                          f"copies: leave gate_mode out), or list experts with prompts")
    fix = "; or set gate_mode: random to build without prompts (routers to train)" if params.mode_default else ""
    missing = [f"experts[{i}].positive_prompts: gate_mode {params.mode_said} needs at least one prompt "
               f"(or positive_prompts_from: a prompt set){fix}"
               for i, e in enumerate(params.experts) if not e.positive]
    if missing:
        raise ConfigError(*missing)


def cheap_embed_rows(experts: Sequence[ExpertPrompts], base: Checkpoint, field: str = "experts") -> torch.Tensor:
    """Mean token embedding of each expert's prompts (positive minus negative), (E, H) fp32.

    `field` names the experts' recipe list in messages (``shared_experts`` for shared-expert gates)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base.path))
    except Exception as exc:
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        raise ConfigError(f"gate_mode: cheap_embed needs the base model's tokenizer, which failed to load from "
                          f"{base.path} ({exc}); use gate_mode: random or add tokenizer files") from None
    embed = base.read(names.EMBED).float()  # (V, H)

    def mean_embedding(prompts: Sequence[str], where: str) -> Optional[torch.Tensor]:
        if not prompts:
            return None
        vecs = []
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids and not prompt.strip() and tokenizer.bos_token_id is not None:
                ids = [tokenizer.bos_token_id]  # mergekit's empty "default expert" prompt: the BOS token alone
            if not ids:
                raise ConfigError(f"{where}: prompt {prompt!r} has no tokens with the base model's tokenizer; write "
                                  f"some text, e.g. a sentence of what this expert should see")
            check_token_ids(ids, embed.shape[0], tokenizer, prompt)
            vecs.append(embed[torch.tensor(ids)].mean(dim=0))  # masked mean: real tokens only
        return torch.stack(vecs).mean(dim=0)

    rows = []
    for i, expert in enumerate(experts):
        row = mean_embedding(expert.positive, f"{field}[{i}].positive_prompts")
        negative = mean_embedding(expert.negative, f"{field}[{i}].negative_prompts")
        rows.append(row - negative if negative is not None else row)
    return torch.stack(rows)


def normalise_rows(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """L2-normalise each row and multiply by `scale`."""
    return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12) * scale


def _shared_embedding_gates(params: GateParams, plan: Plan, base: Checkpoint) -> dict[int, torch.Tensor]:
    """The shared-expert gate from the shared experts' prompt embeddings, MoE layer -> (1, H) fp32.

    Raises:
        ConfigError: the base tokenizer does not load, or a prompt has no tokens.
    """
    hidden = plan.base_config.hidden_size
    rows = cheap_embed_rows(params.shared_experts, base, "shared_experts")  # (n, H)
    row = normalise_rows(rows.mean(dim=0, keepdim=True), params.scale or default_gate_scale(hidden))
    return {layer: row.clone() for layer in plan.moe_layers}
