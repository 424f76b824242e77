"""``--help`` shows boolean flags as flags: ``--force``, not ``--force <bool>``.

Typer (0.2x with rich help) prints a type column for every option, so a flag that takes no value
reads as if it wanted one (``--verify <bool>``). Importing this module makes the type column of
flags (``--x``, ``--x/--no-x``, ``--help``) empty; options that take a value keep their type. It
changes help text only, never parsing.
"""

from __future__ import annotations

import functools

from typer import core


def _flags_without_type(display_type_rich):
    @functools.wraps(display_type_rich)
    def display(self, ctx):
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return display_type_rich(self, ctx)

    return display


if hasattr(core, "TyperOption") and hasattr(core.TyperOption, "display_type_rich") \
        and not getattr(core.TyperOption.display_type_rich, "_flags_without_type", False):
    core.TyperOption.display_type_rich = _flags_without_type(core.TyperOption.display_type_rich)
    core.TyperOption.display_type_rich._flags_without_type = True
