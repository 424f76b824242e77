"""Import the command line's libraries without the cyclic garbage collector, then keep their objects out of it.

``import torch`` makes about a million Python objects that live as long as the process. While they
are being made, the collector runs a full pass over everything made so far each time the heap has
grown by a quarter, and after torch every later import (pydantic models, typer, our own modules)
sets off more full passes over torch's objects: on the 2-core CI box they cost 0.3-0.5 s of the
command line's 1.5-2 s of start-up CPU. None of those objects is garbage, so the collector is
paused while the command line starts (`pause`) and, once torch is in, the objects made so far are
frozen (``gc.freeze``: later passes skip them) and the collector runs again (`resume`).

What it does not do: it never frees or keeps anything itself. Cyclic garbage made during start-up
(a few kilobytes of import machinery) stays frozen for the life of the process. A library caller's
process is its own business: only ``moe-upcycle``/``python -m moe_upcycle`` calls these.
"""

from __future__ import annotations

import gc

_PAUSED = {"on": False}


def pause() -> None:
    """Stop the cyclic collector for the start-up's imports (the command line's first step)."""
    if gc.isenabled():
        gc.disable()
        _PAUSED["on"] = True


def resume() -> None:
    """Freeze what start-up made and restart the collector, if `pause` stopped it (else nothing)."""
    if _PAUSED["on"]:
        _PAUSED["on"] = False
        gc.freeze()
        gc.enable()
