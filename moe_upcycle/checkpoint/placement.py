"""Where the tensors of an in-memory MoE live: on the dense model's device(s), module by module.

`upcycle_model` takes a dense model that may already sit on a GPU, or be spread over several
devices by accelerate's ``device_map``. `DensePlacement` records, for every module of the dense
model, the device of its parameters; an MoE parameter goes where the dense module it comes from
was (``model.layers.3.mlp.experts.down_proj`` → the device of ``model.layers.3.mlp``), so a
spread model stays spread the same way and no layer changes device. `dispatch_like` then gives
the MoE the dense model's accelerate hooks (activations moved between devices), from the same
``hf_device_map``.

It does not move the dense model, and it refuses dense models whose weights are offloaded
(parameters on the ``meta`` device): their bytes are not in the model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

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


def move_buffers(model: torch.nn.Module, placement: DensePlacement) -> None:
    """Put every buffer (rotary ``inv_freq``...) on the device of its module in the dense model."""
    for name, buf in list(model.named_buffers()):
        device = placement.device_for(name)
        if buf.device != device:
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module._buffers[leaf] = buf.to(device)


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
