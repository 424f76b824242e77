"""Read a pool of candidate prompts for ``prompts grow``: JSONL, JSON, CSV/TSV, paragraphs or lines.

A prompt can span lines (a code block, a poem), so a text pool is cut at blank lines by default:
each blank-line-separated paragraph is one candidate, its inner line breaks kept. A text file
without any blank line is read one prompt per line. Records — JSONL (a ``.jsonl`` file, or one whose
first non-blank line starts with ``{``), a JSON list (``.json``, or a file starting with ``[``) of
strings or records, a CSV or TSV file with a header row — give one prompt per record
(`inputs.records`). The format used is returned with the prompts, so the command can say which it used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

from moe_upcycle.errors import ConfigError
from moe_upcycle.inputs.records import is_json_list, json_list_prompts, jsonl_prompts, table_prompts
from moe_upcycle.inputs.text import read_utf8

PoolFormat = Literal["auto", "jsonl", "json", "csv", "tsv", "paragraphs", "lines"]
FORMATS = ("auto", "jsonl", "json", "csv", "tsv", "paragraphs", "lines")
FORMAT_WORDS = {"jsonl": "JSONL records", "json": "a JSON list", "csv": "CSV rows", "tsv": "TSV rows",
                "paragraphs": "paragraphs (blank-line separated)", "lines": "lines (one prompt per line)"}


@dataclass(frozen=True)
class Pool:
    """Candidate prompts (each once, in first-seen order) and the format they were read as."""

    prompts: list[str]
    format: str

    def describe(self, path: Union[str, Path]) -> str:
        """e.g. ``12 candidates from pool.txt, read as paragraphs (blank-line separated)``."""
        return f"{len(self.prompts)} candidates from {Path(path).name}, read as {FORMAT_WORDS[self.format]}"


def detect_format(path: Path, text: str) -> str:
    """By suffix (``.jsonl``, ``.json``, ``.csv``, ``.tsv``), else by the first non-blank character (``{``: JSONL,
    ``[`` and the whole text is a JSON list: JSON); else ``paragraphs`` when the text has a blank line; else ``lines``."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".csv", ".tsv"):
        return suffix[1:]
    first = next((ln for ln in text.splitlines() if ln.strip()), "").lstrip()
    if first.startswith("{"):
        return "jsonl"
    if first.startswith("[") and is_json_list(text):  # not "[INST] Write a poem" lines
        return "json"
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
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> p = Path(folder.name) / "pool.txt"
        >>> _ = p.write_text("def f():\\n    return 1\\n\\nWhat is 2 + 2?\\n")
        >>> read_pool_file(p)
        Pool(prompts=['def f():\\n    return 1', 'What is 2 + 2?'], format='paragraphs')
        >>> folder.cleanup()
    """
    path = Path(path)
    text = read_utf8(path, f"--pool {path}", fix="; give a text file (prompts separated by blank lines, or one per "
                                                  "line), or JSONL, JSON, CSV or TSV records with \"text\"/\"prompt\"")
    fmt = detect_format(path, text) if fmt == "auto" else fmt
    if fmt == "jsonl":
        prompts = jsonl_prompts(path, text)
    elif fmt == "json":
        prompts = json_list_prompts(path, text)
    elif fmt in ("csv", "tsv"):
        prompts = table_prompts(path, text, "\t" if fmt == "tsv" else ",")
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
