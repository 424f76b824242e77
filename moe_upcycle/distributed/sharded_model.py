"""Give the MoE the dense model's FSDP2 sharding, then fill it rank by rank: `upcycle_model`'s sharded path.

`shard_like(moe, layout)` applies ``fully_shard`` to the MoE's modules named like the dense model's units, with
the same mesh (FSDP or HSDP), ``reshard_after_forward``, mixed-precision and offload policies and per-parameter
placements, while the MoE's parameters are still on the meta device (`in_memory.empty_moe_model`); ``to_empty``
then allocates only this rank's shards. A dense unit the MoE has no module for (``mlp.gate_proj``, when each
projection was wrapped) is mirrored by the nearest module it has (``mlp``, the sparse block). Parameters FSDP
does not manage in the dense model stay unmanaged (plain, whole) in the MoE.

`build_sharded_moe` shards and fills (`local_fill`): nothing is gathered whole but one dense layer at a time.
It does not plan, draw routers or check the dense model: `upcycle_model` does, as for an unsharded model.
"""

from __future__ import annotations

from typing import Callable

import torch

from moe_upcycle.distributed.fsdp_layout import FsdpLayout
from moe_upcycle.distributed.local_fill import Place, ShardedSource, fill_local_shards
from moe_upcycle.distributed.rank_failures import all_or_none
from moe_upcycle.planning.steps import Plan


def build_sharded_moe(model: torch.nn.Module, plan: Plan, source: ShardedSource, gates: dict[int, torch.Tensor],
                      seed: int, layout: FsdpLayout, place: Callable[[str, dict], Place]) -> None:
    """Shard `model` (an MoE on the meta device) like the dense model and fill this rank's shards from the plan.

    Args:
        model: from `in_memory.empty_moe_model`.
        plan, gates, seed: as for the one-process fill.
        source: the dense model's state dict (`ShardedSource`).
        layout: the dense model's sharding (`fsdp_layout`).
        place: (MoE parameter, index) of an output tensor name (`in_memory._place`).

    Raises:
        The first error of any rank, on every rank.
    """
    if plan.tied_embeddings:  # tied before sharding: FSDP then keeps one parameter under both names
        model.tie_weights()
    with all_or_none("sharding the MoE"):
        moe_units = shard_like(model, layout)
    fill_local_shards(model, plan, source, gates, seed, place)
    if plan.tied_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"sharding untied the MoE's head from its embedding (units {moe_units}); this is a bug")


def shard_like(moe: torch.nn.Module, layout: FsdpLayout) -> list[tuple[str, ...]]:
    """``fully_shard`` `moe`'s modules as the dense model's were, then allocate this rank's shards.

    Returns:
        The MoE module names of each ``fully_shard`` call, in the order applied.
    """
    from torch.distributed.fsdp import fully_shard

    modules = dict(moe.named_modules())
    params = dict(moe.named_parameters())
    ignored = {params[n] for n in layout.unmanaged if n in params}
    order = {name: i for i, name in enumerate(reversed(list(modules)))}  # descendants before ancestors
    mirrored: dict[tuple[str, ...], object] = {}
    taken: set[str] = set()
    for unit in layout.units:
        names = tuple(dict.fromkeys(m for m in map(lambda n: _mirror(n, modules), unit.modules) if m not in taken))
        if names:
            taken.update(names)
            mirrored[names] = unit
    applied = sorted(mirrored, key=lambda names: min(order[n] for n in names))
    for names in applied:
        unit = mirrored[names]
        placements = {params[n]: p for n, p in unit.placements.items() if n in params}
        fully_shard([modules[n] for n in names] if len(names) > 1 else modules[names[0]], mesh=unit.mesh,
                    reshard_after_forward=unit.reshard_after_forward, mp_policy=unit.mp_policy,
                    offload_policy=unit.offload_policy,
                    shard_placement_fn=(lambda p, chosen=placements: chosen.get(p)) if placements else None,
                    ignored_params=ignored or None)
    # to_empty replaces buffers too (rotary inv_freq, computed when the model was made): keep them as they are
    buffers = [(name.rpartition("."), buf) for name, buf in moe.named_buffers()]
    moe.to_empty(device=layout.device)
    for (owner, _, leaf), buf in buffers:
        moe.get_submodule(owner)._buffers[leaf] = buf
    return applied


def _mirror(name: str, modules: dict[str, torch.nn.Module]) -> str:
    """The MoE module standing for dense module `name`: itself, else its nearest ancestor the MoE has."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name
