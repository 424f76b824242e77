"""Resolve a validated recipe once into the parameters each stage takes (`params`).

These functions are the only readers of `UpcycleConfig` below the entry points and the planner:
everything downstream gets a frozen dataclass with just what it needs.
"""

from __future__ import annotations

from moe_upcycle.recipe.params import CheckParams, ExpertPrompts, GateParams, MoeLayers, RouterFields, WriteParams
from moe_upcycle.recipe.layer_choice import LayerEvery
from moe_upcycle.recipe.schema import ExpertConfig, ExpertInit, UpcycleConfig


def source_refs(config: UpcycleConfig) -> dict[str, str]:
    """Every model the recipe names, once each, mapped to the YAML field that first names it."""
    refs = {config.base_model: "base_model"}
    for i, expert in enumerate(config.experts):
        refs.setdefault(expert.source_model, f"experts[{i}].source_model")
    for i, expert in enumerate(config.shared_experts):
        refs.setdefault(expert.source_model, f"shared_experts[{i}].source_model")
    return refs


def expert_prompts(experts: list[ExpertConfig]) -> tuple[ExpertPrompts, ...]:
    """Name and prompts of each expert, as given."""
    return tuple(ExpertPrompts(e.name or f"expert_{i}", tuple(e.positive_prompts), tuple(e.negative_prompts))
                 for i, e in enumerate(experts))


def expert_inits(config: UpcycleConfig) -> list[ExpertInit]:
    """The effective init of every routed expert: its own, else mergekit's noise_scale, else the config's."""
    out = []
    for expert in config.expert_list():
        if expert.expert_init is not None:
            out.append(expert.expert_init)
        elif expert.noise_scale:
            out.append(ExpertInit(method="noise", scale=expert.noise_scale, absolute=True))
        else:
            out.append(config.expert_init)
    return out


def gate_params(config: UpcycleConfig) -> GateParams:
    """What the gate stage needs: mode, prompts, seed, scales and where hidden-state modes run."""
    init = config.expert_init
    group = int(init.granularity) if init.method == "split" and init.granularity else 1
    return GateParams(
        mode=config.gate_mode, experts=expert_prompts(config.expert_list()), source=config.gate_source,
        shared_experts=expert_prompts(list(config.shared_experts)), copies=config.num_experts is not None,
        seed=config.seed, scale=config.gate_scale, init_std=config.router_init_std, group_size=group,
        center=config.gate_center, calibration_text=config.calibration_text, batch_size=config.batch_size,
        device=config.device, dtype=config.gate_dtype, quantize=config.quantize, mode_default=config.gate_mode_default,
    )


def moe_layers(config: UpcycleConfig) -> MoeLayers:
    """Which layers the recipe makes MoE layers (``moe_layers:``; every layer when it is left out)."""
    chosen = config.moe_layers
    if chosen is None:
        return MoeLayers()
    if isinstance(chosen, LayerEvery):
        return MoeLayers(every=chosen.every, start=chosen.first, start_given=chosen.start is not None)
    return MoeLayers(indices=tuple(chosen))


def write_params(config: UpcycleConfig) -> WriteParams:
    """Storage policy, shard size, checksums and seed for the executor and the writer."""
    return WriteParams(config.tensor_policy, config.max_shard_size, config.checksums, config.seed)


def router_fields(config: UpcycleConfig) -> RouterFields:
    """The router settings that go into config.json."""
    return RouterFields(config.router_aux_loss_coef, config.router_jitter_noise)


def is_function_preserving(config: UpcycleConfig) -> bool:
    """True when every expert is the base FFN with no mergekit noise or residual scale and no shared expert, and
    the top-k weights sum to 1 (renormalised, or every expert active)."""
    if config.shared_experts:
        return False
    if config.norm_topk_prob is False and config.experts_per_token < config.expert_count:
        return False
    return all(e.source_model == config.base_model and not e.noise_scale and e.residual_scale in (None, 1.0)
               for e in config.expert_list())


def check_params(config: UpcycleConfig) -> CheckParams:
    """What verify, drift and routing checks need to know about the recipe."""
    return CheckParams(
        base_model=config.base_model, function_preserving=is_function_preserving(config),
        routing_prompts=tuple(e.positive_prompts[0] for e in config.experts if e.positive_prompts),
        experts=expert_prompts(config.expert_list()), report_init_drift=config.report_init_drift,
        inits_changed=any(init.method != "copy" for init in expert_inits(config)),
    )
