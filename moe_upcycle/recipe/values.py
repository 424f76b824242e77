"""Small value rules of the recipe schema that pydantic's lax mode does not enforce.

- `strict_bools_and_numbers`: YAML 1.1 reads ``yes``/``no``/``on``/``off``/``true`` as booleans and
  pydantic would accept them as the numbers 1 and 0 (``experts_per_token: yes`` became 1); a
  boolean given where the schema wants a number (or a list/tuple of numbers) is an error, and so
  is anything but true/false where it wants a boolean (pydantic would read ``1`` or ``"off"``).
- `device_problem`: a device name is auto, cpu, cuda or cuda:N (torch would read "gpu" or
  "cuda:x" only when the model is loaded, with a message that names no option).
- `not_whole`: the one wording of a fraction given for a whole number.
- `short_repr`: quote a user's value in a message without printing megabytes of it.

It does not know the recipe's fields; `config` applies these to every field.
"""

from __future__ import annotations

import datetime
import re
import typing
from typing import Any, Optional

MAX_SHOWN_CHARS = 120


def _numeric_only(annotation: Any) -> bool:
    """True when `annotation` accepts numbers (int/float, or containers of them) and not bool."""
    if annotation is bool:
        return False
    if annotation in (int, float):
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None) and a is not Ellipsis]
    return bool(args) and all(_numeric_only(a) for a in args)


def _bool_only(annotation: Any) -> bool:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation is bool or (bool(args) and all(a is bool for a in args))


def strict_bools_and_numbers(value: Any, annotation: Any) -> Any:
    """Return `value` unchanged, or raise ValueError when it is a boolean standing for a number
    or a non-boolean standing for a boolean.

    Example:
        >>> strict_bools_and_numbers(True, int)
        Traceback (most recent call last):
        ValueError: true is a boolean, not a number; write a number (YAML reads yes/no/on/off as true/false)
    """
    if _bool_only(annotation):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{short_repr(value)} is not a boolean; write true or false")
        return value
    if not _numeric_only(annotation):
        return value
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"{str(item).lower()} is a boolean, not a number; write a number (YAML reads "
                             f"yes/no/on/off as true/false)")
    return value


def not_whole(value: float) -> str:
    """The message for a fraction where a whole number goes (every integer field and ``moe_layers`` item says it
    so).

    Example:
        >>> not_whole(2.5)
        '2.5 is not a whole number; write an integer such as 2'
    """
    return f"{value!r} is not a whole number; write an integer such as {max(int(value), 1)}"


def device_problem(value: Any) -> Optional[str]:
    """What is wrong with a device name, or None for auto, cpu, cuda and cuda:N.

    Example:
        >>> device_problem("gpu")
        "'gpu' is not a device; use auto, cpu, cuda or cuda:N"
    """
    if isinstance(value, str) and re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
        return None
    return f"{short_repr(value)} is not a device; use auto, cpu, cuda or cuda:N"


def short_repr(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """``repr(value)`` cut to `limit` characters (containers are not walked past the limit).

    Example:
        >>> short_repr("x" * 500, 10)
        "'xxxxxx..."
    """
    if isinstance(value, (list, tuple, dict, set)):
        kind = type(value).__name__
        return f"a {kind} of {len(value)} items"
    if isinstance(value, (datetime.date, datetime.time)):  # YAML reads 2024-01-01 (and with a time) as a date
        return f"{value.isoformat()} (a date to YAML)"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes of binary data (YAML's !!binary)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
