"""The non-tensor files of the output: config.json, tokenizer, generation config.

The config itself is derived in `planning.model_config` (`moe_config`, re-exported here).
`copy_tokenizer_files` copies the base's tokenizer, chat template and generation config
**unmodified**, byte for byte; `missing_tokenizer_warning` says when the base has no tokenizer to copy. It does not write tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from moe_upcycle.checkpoint.names import TOKENIZER_FILES, tokenizer_files  # noqa: F401  (re-exported)

# one of these defines the vocabulary; the other tokenizer files only configure it
TOKENIZER_DEFINING = ("tokenizer.json", "tokenizer.model", "vocab.json")
from moe_upcycle.planning.model_config import experts_implementation, moe_config  # noqa: F401  (re-exported)


def write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def missing_tokenizer_warning(base: Path) -> Optional[str]:
    """The warning for a base folder that holds no tokenizer (None when it holds one).

    A weights-only folder builds a correct MoE, but the MoE then has no tokenizer either:
    ``AutoTokenizer.from_pretrained(OUT)`` and `verify` fail until one is copied in.
    """
    if any((base / name).is_file() for name in TOKENIZER_DEFINING):
        return None
    return (f"{base} holds no tokenizer ({', '.join(TOKENIZER_DEFINING)}), so the MoE will have none: "
            f"AutoTokenizer.from_pretrained on the output, and verify, fail until you copy the base model's "
            f"tokenizer files into it")


def copy_tokenizer_files(base: Path, folder: Path) -> list[str]:
    """Copy the base's tokenizer/generation files (named chat templates too) byte for byte. Returns the names
    copied, relative to the folders."""
    copied = []
    for name in tokenizer_files(base):
        if (base / name).is_file():
            (folder / name).parent.mkdir(exist_ok=True)
            shutil.copyfile(base / name, folder / name)
            copied.append(name)
    return copied
