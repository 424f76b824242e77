"""Which router keys each gate mode reads, and the refusal of a key set where it would do nothing.

`gate_center`, `gate_scale`, `router_init_std` and `calibration_text` shape the router rows of some
gate modes only, and ``gate_source: mergekit`` (``build --mergekit``) reproduces mergekit-moe
0.1.5's computation exactly, which has no centring and draws its random rows with std 1.0. A key
given a value those modes would ignore used to build the same bytes as without it (``gate_center:
true`` with ``--mergekit``: identical shards), so the user believed in routers they did not get.
`unread_gate_keys` names each such key with the modes that read it and what to write instead.
Applying the key in mergekit mode is not offered: that mode's promise is mergekit-moe's rows.

It reads the validated recipe's values only (a key written with its default value does nothing
either way and passes).
"""

from __future__ import annotations

from typing import Any

# key -> {gate_source: the gate modes that read it}
READERS: dict[str, dict[str, tuple[str, ...]]] = {
    "gate_center": {"native": ("hidden", "hidden_avg", "hidden_last", "kmeans", "cheap_embed"), "mergekit": ()},
    "gate_scale": {"native": ("hidden", "hidden_avg", "hidden_last", "kmeans", "cheap_embed"),
                   "mergekit": ("hidden", "hidden_avg", "hidden_last", "cheap_embed")},
    "router_init_std": {"native": ("random",), "mergekit": ()},
    "calibration_text": {"native": ("kmeans",), "mergekit": ()},
}
# the value of each key that changes nothing (its default)
INERT = {"gate_center": False, "gate_scale": None, "router_init_std": 0.02, "calibration_text": None}
MERGEKIT_WHY = {
    "gate_center": "mergekit-moe does not centre its rows",
    "gate_scale": "mergekit-moe's random rows are not rescaled",
    "router_init_std": "mergekit-moe draws its random rows with std 1.0",
    "calibration_text": "mergekit-moe has no k-means routers",
}


def unread_gate_keys(config: Any) -> list[str]:
    """A problem per router key given a value that the recipe's gate mode and source would not read.

    Args:
        config: the validated recipe (``gate_mode``, ``gate_source`` and the keys of `READERS`).

    Example:
        >>> from types import SimpleNamespace as Recipe
        >>> unread_gate_keys(Recipe(gate_mode="hidden", gate_source="mergekit", gate_center=True, gate_scale=None,
        ...                         router_init_std=0.02, calibration_text=None))[0][:60]
        'gate_center: true is not read with gate_source: mergekit (bu'
    """
    out = []
    for key, readers in READERS.items():
        value = getattr(config, key)
        if value == INERT[key] or config.gate_mode in readers[config.gate_source]:
            continue
        shown = "true" if value is True else repr(value) if isinstance(value, str) else f"{value:g}"
        native = readers["native"]
        if config.gate_source == "mergekit":
            instead = (f"remove it, or build with gate_source: native (without --mergekit), which "
                       f"{'reads it with gate_mode ' + config.gate_mode if config.gate_mode in native else 'has it for ' + _modes(native)}")
            out.append(f"{key}: {shown} is not read with gate_source: mergekit (build --mergekit), which computes "
                       f"mergekit-moe 0.1.5's router rows exactly, and {MERGEKIT_WHY[key]}; the rows would be built "
                       f"as if it were not there — {instead}")
        else:
            out.append(f"{key}: {shown} is read by gate_mode {_modes(native)} only, so gate_mode "
                       f"{config.gate_mode} would build the same routers without it; remove it, or use "
                       f"{'that mode' if len(native) == 1 else 'one of those modes'}")
    return out


def _modes(modes: tuple[str, ...]) -> str:
    return modes[0] if len(modes) == 1 else ", ".join(modes[:-1]) + " or " + modes[-1]
