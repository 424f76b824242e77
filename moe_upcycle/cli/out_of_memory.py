"""What a command says when the GPU or the machine runs out of memory, instead of a traceback.

`errors.memory_ran_out` tells (torch's GPU and CPU allocators, MemoryError, ENOMEM as the libraries word it).
None of them is a bug: the model, the batch or the machine is too small for the other. Each command names
the options that make it fit. Nothing here imports torch (the CLI starts without it).
"""

from __future__ import annotations

import re
from typing import Optional

from moe_upcycle.checkpoint.disk_space import human_bytes
from moe_upcycle.errors import memory_ran_out


def out_of_memory(exc: BaseException, command: str, options: dict) -> Optional[str]:
    """The message for `exc` when it is running out of memory, else None.

    Args:
        command: the command's function name (``build``, ``route``, ``verify_cmd``, ``lint``...).
        options: the command's keyword arguments (``batch_size``, ``device``), to say what they are now.

    Example:
        >>> out_of_memory(MemoryError(), "route", {"batch_size": 8})
        'the machine ran out of memory; lower --batch-size (now 8)'
        >>> out_of_memory(ValueError("out of range"), "build", {}) is None
        True
    """
    kind = memory_ran_out(exc)
    if kind is None:
        return None
    gpu = kind == "GPU"
    what = "the GPU ran out of memory" if gpu else "the machine ran out of memory"
    said = _what_torch_said(exc, gpu)
    batch = options.get("batch_size")
    now = f" (now {batch})" if batch else ""
    if command == "build" and gpu:  # only hidden-state gates use the GPU
        todo = (f"lower --batch-size{now} for hidden-state gates (batch_size: in the recipe; they hold one layer of the "
                f"base and the prompts' hidden states), or compute them on the CPU with --device cpu; `moe-upcycle plan "
                f"CONFIG` shows the GPU memory they need")
    elif command == "build":
        todo = (f"`moe-upcycle plan CONFIG` shows what the build holds in each phase; close other programs, lower "
                f"--batch-size{now} if it computes hidden-state gates, or build on a machine with more memory")
    elif command in ("route", "lint"):
        todo = f"lower --batch-size{now}" + (" or use --device cpu" if gpu and command == "route" else "")
    elif command == "verify_cmd":
        todo = "use --device cpu" if gpu else "verify on a machine with more memory (it loads the MoE and its dense model)"
    else:
        todo = "free memory (close other programs) and run it again"
    close = "; other processes on the GPU hold memory too (nvidia-smi lists them)" if gpu else ""
    return f"{what}{f' ({said})' if said else ''}; {todo}{close}"


def _what_torch_said(exc: BaseException, gpu: bool) -> str:
    """The useful part of the allocator's message: for a GPU its first sentences (what was asked, what is free),
    for the CPU allocator the size it was asked for."""
    text = " ".join(str(exc).split())
    if gpu:
        return ". ".join(text.split(". ")[:3]).rstrip(".")[:240]
    asked = re.search(r"tried to allocate (\d+) bytes", text)
    if asked:
        return f"an allocation of {human_bytes(int(asked.group(1)))} failed"
    mapped = re.search(r"unable to mmap (\d+) bytes from file <(.*?)>", text)
    if mapped:
        return f"mapping {human_bytes(int(mapped.group(1)))} of {mapped.group(2)} failed"
    library = re.search(r"([^/\s]+\.so[^/\s:]*): failed to map segment from shared object", text)
    if library:
        return f"the library {library.group(1)} could not be loaded"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return text[:160]
