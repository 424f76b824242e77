"""Which transformers ``experts_implementation`` an MoE of given shapes and dtype can run with.

transformers 5 runs fused experts with ``grouped_mm`` by default, whose kernel (CPU and CUDA)
needs every row of the expert matrices to start on a 16-byte boundary. bf16 stories260K has an
FFN of 172 → rows of 344 bytes, and `generate` fails with "strides should be multiple of 16
bytes". For such shapes we choose ``eager`` (a loop over experts, any size), both for the
in-memory model of `in_memory.upcycle_model` and for what its ``save_pretrained`` writes, so a
reloaded model runs with the implementation the in-memory one ran with.

It does not load models or write files. (Issue 14 chooses the same for the file build's
config.json; both should use this one function.)
"""

from __future__ import annotations

from typing import Optional, Union

import torch

ALIGN_BYTES = 16  # grouped_mm: strides must be multiples of 16 bytes
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# config keys holding the routed experts' matrix sizes (Mixtral: intermediate_size; Qwen MoE: moe_intermediate_size)
_EXPERT_SIZE_KEYS = ("moe_intermediate_size", "intermediate_size")


def experts_implementation_for(config: dict, dtype: Union[torch.dtype, str]) -> Optional[str]:
    """``"eager"`` when the routed experts' rows are not 16-byte aligned in `dtype`, else None.

    None means: leave transformers' own choice (``grouped_mm``), which is fastest where it runs.

    Args:
        config: the MoE's config.json as a dict (``hidden_size`` and the expert intermediate size).
        dtype: the weights' dtype (``torch.bfloat16`` or ``"bfloat16"``).

    Example:
        >>> experts_implementation_for({"hidden_size": 64, "intermediate_size": 172}, torch.bfloat16)
        'eager'
        >>> experts_implementation_for({"hidden_size": 64, "intermediate_size": 172}, "float32") is None
        True
    """
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else _ITEMSIZE[str(dtype).removeprefix("torch.")]
    size_key = next((k for k in _EXPERT_SIZE_KEYS if config.get(k)), None)
    sizes = [int(config["hidden_size"])] + ([int(config[size_key])] if size_key else [])
    # gate_up_proj (E, 2I, H) has rows of H elements, down_proj (E, H, I) rows of I elements
    if any((n * itemsize) % ALIGN_BYTES for n in sizes):
        return "eager"
    return None
