"""Human-readable summaries of a plan: the duplicate-tensor (sharing) report.

Replaces mergekit's cryptic "tensors share memory" warning with one summary that says which
slots share which source tensors, what sharing saves, and how the files are written.
"""

from __future__ import annotations

from moe_upcycle.checkpoint.disk_space import human_bytes  # noqa: F401  (re-exported)
from moe_upcycle.planning.steps import Plan
from moe_upcycle.checkpoint.source import Checkpoint


def sharing_report(plan: Plan, sources: dict[str, Checkpoint], policy: str) -> list[str]:
    """Lines describing shared tensors in the plan and in the inputs.

    Returns:
        Lines for the console (empty when nothing is shared).
    """
    lines: list[str] = []
    shared, modified = _slot_groups(plan, sources)
    if shared:
        n_slots = sum(len(g) for g in shared.values())
        saved = sum((len(g) - 1) * g[0].nbytes for g in shared.values())
        example_src, example = next(iter(shared.items()))
        verb = "share one storage each" if policy == "share" else "are cloned (tensor_policy: clone)"
        lines.append(
            f"Duplicate tensors: {n_slots} expert slots are fed by {len(shared)} source tensors and {verb}; "
            f"e.g. {example_src[1]} of {_shown_ref(sources, example[0].source)} -> "
            f"{', '.join(s.name for s in example[:2])}"
            + (f" and {len(example) - 2} more" if len(example) > 2 else "") + "."
        )
        if policy == "share":
            lines.append(f"  Sharing saves {human_bytes(saved)} of copies in memory. On disk every slot is still "
                         f"written as its own tensor (safetensors has no aliasing). Use --clone-tensors "
                         f"(tensor_policy: clone) to give every slot its own copy.")
        else:
            lines.append(f"  Cloning costs {human_bytes(saved)} of extra copies in memory (transiently, one "
                         f"tensor at a time). Use --share-tensors (tensor_policy: share) to share them.")
    if modified:
        lines.append(f"  {len(modified)} expert slots are modified (expert_init, noise_scale, residual_scale) and always get their own copy.")
    for ref, ckpt in sources.items():
        for group in ckpt.shared_groups:
            lines.append(f"Input {ref}: tensors {', '.join(group)} share one storage (tied or repeated weights); "
                         f"each output tensor is written from it explicitly.")
    return lines


def sharing_summary(plan: Plan, sources: dict[str, Checkpoint], policy: str) -> str:
    """The sharing report in one line without paths, for `build` (``plan`` and ``build -v`` print `sharing_report`).

    Returns:
        The line, or "" when there is nothing to say; e.g. for 4 copies of a 2-layer model:
        ``24 expert slots share 6 source tensors in memory, saving 589.8 KB (-v: more)``.
    """
    shared, modified = _slot_groups(plan, sources)
    parts = []
    if shared:
        n_slots, saved = sum(map(len, shared.values())), sum((len(g) - 1) * g[0].nbytes for g in shared.values())
        if policy == "share":
            parts.append(f"{n_slots} expert slots share {len(shared)} source tensors in memory, saving "
                         f"{human_bytes(saved)}")
        else:
            parts.append(f"{n_slots} expert slots are cloned from {len(shared)} source tensors")
    if modified:
        parts.append(f"{len(modified)} modified slots have their own copy")
    tied = sum(len(ckpt.shared_groups) for ckpt in sources.values())
    if tied:
        parts.append(f"{tied} tied group(s) of input tensors are written explicitly")
    return f"{'; '.join(parts)} (-v: more)" if parts else ""


def _slot_groups(plan: Plan, sources: dict[str, Checkpoint]) -> tuple[dict[tuple, list], list]:
    """({source tensor: the unmodified expert slots it feeds, when more than one}, the modified slots)."""
    slots = [s for s in plan.leaf_steps() if s.kind == "expert"]
    groups: dict[tuple, list] = {}
    for s in slots:  # by the bytes read (`Checkpoint.identity`): a LoRA-adapted tensor is its own
        if not s.transforms:
            groups.setdefault(sources[s.source[0]].identity(s.source[1]) if s.source[0] in sources else s.source,
                              []).append(s)
    return {src: g for src, g in groups.items() if len(g) > 1}, [s for s in slots if s.transforms]


def _shown_ref(sources: dict[str, Checkpoint], source: tuple[str, str]) -> str:
    """The reference a shared tensor is read from, as the recipe spells it: the model's own (not ``X+ADAPTER``) for
    a tensor the adapter leaves alone."""
    ckpt = sources.get(source[0])
    if ckpt is not None and ckpt.adapter is not None and not ckpt.adapter.changes(source[1]):
        return ckpt.model_ref or ckpt.ref
    return source[0]
