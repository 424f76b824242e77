"""Read a pool of candidate prompts for ``prompts grow``: JSONL, paragraphs or lines.

A prompt can span lines (a code block, a poem), so a text pool is cut at blank lines by default:
each blank-line-separated paragraph is one candidate, its inner line breaks kept. A text file
without any blank line is read one prompt per line. JSONL (a ``.jsonl`` file, or one whose first
non-blank line starts with ``{``) gives one prompt per record's ``"text"`` or ``"prompt"``. The
format used is returned with the prompts, so the command can say which it used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

from moe_upcycle.errors import ConfigError
from moe_upcycle.inputs.text import read_utf8

PoolFormat = Literal["auto", "jsonl", "paragraphs", "lines"]
FORMAT_WORDS = {"jsonl": "JSONL records", "paragraphs": "paragraphs (blank-line separated)",
                "lines": "lines (one prompt per line)"}


@dataclass(frozen=True)
class Pool:
    """Candidate prompts (each once, in first-seen order) and the format they were read as."""

    prompts: list[str]
    format: str

    def describe(self, path: Union[str, Path]) -> str:
        """e.g. ``12 candidates from pool.txt, read as paragraphs (blank-line separated)``."""
        return f"{len(self.prompts)} candidates from {Path(path).name}, read as {FORMAT_WORDS[self.format]}"


def detect_format(path: Path, text: str) -> str:
    """``jsonl`` for .jsonl or a first non-blank line starting with ``{``; else ``paragraphs`` when
    the text has a blank line; else ``lines``."""
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if path.suffix == ".jsonl" or first.lstrip().startswith("{"):
        return "jsonl"
    return "paragraphs" if re.search(r"\n[ \t]*\n", text.strip()) else "lines"


def read_pool_file(path: Union[str, Path], fmt: PoolFormat = "auto") -> Pool:
    """Read candidate prompts.

    Args:
        path: the pool file.
        fmt: ``auto`` (see `detect_format`), ``jsonl``, ``paragraphs`` or ``lines``.

    Raises:
        ConfigError: the file is missing, a folder, not UTF-8 or holds no prompt, or JSONL lines are
            unusable (every one named, file:line).

    Example:
        >>> import tempfile, os
        >>> p = Path(tempfile.mkdtemp()) / "pool.txt"
        >>> _ = p.write_text("def f():\\n    return 1\\n\\nWhat is 2 + 2?\\n")
        >>> read_pool_file(p)
        Pool(prompts=['def f():\\n    return 1', 'What is 2 + 2?'], format='paragraphs')
    """
    path = Path(path)
    text = read_utf8(path, f"--pool {path}", fix="; give a text file (prompts separated by blank lines, or one per "
                                                  "line) or JSONL with \"text\"/\"prompt\"")
    fmt = detect_format(path, text) if fmt == "auto" else fmt
    if fmt == "jsonl":
        prompts = _jsonl(path, text)
    elif fmt == "paragraphs":
        blocks = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))
        prompts = ["\n".join(ln.rstrip() for ln in b.strip("\n").splitlines()).strip() for b in blocks]
    else:
        prompts = [ln.strip() for ln in text.splitlines()]
    prompts = list(dict.fromkeys(p for p in prompts if p))
    if not prompts:
        raise ConfigError(f"--pool {path}: holds no prompt (the file is empty or blank); give candidate prompts, "
                          f"separated by blank lines or one per line")
    return Pool(prompts, fmt)


def _jsonl(path: Path, text: str) -> list[str]:
    prompts, problems = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{n}: not valid JSON ({exc.msg})")
            continue
        value = row.get("text", row.get("prompt")) if isinstance(row, dict) else None
        if not isinstance(value, str) or not value.strip():
            problems.append(f"{path}:{n}: needs a non-empty \"text\" or \"prompt\" field")
            continue
        prompts.append(value.strip())
    if problems:
        raise ConfigError(*problems)
    return prompts
