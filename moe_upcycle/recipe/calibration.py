"""Calibration text for ``gate_mode: kmeans``: read documents from a file or a folder.

Accepted: ``.txt``/``.md`` (documents separated by blank lines), ``.jsonl`` (one JSON string or
object with a ``text`` field per line), or a folder, read recursively in sorted path order so the
result is deterministic. This module reads text and says how much of it the gates use (the window
length, the k-means sample budget), so `plan` can predict their memory from the same numbers;
tokenizing and windowing happen in `gates`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from moe_upcycle.errors import ConfigError
from moe_upcycle.inputs.records import json_line
from moe_upcycle.inputs.text import decode_utf8
from moe_upcycle.terminal.hints import variable_hint, windows_path_hint

CALIBRATION_WINDOW = 256  # tokens per calibration sequence
KMEANS_MAX_POINTS = 16384  # calibration tokens k-means keeps per layer, at most ...
KMEANS_MAX_BYTES = 2 * 2**30  # ... and in all (fp32, every layer)
STREAMED_STATES_BYTES = 1 << 30  # hidden states streamed gates hold between layers; more texts run in further passes
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)


def read_documents(path: str | Path) -> list[str]:
    """All documents of a calibration file or folder, in a deterministic order.

    Args:
        path: a .txt/.md/.jsonl file, or a folder searched recursively for them.

    Returns:
        Non-empty document strings.

    Raises:
        ConfigError: the path is missing, holds no usable file, a JSONL line is malformed, or no
            text was found. Messages name the file and line.
    """
    root = Path(os.path.expanduser(path))
    if root.is_dir():
        files = sorted(p for p in _walk(root) if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES)
        if not files:
            raise ConfigError(f"calibration_text: folder {root} has no .txt, .md or .jsonl files")
    elif root.is_file():
        files = [root]
    elif root.exists():  # a device or a pipe: /dev/zero would never end
        raise ConfigError(f"calibration_text: {root} is not a regular file; give a .txt/.jsonl file or a folder")
    else:
        raise ConfigError(f"calibration_text: {root} does not exist; "
                          + (variable_hint(str(path)) or windows_path_hint(str(path))
                             or "give a .txt/.jsonl file or a folder"))
    docs: list[str] = []
    for file in files:
        docs += _read_jsonl(file) if file.suffix.lower() in JSONL_SUFFIXES else _read_text(file)
    if not docs:
        raise ConfigError(f"calibration_text: {root} contains no text")
    return docs


def _walk(root: Path) -> list[Path]:
    """Every path under `root`; a folder that cannot be listed is an error (Path.rglob skips it, so an unreadable
    folder looked empty)."""
    def refuse(exc: OSError) -> None:
        raise ConfigError(f"calibration_text: cannot list the folder {exc.filename} ({exc.strerror or exc}); check "
                          f"that it is readable by you")

    return [Path(top) / name for top, dirs, files in os.walk(root, onerror=refuse) for name in dirs + files]


def _read_text(file: Path) -> list[str]:
    text = _read(file).replace("\r\n", "\n")  # a file saved on Windows gives the same documents, not \r in each
    return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]


def _read_jsonl(file: Path) -> list[str]:
    docs = []
    lines = _read(file).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        item, problem = json_line(file, number, line)
        if problem:
            raise ConfigError(f"calibration_text: {problem}")
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise ConfigError(f"calibration_text: {file}:{number}: expected a JSON string or an object with a "
                              f"\"text\" string field")
        if text.strip():
            docs.append(text.strip())
    return docs


def kmeans_sample_budget(num_experts: int, n_layers: int, hidden: int) -> int:
    """How many calibration tokens k-means keeps (a seeded sample when the text has more).

    Example:
        >>> kmeans_sample_budget(8, 22, 2048)  # TinyLlama: the byte bound is the tighter one
        11915
    """
    return max(num_experts, min(KMEANS_MAX_POINTS, KMEANS_MAX_BYTES // (4 * n_layers * hidden)))


def _read(file: Path) -> str:
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"calibration_text: cannot read {file} ({exc.strerror or exc})") from None
    return decode_utf8(data, f"calibration_text: {file}")


def streamed_batch_bytes(batch: int, tokens: int, hidden: int, head_dim: int, itemsize: int) -> int:
    """Bytes one batch of `batch` texts × `tokens` holds between layers while hidden-state gates stream the base
    (`gates.stream`): its hidden states (B, T, H), rotary cos and sin (B, T, head_dim) and at most two (B, T, T)
    masks (full and sliding window), in the compute dtype of `itemsize` bytes."""
    return batch * tokens * (hidden + 2 * head_dim + 2 * tokens) * itemsize
