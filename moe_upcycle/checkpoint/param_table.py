"""One table between a model's parameters and the tensors of its Hugging Face folder, ties as one entry.

`param_table(model)` reads the module tree once: every parameter *object* becomes one `ParamEntry` with all the
module paths it is registered under (``named_parameters(remove_duplicate=False)``, grouped by identity — a tied
head and its embedding are one entry, whatever the model's config says), its shape and dtype, and the tensors a
build writes for it (`HfTensor`: transformers 5's fused ``mlp.experts.gate_up_proj`` (E, 2I, H) is expert e's
``...experts.{e}.w1.weight`` / ``w3`` (Mixtral) or ``gate_proj`` / ``up_proj`` (Qwen-MoE); a fused router
``mlp.gate`` is Mixtral's ``block_sparse_moe.gate``; other parameters keep their names). `ParamTable.to_hf` lists
those tensors entry by entry, so a caller that gathers an entry once writes all of its tensors from it;
`ParamTable.from_hf` is its inverse (a tensor name to (parameter, index)), and also takes a tied alias
(``lm_head.weight``) to the one parameter. torchtitan's ``StateDictAdapter`` is the model: ``to_hf`` and
``from_hf`` are the two directions of one table.

Placement (`checkpoint.placement`), the fill (`distributed.local_fill`), the source's tied groups
(`in_memory.state_dict_source`) and the export (`distributed.dcp_export`) all derive from it. It reads no tensor
bytes and issues no collective; a DTensor's shape is its global shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from moe_upcycle.checkpoint import names

Index = Optional[tuple]  # into a parameter: None (all of it), (e,) or (e, slice) for one expert's projection


@dataclass(frozen=True)
class HfTensor:
    """One tensor of the Hugging Face folder: its name there, and which part of its parameter it is."""

    key: str
    index: Index
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ParamEntry:
    """One parameter object of the model.

    Attributes:
        names: every module path it is registered under; the first is the one ``named_parameters()`` gives, the
            others are tied aliases (``lm_head.weight`` of a tied head).
        shape, dtype: of the whole (global) parameter.
        hf: the folder's tensors made from it, in the order a build writes them.
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    hf: tuple[HfTensor, ...]

    @property
    def name(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class ParamTable:
    """Every parameter of a model as `ParamEntry` rows, in ``named_parameters()`` order."""

    entries: tuple[ParamEntry, ...]
    _by_name: dict[str, ParamEntry] = field(default_factory=dict, repr=False)
    _by_key: dict[str, tuple[ParamEntry, Index]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for entry in self.entries:
            for name in entry.names:
                self._by_name[name] = entry
            for tensor in entry.hf:
                self._by_key[tensor.key] = (entry, tensor.index)

    def entry(self, name: str) -> ParamEntry:
        """The entry of a parameter, by any of its module paths (KeyError if none)."""
        return self._by_name[name]

    @property
    def ties(self) -> list[list[str]]:
        """The module paths of each parameter registered under more than one (a tied head and its embedding)."""
        return [list(e.names) for e in self.entries if len(e.names) > 1]

    def is_alias(self, name: str) -> bool:
        """Whether `name` is a tied second name of a parameter (filled, gathered and saved as its first)."""
        entry = self._by_name.get(name)
        return entry is not None and entry.name != name

    def tie(self, model: torch.nn.Module) -> None:
        """Register each entry's parameter (under its first name) under all its names again: ``to_empty`` gives a
        tied parameter that FSDP does not manage a new tensor under each name, untying it."""
        for entry in self.entries:
            if len(entry.names) < 2:
                continue
            param = model.get_parameter(entry.name)
            for alias in entry.names[1:]:
                owner, _, leaf = alias.rpartition(".")
                module = model.get_submodule(owner)
                if module._parameters.get(leaf) is not param:
                    module._parameters[leaf] = param

    def to_hf(self) -> Iterator[tuple[ParamEntry, HfTensor]]:
        """Every tensor of the folder with its entry, entry by entry (a tied head right after its embedding)."""
        for entry in self.entries:
            for tensor in entry.hf:
                yield entry, tensor

    def from_hf(self, key: str) -> tuple[str, Index]:
        """(parameter name, index into it) of a folder tensor name, or of a tied alias; the inverse of `to_hf`.

        Raises:
            RuntimeError: `key` has no parameter in the model (a bug: a plan and the model class disagree).
        """
        if key in self._by_key:
            entry, index = self._by_key[key]
            return entry.name, index
        if key in self._by_name:  # a tied alias the folder does not write (e.g. lm_head.weight of a tied Mixtral)
            return self._by_name[key].name, None
        raise RuntimeError(f"tensor {key} has no parameter in the model; this is a bug")


def param_table(model: torch.nn.Module, written_aliases: Iterable[str] = ()) -> ParamTable:
    """The table of `model`'s parameters (read from its module tree; no tensor is read).

    Args:
        model: any ``torch.nn.Module`` (a transformers model; sharded or not, on any device, meta included).
        written_aliases: tied second names the folder writes too (``lm_head.weight``, which llama.cpp's
            Qwen2-MoE needs): their tensor follows the first name's.

    Returns:
        The `ParamTable`.

    Example:
        >>> lin = torch.nn.Linear(2, 3, bias=False)
        >>> pair = torch.nn.ModuleDict({"a": lin, "b": torch.nn.Linear(2, 3, bias=False)})
        >>> pair["b"].weight = lin.weight  # tied: one entry
        >>> [e.names for e in param_table(pair).entries]
        [('a.weight', 'b.weight')]
    """
    layout = names.OUTPUT_LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None))
    written = set(written_aliases)
    grouped: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        grouped.setdefault(id(param), []).append(name)
        params[id(param)] = param
    entries = []
    for key, paths in grouped.items():  # dicts keep insertion order: the first name is named_parameters()'s
        param = params[key]
        shape = tuple(param.shape)
        hf = list(_hf_tensors(paths[0], shape, layout))
        hf += [HfTensor(alias, None, shape) for alias in paths[1:] if alias in written]
        entries.append(ParamEntry(tuple(paths), shape, param.dtype, tuple(hf)))
    return ParamTable(tuple(entries))


