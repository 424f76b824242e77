"""Where the tensors of an in-memory MoE live: on the dense model's device(s), module by module.

`upcycle_model` takes a dense model that may already sit on a GPU, or be spread over several
devices by accelerate's ``device_map``. `DensePlacement` records, for every module of the dense
model, the device of its parameters; an MoE parameter goes where the dense module it comes from
was (``model.layers.3.mlp.experts.down_proj`` → the device of ``model.layers.3.mlp``), so a
spread model stays spread the same way and no layer changes device. `dispatch_like` then gives
the MoE the dense model's accelerate hooks (activations moved between devices), from the same
``hf_device_map``.

The MoE is made on the meta device; `allocate` gives each `param_table` entry (a tied head and its embedding are
one) uninitialised storage where it belongs, and `init_buffers` then computes the buffers (rotary ``inv_freq``) on
their device — torchtitan's order: storage first, then values where they live, never CPU buffers left beside GPU
parameters. A sharded MoE is allocated by ``to_empty`` instead (`distributed.sharded_model`) and gets its buffers
the same way.

It does not move the dense model, and it refuses dense models whose weights are offloaded
(parameters on the ``meta`` device): their bytes are not in the model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from moe_upcycle.checkpoint.param_table import ParamTable
from moe_upcycle.errors import ConfigError


@dataclass(frozen=True)
class DensePlacement:
    """The dense model's devices.

    Attributes:
        main: where most parameters are (the embeddings' device on a spread model); routers
            are drawn here.
        modules: module name (every prefix of a parameter name, ``""`` for the root) → device.
        device_map: the dense model's accelerate ``hf_device_map`` when it spans several devices.
    """

    main: torch.device
    modules: dict[str, torch.device]
    device_map: Optional[dict[str, object]] = None

    def device_for(self, name: str) -> torch.device:
        """Device of an MoE parameter or buffer: that of its longest module prefix in the dense model."""
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            device = self.modules.get(".".join(parts[:cut]))
            if device is not None:
                return device
        return self.main


def dense_placement(model: torch.nn.Module) -> DensePlacement:
    """Record where each module of `model` keeps its parameters.

    Raises:
        ConfigError: a parameter is on the ``meta`` device (offloaded by accelerate or never loaded).
    """
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ConfigError(f"dense_model: {len(meta)} parameter(s) are on the meta device (e.g. {meta[0]}), offloaded "
                          f"or not loaded, so their weights are not in memory; load the model onto devices without "
                          f"offloading (no 'disk' or CPU offload in device_map) before upcycle_model")
    modules: dict[str, torch.device] = {}
    counts: Counter = Counter()
    for name, param in model.named_parameters():
        counts[param.device] += param.numel()
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            # the finest module wins; a coarse prefix keeps the device of its first parameter
            modules.setdefault(".".join(parts[:cut]), param.device)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    main = embed.weight.device if embed is not None else counts.most_common(1)[0][0]
    device_map = getattr(model, "hf_device_map", None)
    spread = device_map if device_map and len(set(map(str, device_map.values()))) > 1 else None
    return DensePlacement(main, modules, spread)


def allocate(model: torch.nn.Module, table: ParamTable, device_for: Callable[[str], torch.device]) -> None:
    """Give every parameter of `model` new, uninitialised storage on ``device_for(name)``, one per table entry.

    A tied parameter gets one ``Parameter`` registered under all its names, as the model tied it.
    """
    for entry in table.entries:
        data = torch.empty(entry.shape, dtype=entry.dtype, device=device_for(entry.name))
        param = torch.nn.Parameter(data)
        for name in entry.names:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)


def init_buffers(model: torch.nn.Module, device_for: Callable[[str], torch.device],
                 made: Optional[dict[str, torch.Tensor]] = None) -> None:
    """Compute every buffer of `model` again, on ``device_for(name)``.

    A rotary embedding's ``inv_freq`` (and ``original_inv_freq``) is computed by the module's own rope function
    with the device given, as the module's constructor computed it on the CPU. Any other buffer takes its values
    from `made` (the buffers as the model was constructed, before ``to_empty`` replaced them), else from itself,
    moved to its device.
    """
    made = made if made is not None else dict(model.named_buffers())
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        owned = [leaf for leaf, buf in module._buffers.items() if buf is not None]
        if not owned:
            continue
        device = device_for(prefix + owned[0])
        inv_freq = _rope_inv_freq(module, device)
        for leaf in owned:
            if inv_freq is not None and leaf in ("inv_freq", "original_inv_freq"):
                value = inv_freq.clone() if leaf == "original_inv_freq" else inv_freq
            else:
                value = made.get(prefix + leaf, module._buffers[leaf]).to(device, copy=True)
            module._buffers[leaf] = value
        if inv_freq is not None and "original_inv_freq" not in owned and hasattr(module, "original_inv_freq"):
            module.original_inv_freq = module.inv_freq  # transformers 4.x keeps it as an attribute, not a buffer


def _rope_inv_freq(module: torch.nn.Module, device: torch.device) -> Optional[torch.Tensor]:
    """A rotary embedding module's inverse frequencies computed on `device`, or None for any other module."""
    config, rope_type = getattr(module, "config", None), getattr(module, "rope_type", None)
    if config is None or rope_type is None or "inv_freq" not in module._buffers:
        return None
    compute = getattr(module, "rope_init_fn", None)  # transformers 4.x keeps the module's function
    if compute is None:  # transformers 5: the module's own default, or the library's for other rope types
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        own = getattr(module, "compute_default_rope_parameters", None) if rope_type == "default" else None
        compute = own or ROPE_INIT_FUNCTIONS.get(rope_type)
    if compute is None:
        return None
    with torch.device(device):  # tensors the function makes without a device are made there too
        inv_freq, _ = compute(config, device=device)
    return inv_freq


def dispatch_like(model: torch.nn.Module, placement: DensePlacement) -> torch.nn.Module:
    """Give a spread MoE accelerate's hooks for the dense model's ``hf_device_map`` (no-op on one device).

    Weights are already in place, so nothing is offloaded: ``main_device="cpu"`` keeps CPU entries
    of the map executing on the CPU, as they did in the dense model.
    """
    if placement.device_map is None:
        return model
    from accelerate import dispatch_model

    modules = dict(model.named_modules())
    device_map = {}
    for key, device in placement.device_map.items():
        while key and key not in modules:  # a finer dense module than the MoE has (e.g. mlp.gate_proj)
            key = key.rpartition(".")[0]
        device_map.setdefault(key, device)
    main = "cpu" if "cpu" in map(str, device_map.values()) else placement.main
    return dispatch_model(model, device_map=device_map, main_device=main)
