"""The one table of the dtypes moe-upcycle writes, by the names recipes and config.json give them.

`DTYPES` maps ``float32`` / ``float16`` / ``bfloat16`` (a recipe's ``dtype:`` and ``gate_dtype:``, config.json's
``torch_dtype`` / ``dtype``) to torch; `dtype_name` is its inverse, for any torch dtype (``torch.int8`` reads
``int8``), as messages, cards and config.json write it; `model_dtype` is the dtype a model in memory is
of (most of its floating-point elements). The recipe's spellings (``bf16``, ``torch.bfloat16``) are
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


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of most of `model`'s floating-point parameters (by element count; float32 for none).

    A model is not always of one dtype: peft's ``prepare_model_for_kbit_training`` and many training scripts keep
    norms or the head in float32 beside bfloat16 weights; the first parameter's dtype would then decide by accident.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16(), torch.nn.LayerNorm(4))
        >>> model_dtype(m)
        torch.bfloat16
    """
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=counts.get) if counts else torch.float32
