"""Where the base model runs: a device name as the user gave it (``auto``, ``cpu``, ``cuda``, ``cuda:N``) checked
against the GPUs torch sees.

The gates (`stream.open_streamed`), ``verify`` and ``route`` take their device from here, so a missing GPU is said
the same way everywhere, before any file is read. It picks nothing but the device: the dtype is the caller's.
"""

from __future__ import annotations

import torch

from moe_upcycle.errors import ConfigError, DependencyError
from moe_upcycle.recipe.values import device_problem


def resolve_device(device: str, where: str = "device:") -> str:
    """``auto`` → ``cuda`` when a GPU is present, else ``cpu``; checks a requested GPU exists. `where` is how
    the user gave it, for messages (the recipe's ``device:``, a command's ``--device``).

    Example:
        >>> resolve_device("cpu")
        'cpu'

    Raises:
        ConfigError: not a device name (``gpu``, ``cuda:x``).
        DependencyError: CUDA requested but not available, or GPU index out of range.
    """
    if device_problem(device):
        raise ConfigError(f"{where} {device_problem(device)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DependencyError(f"{where} {device!r} asks for a GPU but torch sees no CUDA device; "
                                  f"use {where} cpu (or auto)")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise DependencyError(f"{where} {device!r} but only {torch.cuda.device_count()} GPU(s) are visible; "
                                  f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device
