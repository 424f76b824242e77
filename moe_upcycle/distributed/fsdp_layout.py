"""Read how a dense model was sharded with FSDP2, so the MoE made from it can be sharded the same way.

`fsdp_layout(model)` finds every module ``fully_shard`` wrapped (``isinstance(m, FSDPModule)``: decoder layers,
the root, anything else) with the settings it was given — mesh (1-D: FSDP; 2-D: HSDP), ``reshard_after_forward``,
mixed-precision and offload policies, per-parameter ``Shard(dim)`` placements — plus where the local shards live
and which parameters FSDP does not manage. It returns None for a model that holds no DTensor.

It refuses (ConfigError, naming the parameter and the fix) what it cannot mirror: DTensors made by tensor
parallelism (``parallelize_module``: alone, or under ``fully_shard``), FSDP's SPMD mode (``dp_mesh_dims``),
per-parameter meshes from ``shard_placement_fn``, and FSDP's ``replicate``. It reads FSDP2's own records of
those settings (``FSDPModule._get_fsdp_state()``, torch 2.13): ``fully_shard`` offers no public getter.
It does not shard anything (see `sharded_model`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from moe_upcycle.errors import ConfigError

TP_FIX = ("upcycle the model before applying tensor parallelism, then apply your TP plan to the MoE (its experts are "
          "the 3-D mlp.experts.gate_up_proj (E, 2I, H) and down_proj (E, H, I), which need an expert-parallel or "
          "per-expert plan, not the dense MLP's Colwise/Rowwise one); fully_shard the dense model alone (FSDP or "
          "HSDP) and upcycle_model keeps that sharding")


@dataclass(frozen=True)
class ShardedUnit:
    """One ``fully_shard`` call of the dense model.

    Attributes:
        modules: the names of the modules it wrapped ("" for the root; several for ``fully_shard([a, b])``).
        mesh: its DeviceMesh (2-D for HSDP).
        reshard_after_forward: as given to ``fully_shard`` (None: FSDP's default, decided at the first forward).
        mp_policy, offload_policy: as given.
        placements: parameter name -> its ``Shard(dim)``, for parameters not sharded on dim 0.
    """

    modules: tuple[str, ...]
    mesh: Any
    reshard_after_forward: Union[bool, int, None]
    mp_policy: Any
    offload_policy: Any
    placements: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FsdpLayout:
    """How the dense model is sharded.

    Attributes:
        units: every ``fully_shard`` call, children before their parents (the order they must be applied in).
        device: where the local shards live (the mesh's device, or the CPU under a ``CPUOffloadPolicy``).
        unmanaged: names of parameters FSDP does not manage (``ignored_params``, or outside every unit): plain,
            whole tensors on every rank.
    """

    units: tuple[ShardedUnit, ...]
    device: torch.device
    unmanaged: frozenset[str]

    @property
    def mesh_device(self) -> torch.device:
        """The device the mesh computes on (this rank's GPU, or the CPU), where buffers belong: the shards' own
        `device` is the CPU under a ``CPUOffloadPolicy`` while the forward still runs on the mesh's device."""
        mesh = next((u.mesh for u in self.units if u.mesh is not None), None)
        kind = mesh.device_type if mesh is not None else self.device.type
        if kind == "cpu":
            return torch.device("cpu")
        return torch.device(kind, torch.get_device_module(kind).current_device())


def holds_dtensors(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2, tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def fsdp_layout(model: torch.nn.Module) -> Optional[FsdpLayout]:
    """The FSDP2 sharding of `model`, or None when it holds no DTensor.

    Raises:
        ConfigError: a DTensor FSDP does not manage (tensor parallelism), or FSDP settings that cannot be mirrored.
    """
    if not holds_dtensors(model):
        return None
    from torch.distributed.fsdp import FSDPModule

    reshard(model)
    fsdp_modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    params = dict(model.named_parameters())
    name_of = {id(p): n for n, p in params.items()}
    states = [(name, _state(m, name)) for name, m in fsdp_modules]
    units: list[ShardedUnit] = []
    managed: set[str] = set()
    devices: set[torch.device] = set()
    seen: set[int] = set()
    # reversed pre-order: every module comes after its descendants, as fully_shard must be applied
    for name, state in reversed(states):
        if id(state) in seen:
            continue
        seen.add(id(state))
        names = tuple(n for n, s in states if s is state)  # several for fully_shard([a, b])
        unit, owned = _unit(state, names, name_of)
        units.append(unit)
        managed |= set(owned)
        devices |= {params[n].to_local().device for n in owned}
    _refuse_foreign_dtensors(params, managed)
    if len(devices) > 1:
        raise ConfigError(f"dense_model: its FSDP shards live on several devices ({', '.join(map(str, devices))}); "
                          f"upcycle_model gives the MoE one device for its shards: shard every module to one device")
    device = devices.pop() if devices else torch.device("cpu")
    # a unit that manages no parameter (a root whose parameters all sit in units below it, or are ignored) still
    # orchestrates the others: it takes the mesh of a unit that has one (FSDP does not record one for it)
    mesh = next((u.mesh for u in units if u.mesh is not None), None)
    units = [u if u.mesh is not None else dataclasses.replace(u, mesh=mesh) for u in units]
    return FsdpLayout(tuple(units), device, frozenset(n for n in params if n not in managed))


def reshard(model: torch.nn.Module) -> None:
    """Register every FSDP module's shards again as its parameters (local: no collective).

    After a forward without backward (evaluation) FSDP keeps the root's parameters gathered whole
    (``reshard_after_forward`` is False for the root), so its parameters are plain tensors until the next backward.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _state(module: Any, name: str) -> Any:
    try:
        return module._get_fsdp_state()
    except AttributeError:  # FSDP's internals moved: a torch other than the one this was written for (2.13)
        raise ConfigError(f"dense_model: cannot read how module {name or '(root)'!r} was sharded with fully_shard in "
                          f"torch {torch.__version__} (upcycle_model reads FSDP2's state as torch 2.13 keeps it); "
                          f"upcycle before sharding, or use torch 2.13") from None


def _unit(state: Any, names: tuple[str, ...], name_of: dict[int, str]) -> tuple[ShardedUnit, list[str]]:
    """One `ShardedUnit` from FSDP's state of a ``fully_shard`` call, and the parameters it manages (its mesh is
    None when it manages none: FSDP then records none)."""
    from torch.distributed.fsdp import OffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.tensor import Shard

    where = ", ".join(repr(n or "(root)") for n in names)
    groups = state._fsdp_param_groups
    if not groups:
        return ShardedUnit(names, None, None if state._auto_reshard_after_forward else True, state._mp_policy,
                           OffloadPolicy()), []
    if len(groups) > 1:
        raise ConfigError(f"dense_model: module(s) {where} were sharded with per-parameter meshes (fully_shard's "
                          f"shard_placement_fn returning a mesh), which upcycle_model does not mirror; upcycle before "
                          f"sharding, then shard the MoE with your placement function")
    group = groups[0]
    info = group.mesh_info
    if not isinstance(info, FSDPMeshInfo):
        raise ConfigError(f"dense_model: module(s) {where} are replicated with FSDP's replicate() "
                          f"({type(info).__name__}), which upcycle_model does not mirror; upcycle before replicating, "
                          f"then replicate the MoE (or shard the dense model with fully_shard)")
    owned = []
    placements = {}
    for fsdp_param in group.fsdp_params:
        pname = name_of.get(id(fsdp_param.sharded_param), "?")
        if fsdp_param.is_dtensor or getattr(info, "is_spmd_mesh", False):
            raise ConfigError(f"dense_model: parameter {pname!r} is sharded by tensor parallelism and FSDP together "
                              f"(placements {tuple(fsdp_param.sharded_param.placements)} on a mesh of "
                              f"{tuple(fsdp_param.sharded_param.device_mesh.shape)}), which upcycle_model cannot "
                              f"carry into experts; {TP_FIX}")
        if fsdp_param.mesh_info is not info:
            raise ConfigError(f"dense_model: parameter {pname!r} is sharded on its own mesh (shard_placement_fn), "
                              f"which upcycle_model does not mirror; upcycle before sharding")
        if fsdp_param.fsdp_placement != Shard(0):
            placements[pname] = fsdp_param.fsdp_placement
        owned.append(pname)
    return ShardedUnit(names, info.mesh, _reshard_after_forward(state, group), group.mp_policy,
                       group.offload_policy, placements), owned


def _reshard_after_forward(state: Any, group: Any) -> Union[bool, int, None]:
    """The ``reshard_after_forward`` that made `group`'s post-forward mesh (None: FSDP's default)."""
    if state._auto_reshard_after_forward:
        return None
    after = group.post_forward_mesh_info
    if after is None:
        return False
    if after.shard_mesh_size == group.mesh_info.shard_mesh_size:
        return True
    return int(after.shard_mesh_size)


def _refuse_foreign_dtensors(params: dict[str, torch.Tensor], managed: set[str]) -> None:
    """Refuse DTensor parameters that FSDP does not manage: tensor parallelism (or DTensors made by hand)."""
    from torch.distributed.tensor import DTensor

    foreign = [n for n, p in params.items() if isinstance(p, DTensor) and n not in managed]
    if foreign:
        p = params[foreign[0]]
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise ConfigError(f"dense_model: parameter {foreign[0]!r}{more} is a DTensor with placements "
                          f"{tuple(p.placements)} on mesh {tuple(p.device_mesh.shape)} that FSDP's fully_shard does "
                          f"not manage: tensor parallelism (parallelize_module) or a DTensor made by hand. "
                          f"upcycle_model cannot carry it into experts; {TP_FIX}")
