"""The recipe resolved once: every stage and report of a build reads the same `Resolved`.

`resolved(config)` turns a validated `UpcycleConfig` into the parameter sets of `params` (gates, writing,
checks, router fields), the MoE layers, each routed expert's init and the output dtype, **once per
config**: a second call with the same (frozen) config returns the same object, so the planner, the
architecture choice, the gate stage, the plan report and the model card cannot derive them two ways.
The single derivations are `resolve`'s functions; nothing here reads a checkpoint.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from moe_upcycle.dtypes import DTYPES
from moe_upcycle.recipe import resolve
from moe_upcycle.recipe.params import CheckParams, GateParams, MoeLayers, RouterFields, WriteParams
from moe_upcycle.recipe.schema import ExpertInit, UpcycleConfig

# configs resolved lately; a config is frozen, so its resolution never goes stale (kept while it is here)
_KEPT = 16


@dataclass(frozen=True)
class Resolved:
    """What a recipe asks for, resolved once (`resolved`).

    Attributes:
        gates, writing, checking, router: the stages' parameter sets (`params`).
        moe_layers: which layers become MoE layers.
        inits: the effective init of each routed expert, in slot order.
        dtype: the output dtype the recipe names, or None for the base's (`plan` reads it from the base).
        gate_mode_said: the gate mode as messages name it (with why, when the recipe left it out).
    """

    gates: GateParams
    writing: WriteParams
    checking: CheckParams
    router: RouterFields
    moe_layers: MoeLayers
    inits: tuple[ExpertInit, ...]
    dtype: Optional[torch.dtype]
    gate_mode_said: str


_lock = threading.Lock()
_recent: "OrderedDict[int, tuple[UpcycleConfig, Resolved]]" = OrderedDict()


def resolved(config: UpcycleConfig) -> Resolved:
    """The recipe's `Resolved`, made on the first call for this config and returned by every later one.

    Example:
        >>> from moe_upcycle.recipe.schema import load_config
        >>> cfg = load_config({"base_model": "org/m", "num_experts": 4, "moe_layers": {"every": 2}})
        >>> r = resolved(cfg)
        >>> r is resolved(cfg), r.moe_layers.layers(4), r.gate_mode_said
        (True, (1, 3), 'random (the default for copies without prompts)')
    """
    with _lock:
        kept = _recent.get(id(config))
        if kept is not None and kept[0] is config:  # the config is held here, so its id is not reused meanwhile
            _recent.move_to_end(id(config))
            return kept[1]
    made = _resolve(config)
    with _lock:
        _recent[id(config)] = (config, made)
        while len(_recent) > _KEPT:
            _recent.popitem(last=False)
    return made


def _resolve(config: UpcycleConfig) -> Resolved:
    return Resolved(
        gates=resolve.gate_params(config), writing=resolve.write_params(config), checking=resolve.check_params(config),
        router=resolve.router_fields(config), moe_layers=resolve.moe_layers(config),
        inits=tuple(resolve.expert_inits(config)), dtype=DTYPES[config.dtype] if config.dtype else None,
        gate_mode_said=config.gate_mode_said,
    )
