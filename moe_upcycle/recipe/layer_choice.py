"""The recipe's ``moe_layers:`` value: which decoder layers become MoE layers, as the user wrote it.

Two spellings, and nothing else:

- a list of layer indices, ``moe_layers: [1, 3, 5]`` (0-based, each once, any order);
- every k-th layer, ``moe_layers: {every: 2}`` — layers k-1, 2k-1, 3k-1, ... (1, 3, 5, ... for
  k = 2: every *second* layer, the last layer included when k divides the depth; what Qwen's
  ``decoder_sparse_step: k`` means), or ``{every: 2, start: 0}`` — layers start, start+k, ...
  (0, 2, 4, ...: Megatron-Core's ``--moe-layer-freq 2``).

Left out (or null), every layer is an MoE layer. `check_value` refuses every other shape
(text, a lone number, booleans, an empty list, repeats, negative indices) with what to write
instead; which indices exist is known only with the base model (`params.MoeLayers.problems`).
It reads no checkpoint.
"""

from __future__ import annotations

import math
import numbers
import re
from collections import Counter
from typing import Annotated, Any, Optional, Union

from pydantic import Discriminator, Field, Tag

from moe_upcycle.recipe.strict_model import StrictModel
from moe_upcycle.recipe.values import not_whole, short_repr

EXAMPLES = "a list of layer indices such as [1, 3, 5], or {every: 2} for every second layer (1, 3, 5, ...)"
ALL_LAYERS = "leave moe_layers out for every layer (the default)"
WHOLE = re.compile(r"\s*\d+\s*")  # a whole number in quotes: read as the number, as pydantic reads num_experts: "4"


class LayerEvery(StrictModel):
    """``moe_layers: {every: k, start: s}``: layers s, s+k, s+2k, ... (s defaults to k - 1).

    On the recipe's strict base, so ``every: "2"``, ``every: 2.5`` or ``every: yes`` are read and worded as
    ``num_experts: "4"``, ``2.5`` or ``yes`` are.
    """

    every: int = Field(ge=1)
    start: Optional[int] = Field(default=None, ge=0)

    @property
    def first(self) -> int:
        """The first MoE layer: `start`, else k - 1 (Qwen's ``(i + 1) % k == 0``)."""
        return self.every - 1 if self.start is None else self.start


def _kind(value: Any) -> str:
    return "LayerEvery[dict]" if isinstance(value, (dict, LayerEvery)) else "list[int]"


# the field's type: one branch per shape, so a mapping's problems are not reported as "not a list" too (the tags
# hold "[", which the schema's error formatter leaves out of a YAML path)
LayerChoice = Annotated[Union[Annotated[list[int], Tag("list[int]")], Annotated[LayerEvery, Tag("LayerEvery[dict]")]],
                        Discriminator(_kind)]


