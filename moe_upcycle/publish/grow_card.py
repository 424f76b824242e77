"""The parts of the model card that differ for a grown MoE (`planning.grow`): title, experts table, how they were made.

A grown model's experts are not copies of one dense FFN and its router is (mostly) the base's own, so the
sentences `card_facts.making_of` writes for an upcycled model would be wrong here. `card.model_card` asks
this module for these parts when the plan grows an MoE; everything else in the card is shared.
"""

from __future__ import annotations

from typing import Callable

from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.schema import UpcycleConfig


def title(plan: Plan, base_name: str) -> str:
    """The card's heading."""
    return f"{plan.architecture} MoE grown from {base_name}"


def router_words(plan: Plan) -> str:
    """How the router was made, for the card's first lines (where an upcycled model names its gate mode)."""
    return "the base's routers" if plan.grow.router == "base routers" else f"gate mode `{plan.grow.router}`"


def expert_rows(config: UpcycleConfig, plan: Plan, name_of: Callable[[str], str], cell: Callable[[str], str]) -> str:
    """The experts table's rows: each output expert, where it comes from, what was done to it."""
    info = plan.grow
    e_count = info.base.num_experts
    changed = {leaf.expert for leaf in plan.leaf_steps() if leaf.kind == "expert" and leaf.transforms}
    rows = []
    for j, name in enumerate(plan.expert_names):
        if j < e_count * info.copies:
            source = f"{name_of(info.base_ref)}, expert {j % e_count}"
            prompts = 0
            what = "the base's, byte for byte" if j < e_count else f"copy of expert {j % e_count}"
        else:
            expert = config.experts[j - e_count * info.copies]
            source, prompts, what = name_of(expert.source_model), len(expert.positive_prompts), "added dense expert"
        if j in changed:
            what += f", init {config.expert_init.method if j < e_count * info.copies else 'changed'}"
        rows.append(f"| {j} | {cell(name)} | {cell(source)} | {prompts} | {cell(what)} |")
    return "\n".join(rows)


def making_of(plan: Plan) -> list[str]:
    """How the experts and the router were made, one bullet each."""
    info = plan.grow
    base = info.base
    e_count, m = base.num_experts, info.copies
    lines = [f"- Grown from an MoE with {e_count} experts, {base.experts_per_token} active per token: its experts, "
             f"router rows, attention, norms, embeddings"
             + (", shared expert" if base.shared_expert else "")
             + (", dense layers" if base.dense_layers else "") + " are kept byte for byte."]
    if m > 1:
        lines.append(f"- Each expert is copied {m} times with its router row: expert j is the base's expert j mod "
                     f"{e_count}.")
    if info.added:
        lines.append(f"- {len(info.added)} expert(s) added from dense fine-tunes of the base's dense model; each one's "
                     f"router row comes from its prompts on the MoE base's own router inputs, scaled to the mean "
                     f"norm of the base's rows.")
    if info.router != "base routers":
        lines.append(f"- Router: every row replaced (gate mode `{info.router}`).")
    if info.exact:
        lines.append(f"- With {plan.experts_per_token} experts per token ({m} × {base.experts_per_token}) the grown "
                     f"model computes what the base computes, until it is trained.")
    else:
        lines += [f"- Not the base's function: {c}" for c in plan.inexact]
    return lines
