"""Fill each rank's own shards of a sharded MoE from a plan, never holding more than one dense layer whole.

Every planned output tensor (`Step`) lands in a box of one MoE parameter (`place`: a whole parameter, or one
expert's slice of transformers 5's fused ``mlp.experts.gate_up_proj[e, :I]``); DTensor's
``compute_local_shape_and_global_offset`` gives the box of the parameter this rank holds. A rank copies into its
local shard only the intersection of the two, and computes only the steps that intersect it.

Steps are taken one group at a time (the embedding, each decoder layer, the norm and head), in plan order:

- a copy whose MoE parameter is sharded like its dense parameter (same shape, mesh and placements) copies the
  local shard directly, with no collective;
- every other step reads its dense tensors whole: the group's DTensors are gathered (``full_tensor``) on every
  rank in the same order (collectives must be issued identically everywhere), the steps that intersect this
  rank's shards run through `execute.iter_tensors` exactly as in one process, and the gathered tensors are freed
  before the next group. Memory: one dense layer's FFN (and attention, where its sharding changed) plus the local
  shards.

Random transforms are seeded per (seed, tensor name) (`execute.slot_generator`) and routers are drawn whole, so
the values do not depend on the world size or on which steps a rank computes. A model that holds no DTensor
(one process) is filled by the same code: each parameter is then one whole box, every step intersects it, and no
collective is issued (a process group may exist: its other ranks are not asked). Which parameter a step fills, and
which names are one tied parameter, come from the model's `param_table`: a tied alias (``lm_head.weight``) is
filled, gathered and read as the one parameter it names. It does not shard the model (see `sharded_model`).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from moe_upcycle.checkpoint.param_table import ParamTable, param_table
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.writer import TensorParts
from moe_upcycle.distributed.rank_failures import all_or_none, world
from moe_upcycle.errors import UpcycleWarning
from moe_upcycle.planning.execute import iter_tensors
from moe_upcycle.planning.guards import nonfinite_line
from moe_upcycle.planning.steps import Plan, Step

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop) in the global parameter
Place = tuple[str, Optional[tuple]]  # (MoE parameter name, index into it), as `ParamTable.from_hf` gives


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank of its mesh must call it), a plain tensor as it is.

    Local shards offloaded to the CPU under a GPU mesh (``CPUOffloadPolicy``) are moved to the mesh's device first:
    NCCL gathers GPU memory only.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if not isinstance(value, DTensor):
            return value.detach()
        mesh = value.device_mesh
        local = value.to_local()
        if local.device.type != mesh.device_type:
            device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
            value = DTensor.from_local(local.to(device), mesh, value.placements, shape=value.shape,
                                       stride=value.stride())
        return value.full_tensor()


@dataclass
class ModelSource(Checkpoint):
    """A dense model's state dict (DTensors and plain tensors: sharded or not) as a plan source
    (`in_memory.state_dict_source` makes it).

    `read` returns whole tensors: a DTensor is gathered on the spot (a collective), except inside `gathered`, where
    only the tensors gathered on entry may be read — so no rank ever issues a collective the others do not.
    The names of one parameter (a tied head and its embedding: one `param_table` entry) form a `shared_groups`
    entry, as one storage in a ``.bin`` does, and are gathered once, under the first name.
    """

    state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _whole: Optional[dict[str, torch.Tensor]] = field(default=None, repr=False)

    def first_name(self, key: str) -> str:
        """The name `key`'s storage is read under: the first of its tied group (itself when untied)."""
        return next((group[0] for group in self.shared_groups if key in group), key)

    def is_sharded(self, key: str) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(self.state[key], DTensor)

    def read(self, key: str) -> torch.Tensor:
        key = self.first_name(key)
        if self._whole is not None:
            if key in self._whole:
                return self._whole[key]
            if self.is_sharded(key):
                raise RuntimeError(f"{key} was not gathered for this group of steps; this is a bug (a collective "
                                   f"only some ranks would issue)")
        return full_tensor(self.state[key])

    @contextmanager
    def gathered(self, keys: list[str]) -> Iterator[None]:
        """Gather `keys` (each storage once, in this order, on every rank), serve them to `read`, free them on
        exit."""
        firsts = list(dict.fromkeys(self.first_name(key) for key in keys))
        self._whole = {key: full_tensor(self.state[key]) for key in firsts}
        try:
            yield
        finally:
            self._whole = None


