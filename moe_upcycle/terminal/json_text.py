"""The text of a ``--json`` result: one JSON document that every parser reads.

Non-finite numbers (a NaN KL, an infinite perplexity) become ``null``: ``NaN`` and ``Infinity`` are not JSON, and
strict parsers (``JSON.parse``, ``jq``) refuse them. Non-ASCII text is escaped (``\\u00e9``), so the document stays
valid whatever encoding standard output has (under ``PYTHONIOENCODING=ascii`` the stream's own escapes,
``\\xe9``, are not JSON).
"""

from __future__ import annotations

import json
import math
from typing import Any


def json_text(data: Any) -> str:
    """`data` as indented JSON, non-finite floats as null, ASCII only.

    Example:
        >>> print(json_text({"kl": float("nan"), "name": "café", "ok": [1.5, float("inf")]}))
        {
          "kl": null,
          "name": "caf\\u00e9",
          "ok": [
            1.5,
            null
          ]
        }
    """
    return json.dumps(_finite(data), indent=2, ensure_ascii=True, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
