"""PyTorch ``pytorch_model*.bin`` files, loaded as transformers loads them and nothing more.

`load_bin` uses ``weights_only=True`` (no pickled code runs), memory-mapped when the file is a
zip; it refuses a pickle that asks for anything else, and a wrapped state dict transformers
would not read. `shared_storage` finds keys that share one storage (tied weights).
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from moe_upcycle.checkpoint.lfs_pointers import lfs_pointer_problem
from moe_upcycle.dtypes import dtype_name
from moe_upcycle.errors import SourceError, reraise_if_out_of_memory


def load_bin(file: Path) -> dict[str, torch.Tensor]:
    """Load a pytorch .bin with weights_only=True (no pickled code runs), memory-mapped when it can be.

    Zip-format files (torch >= 1.6) are memory-mapped (lazy pages); legacy-format files cannot be
    and are read into memory.
    """
    if not file.is_file():
        raise SourceError(f"{file}: shard file is missing")
    pointer = lfs_pointer_problem(file)
    if pointer:
        raise SourceError(pointer)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as exc:
        raise SourceError(f"{file}: refused to load ({_unpickle_reason(exc)}): weights_only loading accepts only "
                          f"tensors and plain containers, and a pickle that asks for anything else could run "
                          f"code. Convert the checkpoint to safetensors in a trusted environment, or re-download "
                          f"it if it is damaged") from None
    except OSError:
        raise  # cannot read the file at all: `open_checkpoint` says so
    except Exception as exc:
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        raise SourceError(f"{file}: not a readable PyTorch checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise SourceError(f"{file}: expected a dict of tensors, got {type(state).__name__}")
    nested = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if nested:
        # transformers loads only top-level tensors: a wrapper such as {"state_dict": {...}} gives it none of
        # the weights (every one would be initialised at random), so the nested ones are not the model either
        k = nested[0]
        raise SourceError(f"{file}: expected a dict of tensors, but {k!r} holds a {type(state[k]).__name__}"
                          + (f" (and {len(nested) - 1} more entries are not tensors)" if len(nested) > 1 else "")
                          + ("; transformers loads only top-level tensors, so it would read none of the weights "
                             f"under {k!r} (they are not the model it loads). If they are the model, save them "
                             f"unwrapped: torch.save(checkpoint[{k!r}], 'pytorch_model.bin')"
                             if isinstance(state[k], dict) else "; re-download or re-save the model"))
    for key, t in state.items():
        problem = _not_plain(t)
        if problem:
            raise SourceError(f"{file}: tensor {key!r} {problem}; a checkpoint's weights are plain dense tensors "
                              f"with their values in the file. Re-save the model from a loaded copy "
                              f"(model.save_pretrained) or re-download it")
    return state


def _not_plain(t: torch.Tensor) -> str:
    """What keeps a loaded tensor from being read as plain values ('' if nothing)."""
    if t.layout != torch.strided:
        return f"is stored as a {str(t.layout).removeprefix('torch.')} tensor, not a dense one"
    if t.device.type != "cpu":  # map_location="cpu" moves every real device; a meta tensor has no values at all
        return f"has no values in the file (a tensor on the {t.device.type} device)"
    if t.is_quantized:
        return f"is a quantized tensor ({dtype_name(t.dtype)})"
    return ""


def _unpickle_reason(exc: Exception) -> str:
    """The line of torch's long weights_only message that says what was refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("Trying to load") or "GLOBAL" in line:
            return line.rstrip(".")
        if line.endswith("WeightsUnpickler error:") and i + 1 < len(lines):
            return lines[i + 1].rstrip(".")
    return lines[0] if lines else type(exc).__name__


def shared_storage(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Groups of keys whose tensors are the same view of one storage (tied or repeated weights)."""
    groups: dict[tuple, list[str]] = {}
    for key, t in state.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        groups.setdefault(ident, []).append(key)
    return [g for g in groups.values() if len(g) > 1]
