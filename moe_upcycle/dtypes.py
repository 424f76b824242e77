"""The one table of the dtypes moe-upcycle writes, by the names recipes and config.json give them.

`DTYPES` maps ``float32`` / ``float16`` / ``bfloat16`` (a recipe's ``dtype:`` and ``gate_dtype:``, config.json's
``torch_dtype`` / ``dtype``) to torch; `dtype_name` is its inverse, for any torch dtype (``torch.int8`` reads
``int8``), as messages, cards and config.json write it. The recipe's spellings (``bf16``, ``torch.bfloat16``) are
normalised by `recipe.schema` before they get here. Nothing here reads a tensor.
"""

from __future__ import annotations

import torch

# a name -> the dtype; the output dtypes (float64 is refused by the schema and the planner)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as config.json and our messages write it.

    Example:
        >>> dtype_name(torch.bfloat16), dtype_name(torch.int8)
        ('bfloat16', 'int8')
    """
    return str(dtype).removeprefix("torch.")
