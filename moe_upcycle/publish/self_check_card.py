"""The model card's "Routing self-check" section: how many of its own prompts each expert's router wins.

Renders a `gates.self_check.SelfCheck` as markdown lines for `card.model_card`; computes nothing.
"""

from __future__ import annotations

from typing import Optional

from moe_upcycle.gates.self_check import SelfCheck


def self_check_lines(check: Optional[SelfCheck]) -> Optional[list[str]]:
    """Markdown lines, or None when the build made no self-check (gates not from the prompts' router inputs)."""
    if check is None:
        return None
    how = ("each real token's top-1 expert in every MoE layer, the prompt going to the expert most of them pick"
           if check.per_token else "each prompt's mean router input's top-1 expert in every MoE layer, the prompt "
           "going to the expert most layers pick")
    lines = [f"The build routed every expert's own positive prompts through the routers it made, on the base "
             f"model's router inputs ({how}, as `moe-upcycle route --labeled` counts):", ""]
    lines += [f"- {line}" for line in check.lines()]
    starved = check.warnings()
    if starved:
        lines += ["", *[f"> **Warning:** {w.removeprefix('routing self-check: ')}" for w in starved]]
    return lines
