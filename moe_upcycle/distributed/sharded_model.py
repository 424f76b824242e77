"""Make the empty MoE like the dense model — sharded the same way, or on the same devices — then fill it.

`build_like_dense` is the one path of `upcycle_model`, whatever the world size: tie the head (one `param_table`
entry), give the MoE storage (`shard_like` for an FSDP2-sharded dense model: ``fully_shard`` with the dense
model's settings, then ``to_empty``, so each rank allocates only its own shards; else `placement.allocate`, each
parameter on its dense module's device), compute the buffers on their device (`placement.init_buffers`: the mesh's
device when sharded — torchtitan's order, never CPU buffers restored beside GPU parameters), then fill
(`local_fill`; nothing is gathered whole but one dense layer at a time, and nothing at all in one process).

`shard_like(moe, layout)` applies ``fully_shard`` to the MoE's modules named like the dense model's units, with
the same mesh (FSDP or HSDP), ``reshard_after_forward``, mixed-precision and offload policies and per-parameter
placements, while the MoE's parameters are still on the meta device (`in_memory.empty_moe_model`). A dense unit
the MoE has no module for (``mlp.gate_proj``, when each projection was wrapped) is mirrored by the nearest module
it has (``mlp``, the sparse block). Parameters FSDP does not manage in the dense model stay unmanaged (plain,
whole) in the MoE.

It does not plan, draw routers or check the dense model: `upcycle_model` does.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.param_table import ParamTable, param_table
from moe_upcycle.checkpoint.placement import DensePlacement, allocate, init_buffers
from moe_upcycle.distributed.fsdp_layout import FsdpLayout
from moe_upcycle.distributed.local_fill import ModelSource, fill_local_shards
from moe_upcycle.distributed.rank_failures import all_or_none
from moe_upcycle.planning.steps import Plan


def build_like_dense(model: torch.nn.Module, plan: Plan, source: ModelSource, gates: dict[int, torch.Tensor],
                     seed: int, layout: Optional[FsdpLayout], placement: DensePlacement) -> ParamTable:
    """Give `model` (an MoE on the meta device) storage as the dense model has it, its buffers, and its values.

    Args:
        model: from `in_memory.empty_moe_model`.
        plan, gates, seed: the plan, its routers and seed.
        source: the dense model's state dict (`ModelSource`).
        layout: the dense model's FSDP2 sharding (`fsdp_layout`), or None: not sharded.
        placement: the dense model's devices (`placement.dense_placement`), used when not sharded.

    Returns:
        The MoE's `param_table`.

    Raises:
        The first error of any rank, on every rank (sharded).
    """
    if plan.tied_embeddings:  # tied before sharding: FSDP then keeps one parameter under both names
        model.tie_weights()
    table = param_table(model)
    tied = any({names.EMBED, names.LM_HEAD} <= set(group) for group in table.ties)
    if plan.tied_embeddings and not tied:
        raise RuntimeError(f"the {type(model).__name__} did not tie its head to its embedding; this is a bug")
    made = {name: buf for name, buf in model.named_buffers()}  # as constructed, before to_empty replaces them
    if layout is not None:
        with all_or_none("sharding the MoE"):
            shard_like(model, layout)
        table.tie(model)  # a tied head FSDP does not manage (root not wrapped) was untied by to_empty
        device = layout.mesh_device
        init_buffers(model, lambda name: device, made)
    else:
        allocate(model, table, placement.device_for)
        init_buffers(model, placement.device_for, made)
    fill_local_shards(model, plan, source, gates, seed, table)
    if plan.tied_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"making the {type(model).__name__} untied its head from its embedding; this is a bug")
    return table


def shard_like(moe: torch.nn.Module, layout: FsdpLayout) -> list[tuple[str, ...]]:
    """``fully_shard`` `moe`'s modules as the dense model's were, then allocate this rank's shards (``to_empty``:
    its buffers too, uninitialised — `placement.init_buffers` computes them).

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
        names_ = tuple(dict.fromkeys(m for m in map(lambda n: _mirror(n, modules), unit.modules) if m not in taken))
        if names_:
            taken.update(names_)
            mirrored[names_] = unit
    applied = sorted(mirrored, key=lambda names_: min(order[n] for n in names_))
    for names_ in applied:
        unit = mirrored[names_]
        placements = {params[n]: p for n, p in unit.placements.items() if n in params}
        fully_shard([modules[n] for n in names_] if len(names_) > 1 else modules[names_[0]], mesh=unit.mesh,
                    reshard_after_forward=unit.reshard_after_forward, mp_policy=unit.mp_policy,
                    offload_policy=unit.offload_policy,
                    shard_placement_fn=(lambda p, chosen=placements: chosen.get(p)) if placements else None,
                    ignored_params=ignored or None)
    moe.to_empty(device=layout.device)
    return applied


def _mirror(name: str, modules: dict[str, torch.nn.Module]) -> str:
    """The MoE module standing for dense module `name`: itself, else its nearest ancestor the MoE has."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name
