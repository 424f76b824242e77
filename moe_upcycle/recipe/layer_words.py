"""How every report says which layers are MoE layers (``moe_layers:``): one wording for the plan, its notes,
the model card and verify.

- `layers_said`: ``layer 3`` / ``layers 1, 3`` / ``no layer``;
- `moe_layers_said`: ``layers 1, 3 of 4`` or ``all 4 layers`` (a table cell, a message);
- `moe_layers_row`: the same with the dense ones: ``layers 1, 3 of 4 (dense MLP in 0, 2)``;
- `moe_and_dense_said`: a sentence's worth: ``MoE in layers 1, 3 of 4; layers 0, 2 keep the dense MLP``.

It only words layer numbers it is given; which layers are chosen is `params.MoeLayers`' job.
"""

from __future__ import annotations

from collections.abc import Sequence


def layers_said(layers: Sequence[int]) -> str:
    """``layer 3``, ``layers 1, 3`` or ``no layer``.

    Example:
        >>> layers_said([3]), layers_said([1, 3]), layers_said([])
        ('layer 3', 'layers 1, 3', 'no layer')
    """
    if not layers:
        return "no layer"
    return f"layer{'s' if len(layers) != 1 else ''} {', '.join(map(str, layers))}"


def moe_layers_said(moe: Sequence[int], num_layers: int) -> str:
    """Where the experts are: ``layers 1, 3 of 4``, or ``all 4 layers`` when every layer is an MoE layer.

    Example:
        >>> moe_layers_said([1, 3], 4), moe_layers_said([2], 4), moe_layers_said([0, 1], 2)
        ('layers 1, 3 of 4', 'layer 2 of 4', 'all 2 layers')
    """
    if len(moe) == num_layers:
        return f"all {num_layers} layers"
    return f"{layers_said(moe)} of {num_layers}"


def _dense(moe: Sequence[int], num_layers: int) -> list[int]:
    chosen = set(moe)
    return [i for i in range(num_layers) if i not in chosen]


def moe_layers_row(moe: Sequence[int], num_layers: int) -> str:
    """A report's "MoE layers" cell: ``layers 1, 3 of 4 (dense MLP in 0, 2)``, or ``all 4 layers``.

    Example:
        >>> moe_layers_row([1, 3], 4)
        'layers 1, 3 of 4 (dense MLP in 0, 2)'
    """
    dense = _dense(moe, num_layers)
    return moe_layers_said(moe, num_layers) + (f" (dense MLP in {', '.join(map(str, dense))})" if dense else "")


def moe_and_dense_said(moe: Sequence[int], num_layers: int) -> str:
    """Where the experts are and which layers keep the dense MLP, for a note or the model card.

    Example:
        >>> moe_and_dense_said([1, 3], 4), moe_and_dense_said([0, 1, 3], 4)
        ('MoE in layers 1, 3 of 4; layers 0, 2 keep the dense MLP', 'MoE in layers 0, 1, 3 of 4; layer 2 keeps the dense MLP')
    """
    dense = _dense(moe, num_layers)
    if not dense:
        return f"MoE in all {num_layers} layers"
    return (f"MoE in {moe_layers_said(moe, num_layers)}; {layers_said(dense)} keep{'s' if len(dense) == 1 else ''} "
            f"the dense MLP")