def fill_local_shards(model: torch.nn.Module, plan: Plan, source: ModelSource, gates: dict[int, torch.Tensor],
                      seed: int, table: Optional[ParamTable] = None) -> None:
    """Write every planned tensor's part in this rank's shards of `model` (allocated, uninitialised; sharded or not).

    Args:
        table: `model`'s `param_table` (made here when not given): which parameter, and part of it, each step fills.

    Raises:
        RuntimeError: a local element was left unset or set twice (a bug: the plan and the model disagree).
        The first error of any rank, on every rank (`rank_failures.all_or_none`), when `model` is sharded.
    """
    table = table or param_table(model)
    params = dict(model.named_parameters())  # one name per parameter: a tied alias is filled as its first name
    sharded = any(_is_dtensor(p) for p in params.values())
    together = all_or_none if sharded else _alone  # an unsharded model is this process's own: no collective
    steps = [s for s in plan.steps if not table.is_alias(s.name)]  # a tied head's step: the embedding's values
    buffers = dict(model.named_buffers())
    _fill_buffers(model, plan, [s for s in steps if s.name in buffers], source, gates, seed)
    steps = [s for s in steps if s.name not in buffers]
    places = {step.name: table.from_hf(step.name) for step in steps}
    locals_ = {name: _local(p) for name, p in params.items()}
    boxes = {name: local_box(p) for name, p in params.items()}
    written: Counter = Counter()
    rank = world()[0]
    for layer, group in itertools.groupby(steps, key=lambda s: s.layer):
        group = list(group)
        direct = [s for s in group if _direct(s, places[s.name], source, params)]
        computed = [s for s in group if not any(s is d for d in direct)]
        keys = sorted({leaf.source[1] for s in computed for leaf in s.leaves()
                       if leaf.source is not None and source.is_sharded(leaf.source[1])})
        with source.gathered(keys), together("filling " + (f"layer {layer}" if layer is not None else
                                                           ", ".join(s.name for s in group))):
            for step in direct:
                target = places[step.name][0]
                raw = _local(source.state[step.source[1]])
                with torch.no_grad():
                    locals_[target].copy_(raw)
                line = nonfinite_line(locals_[target], raw, step.source[1], source)
                if line:  # the part this rank holds (a gathered tensor is checked whole by iter_tensors)
                    warnings.warn(UpcycleWarning(f"{line} (in rank {rank}'s shard)" if sharded else line),
                                  stacklevel=4)
                written[target] += locals_[target].numel()
            needed = [s for s in computed if _overlap(places[s.name], params, boxes) is not None]
            if needed:
                sub = dataclasses.replace(plan, steps=tuple(needed))
                for step, tensor in iter_tensors(sub, {source.ref: source}, gates, "share", seed):
                    if isinstance(tensor, TensorParts):
                        tensor = tensor.materialize()
                    target = places[step.name][0]
                    local_index, step_index = _overlap(places[step.name], params, boxes)
                    with torch.no_grad():
                        view = locals_[target][local_index]
                        view.copy_(tensor[step_index])
                    written[target] += view.numel()
    wrong = {n: (written[n], t.numel()) for n, t in locals_.items() if written[n] != t.numel()}
    with together("checking its shards"):  # else the other ranks would go on to train, and wait for this one
        if wrong:
            raise RuntimeError(f"upcycle set these local shards partly or twice (elements written, held): "
                               f"{wrong}; this is a bug: the plan and {type(model).__name__} disagree")


def _fill_buffers(model: torch.nn.Module, plan: Plan, steps: list[Step], source: ModelSource,
                  gates: dict[int, torch.Tensor], seed: int) -> None:
    """Planned buffers (GLM-4-MoE's fp32 ``e_score_correction_bias``): every rank holds them whole, as FSDP
    shards parameters only; they keep their own dtype."""
    if not steps:
        return
    buffers = dict(model.named_buffers())
    sub = dataclasses.replace(plan, steps=tuple(steps))
    for step, tensor in iter_tensors(sub, {source.ref: source}, gates, "share", seed):
        with torch.no_grad():
            buffers[step.name].copy_(tensor)


@contextmanager
def _alone(what: str) -> Iterator[None]:
    """`all_or_none` for a model no other rank shares: the block runs, its error is this process's alone."""
    yield


def _is_dtensor(value: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's part of `param` (FSDP's storage for a DTensor), outside autograd."""
    with torch.no_grad():
        return param.to_local() if hasattr(param, "to_local") else param.data


def local_box(param: torch.Tensor) -> Box:
    """This rank's box of `param` in global coordinates (the whole of a plain tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return tuple((0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(param.to_local().shape):
        raise RuntimeError(f"DTensor's local shape {tuple(shape)} differs from the local shard's "
                           f"{tuple(param.to_local().shape)} (placements {param.placements}); this is a bug")
    return tuple((o, o + n) for o, n in zip(offset, shape))


def _overlap(where: Place, params: dict[str, torch.Tensor], boxes: dict[str, Box]) -> Optional[tuple[tuple, tuple]]:
    """(index into the local shard, index into the step's tensor) of a step's box within this rank's box, or None.

    A step's index is None (the whole parameter), ``(e,)`` (expert e: that dimension is not in the step's tensor)
    or ``(e, slice)`` (expert e's gate or up half of a fused ``gate_up_proj``).
    """
    name, index = where
    local_index, step_index = [], []
    index = index or ()
    for dim, (start, stop) in enumerate(boxes[name]):
        i = index[dim] if dim < len(index) else slice(None)
        if isinstance(i, int):
            if not start <= i < stop:
                return None
            local_index.append(i - start)
            continue
        lo, hi, _ = i.indices(params[name].shape[dim])
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            return None
        local_index.append(slice(a - start, b - start))
        step_index.append(slice(a - lo, b - lo))
    return tuple(local_index), tuple(step_index)


def _direct(step: Step, where: Place, source: ModelSource, params: dict[str, torch.Tensor]) -> bool:
    """Whether `step` is a plain copy whose MoE parameter is sharded exactly like the dense tensor it copies."""
    from torch.distributed.tensor import DTensor

    if step.kind != "copy" or step.transforms or step.source is None or where[1] is not None:
        return False
    src, dst = source.state[step.source[1]], params[where[0]]
    if tuple(src.shape) != tuple(dst.shape) or isinstance(src, DTensor) != isinstance(dst, DTensor):
        return False
    return not isinstance(src, DTensor) or (src.device_mesh == dst.device_mesh and src.placements == dst.placements)