def check_value(value: Any) -> Any:
    """The ``moe_layers:`` value as pydantic should see it (a list of ints, a mapping, or None), or a
    ValueError saying what is wrong and what to write.

    Example:
        >>> check_value((5, 1, 3))
        [5, 1, 3]
        >>> check_value("1, 3, 5")
        Traceback (most recent call last):
        ValueError: '1, 3, 5' is text, not a list of layers; write moe_layers: [1, 3, 5]
    """
    if value is None or isinstance(value, (dict, LayerEvery)):
        return value  # a mapping's keys and values are LayerEvery's to check
    if not isinstance(value, (list, tuple, str)) and callable(getattr(value, "tolist", None)):
        value = value.tolist()  # a numpy / torch array from Python: its list (a 0-d one: its number)
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not layers; write {EXAMPLES}, or {ALL_LAYERS}")
    if isinstance(value, (int, float)):
        shown = int(value) if isinstance(value, float) and value.is_integer() else value
        if not isinstance(shown, int) or shown < 0:
            raise ValueError(f"{short_repr(value)} is a single number, not layers; write {EXAMPLES}")
        every = f", or {{every: {shown}}} for every {_ordinal(shown)} layer" if shown >= 2 else ""
        raise ValueError(f"{short_repr(value)} is a single number; write [{shown}] for layer {shown} alone{every}")
    if isinstance(value, str):
        raise ValueError(_text_fix(value))
    if isinstance(value, (range, set, frozenset)):  # from Python: upcycle_model(moe_layers=range(1, 8, 2))
        value = sorted(value) if not isinstance(value, range) else list(value)
    if isinstance(value, (list, tuple)):  # numpy / torch integers, 3.0 and "3" (as num_experts: 4.0 or "4") are indices
        value = [int(x) if (isinstance(x, numbers.Integral) and not isinstance(x, bool))
                 or (isinstance(x, float) and x.is_integer()) or (isinstance(x, str) and WHOLE.fullmatch(x))
                 else x for x in value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{short_repr(value)} is not layers; write {EXAMPLES}")
    if not value:
        raise ValueError(f"the empty list makes no layer an MoE layer; list at least one (e.g. [1, 3]), or "
                         f"{ALL_LAYERS}")
    problems = [p for i, item in enumerate(value) if (p := _item_problem(i, item))]
    counts = Counter(x for x in value if type(x) is int)  # not a boolean: true would count as a second 1
    problems += [f"layer {x} is listed {n} times; list each layer once" for x, n in sorted(counts.items()) if n > 1]
    if problems:
        raise ValueError("\n".join(problems))
    return list(value)


def _item_problem(i: int, item: Any) -> Optional[str]:
    """What is wrong with one list item as a layer index, or None."""
    if isinstance(item, bool):
        return f"item {i} is {str(item).lower()}, a boolean, not a layer index; write a number such as 1"
    if isinstance(item, int):
        return (f"item {i} is {item}: layer indices count from 0 up (Python's negative indices are not taken); "
                f"write the layer's own index" if item < 0 else None)
    if isinstance(item, float):
        return f"item {i}: {not_whole(item)}" if math.isfinite(item) else f"item {i} is {item!r}, not a layer index"
    if item is None:
        return f"item {i} is empty (a bare '-' line, which YAML reads as null); write a layer index or remove it"
    if isinstance(item, (list, tuple, dict)):
        return f"item {i} is {short_repr(item)}, not a layer index; write the layers as one flat list, e.g. [1, 3, 5]"
    return f"item {i} is {short_repr(item)}, not a layer index; write a number such as 1"


def _text_fix(text: str) -> str:
    """What to write for ``moe_layers`` given as text ("1,3,5", "every 2", "all")."""
    words = text.strip().lower()
    numbers = re.findall(r"-?\d+", words)
    if words in ("all", "every", "every layer", "all layers", "*"):
        return f"{short_repr(text)}: every layer is the default; remove moe_layers"
    if re.fullmatch(r"every[\s_-]*(other|second)([\s_-]*layer)?|alternat\w*|interleaved?", words):
        return (f"{short_repr(text)} is text; write moe_layers: {{every: 2}} (layers 1, 3, 5, ...) or "
                f"{{every: 2, start: 0}} (layers 0, 2, 4, ...)")
    if words.startswith("every") and len(numbers) == 1:
        return f"{short_repr(text)} is text; write moe_layers: {{every: {numbers[0]}}}"
    if numbers and re.fullmatch(r"[\[\(]?\s*-?\d+(\s*[,;\s]\s*-?\d+)*\s*[\]\)]?", words):
        return f"{short_repr(text)} is text, not a list of layers; write moe_layers: [{', '.join(numbers)}]"
    return f"{short_repr(text)} is text, not layers; write {EXAMPLES}"


def _ordinal(n: int) -> str:
    """"second" for 2, "5th" for 5: the words of a message."""
    if n in (2, 3):
        return {2: "second", 3: "third"}[n]
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
