"""Checks on computed router weights: experts whose gate vectors are nearly parallel.

Two experts whose rows point the same way in a layer get the same scores there, so the router
cannot tell them apart ("your prompts for `coder` and `math` are too similar"). This module only
inspects the gates; it changes nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

PARALLEL_COSINE = 0.95
# what a user can do about experts whose prompts give parallel rows, by gate_center in the mode in use
PROMPT_ADVICE = {
    False: "make them more distinct, add negative_prompts, or set gate_center: true",
    True: "make them more distinct or add negative_prompts (gate_center is on already)",
    None: ("make them more distinct or add negative_prompts (mergekit-moe's rows, which gate_source: mergekit "
           "reproduces, have no centring; gate_source: native with gate_center: true removes what all prompts share)"),
}


def layer_ranges(layers: list[int]) -> str:
    """Compact layer list.

    Example:
        >>> layer_ranges([0, 1, 2, 5, 7, 8])
        '0-2, 5, 7-8'
    """
    parts, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            parts.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(parts)


def parallel_experts(gates: dict[int, torch.Tensor], expert_names: list[str] | tuple[str, ...],
                     threshold: float = PARALLEL_COSINE, group_size: int = 1, from_prompts: bool = True,
                     center: Optional[bool] = False) -> list[str]:
    """Warnings naming each expert pair and the layers where their gate rows have cosine > `threshold`.

    Args:
        gates: layer -> (num_experts, hidden) router weights.
        expert_names: name of each expert row.
        threshold: cosine above which two rows count as nearly parallel.
        group_size: G of ``expert_init: split``: the rows of a virtual group are tied on purpose (that keeps
            the split exact), so pairs within a group are not reported.
        from_prompts: the rows come from the experts' prompts (the advice is about them).
        center: ``gate_center`` as the mode in use has it: False (off, and advised), True (on already), None
            (the mode has no centring: ``gate_source: mergekit``, whose advice stays within mergekit-moe's own
            means and names the native mode that centres).

    Returns:
        One message per offending pair (empty when routing can tell every pair apart).
    """
    hits: dict[tuple[int, int], list[tuple[int, float]]] = {}
    # all-zero gates (gate_mode: uniform) route uniformly by design: not checked
    layers = [layer for layer in sorted(gates) if bool(gates[layer].any())]
    if layers:
        # one batched product and one read-back: a tensor op per layer or pair is slow (each can
        # wait on busy intra-op threads while a build's writer and hasher hold the cores)
        rows = torch.nn.functional.normalize(torch.stack([gates[layer].float() for layer in layers]), dim=-1)
        for layer, cos in zip(layers, (rows @ rows.transpose(1, 2)).tolist()):
            for a, row in enumerate(cos):
                for b in range(a + 1, len(row)):
                    if row[b] > threshold and a // group_size != b // group_size:
                        hits.setdefault((a, b), []).append((layer, row[b]))
    out = []
    for (a, b), found in hits.items():
        layers = [layer for layer, _ in found]
        worst = max(c for _, c in found)
        why = (f"your prompts for `{expert_names[a]}` and `{expert_names[b]}` are too similar for the router to tell "
               f"apart; {PROMPT_ADVICE[center]}" if from_prompts else "the router cannot tell them apart")
        out.append(f"routing: gate vectors of experts `{expert_names[a]}` and `{expert_names[b]}` are nearly "
                   f"parallel (cosine > {threshold}, up to {worst:.3f}) in layer(s) {layer_ranges(layers)}: {why}")
    return out