# module path suffix -> the checkpoint's name for it, where transformers 5 renames as it loads (Granite-MoE's
# JetMoE tensors, ERNIE-4.5-MoE's moe_statics); every loader of those checkpoints reads the right-hand names
MODULE_TO_HF = ((".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
                (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
                (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"),
                (".mlp.gate.moe_statics.e_score_correction_bias", ".mlp.moe_statics.e_score_correction_bias"))


def hf_name(name: str) -> str:
    """A parameter's module path as its checkpoint names it (`MODULE_TO_HF`; most names are the same)."""
    for module, hf in MODULE_TO_HF:
        if name.endswith(module):
            return name[:-len(module)] + hf
    return name


def _hf_tensors(name: str, shape: tuple[int, ...], layout: Optional[names.OutputLayout]) -> Iterator[HfTensor]:
    """The folder tensors of one parameter: a fused expert parameter gives one per (projection, expert), in the
    dense order (gate, up, down) as a build writes them — unless the architecture is read fused only (Qwen3.5-MoE,
    Granite-MoE), whose folder holds the fused tensor itself."""
    name = hf_name(name)
    template, layer = names.split_layer(name)
    projs = layout.fused_expert.get(template) if layout and not layout.fused_only else None
    if projs:  # (E, len(projs) * I, H) or (E, H, I): expert e's projections, one after the other on dim 1
        rows = shape[1] // len(projs)
        for i, proj in enumerate(projs):
            for e in range(shape[0]):
                index = (e, slice(i * rows, (i + 1) * rows)) if len(projs) > 1 else (e,)
                part = (rows, *shape[2:]) if len(projs) > 1 else shape[1:]
                yield HfTensor(names.fill(layout.expert[proj], layer=layer, expert=e), index, part)
    elif layout and layer is not None and template == layout.fused_router:
        yield HfTensor(names.fill(layout.router, layer=layer), None, shape)
    else:
        yield HfTensor(name, None, shape)
