"""The non-tensor files of the output: config.json, tokenizer, generation config.

The config itself is derived in `planning.model_config` (`moe_config`, re-exported here).
`copy_tokenizer_files` copies the base's tokenizer, chat template and generation config
**unmodified**, byte for byte. It does not write tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from moe_upcycle.checkpoint.names import TOKENIZER_FILES  # noqa: F401  (re-exported)
from moe_upcycle.planning.model_config import experts_implementation, moe_config  # noqa: F401  (re-exported)


def write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def copy_tokenizer_files(base: Path, folder: Path) -> list[str]:
    """Copy the base's tokenizer/generation files byte for byte. Returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, folder / name)
            copied.append(name)
    return copied
