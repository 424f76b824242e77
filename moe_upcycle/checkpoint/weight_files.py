"""Which weight files of a model folder are read: exactly those transformers would load.

transformers' ``from_pretrained`` on a local folder (``modeling_utils._get_resolved_checkpoint_files``)
takes the first of these that is a file: ``model.safetensors``, ``model.safetensors.index.json``,
``pytorch_model.bin``, ``pytorch_model.bin.index.json``. So a single ``model.safetensors`` wins
over an index beside it — even a stale index that names other shards. We read the same bytes
(and say which file was ignored), so the MoE is built from the model that `verify` and every
user of the base compare it with.

A tensor stored in two shards is ambiguous: the index names one, but transformers reads every
shard in sorted order and keeps the last copy. Rather than guess, the folder is refused, naming
the tensor and both files. It reads file names only; headers are read by `source`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

from moe_upcycle.errors import UpcycleWarning

# transformers' order of preference for a local folder (use_safetensors left at its default)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def choose_weights(path: Path) -> Optional[str]:
    """The weight file transformers would load from `path` (None when there is none).

    Warns (`UpcycleWarning`) when a single-file checkpoint shadows an index of the same format,
    since the index and its shards are then ignored.
    """
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        return None
    chosen = present[0]
    shadowed = f"{chosen}.index.json"
    if shadowed in present:
        warnings.warn(UpcycleWarning(
            f"{path}: both {chosen} and {shadowed} are present; reading {chosen} and ignoring the index and its "
            f"shards, as transformers does. If the shards are the model you mean, remove {chosen}"), stacklevel=2)
    return chosen


def duplicate_problems(folder: Path, found_in: dict[str, list[str]],
                       index: Optional[dict[str, Optional[set[str]]]], index_name: str) -> list[str]:
    """One problem per tensor stored in more than one shard file.

    Args:
        folder: the model folder (for messages).
        found_in: tensor key -> the shard files whose header holds it, in reading order.
        index: shard file -> keys the index assigns to it (None entries: no index).
        index_name: the index file's name, for messages.
    """
    named = {key: file for file, keys in (index or {}).items() for key in (keys or ())}
    problems = []
    for key, files in found_in.items():
        if len(files) < 2:
            continue
        said = f"; the index {index_name} names {named[key]}" if key in named else ""
        problems.append(f"{folder}: tensor {key!r} is stored in {len(files)} shards ({', '.join(files)}){said}. "
                        f"Which copy is the model is ambiguous (transformers keeps the copy in the last shard by "
                        f"name, {sorted(files)[-1]}), so nothing is built; remove the stale copy or re-download "
                        f"the model")
    return problems
