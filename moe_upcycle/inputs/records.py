"""Prompts from records: JSONL lines, a JSON list, or CSV/TSV rows with a header.

A record's prompt is its first non-empty field of `TEXT_FIELDS` (plain, instruction and question
datasets); a chat record (``messages``: OpenAI style, ``conversations``: ShareGPT style) gives its
first user turn. Used by ``prompts grow``'s pool and by the recipe's ``*_prompts_from`` files; every
unusable record is named with its file and line (or item), with the fields it has.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Optional

from moe_upcycle.errors import ConfigError

# the fields a record's prompt is read from, first found wins (plain, instruction and question datasets)
TEXT_FIELDS = ("text", "prompt", "instruction", "question", "query", "input")
# chat records: the list field, the key of a turn's speaker, the user's names, the key of a turn's text
CHAT_FIELDS = (("messages", "role", ("user",), "content"), ("conversations", "from", ("human", "user"), "value"))
WANTED = ('a "text" or "prompt" field (or instruction, question, query, input; or a chat record\'s "messages" / '
          '"conversations", whose first user turn is read)')


def jsonl_prompts(path: Path, text: str) -> list[str]:
    """One prompt per JSONL line (blank lines skipped); every unusable line named, file:line."""
    prompts, problems = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row, problem = json_line(path, n, line)
        if problem:
            if n == 1 and line.lstrip().startswith("{") and len(text.splitlines()) > 1:
                problem += "; JSONL holds one record per line (a record spread over lines is JSON: name the file .json)"
            problems.append(problem)
            continue
        value, problem = record_text(row)
        if problem:
            problems.append(f"{path}:{n}: {problem}")
        else:
            prompts.append(value)
    if problems:
        raise ConfigError(*problems[:20], *([f"{path}: and {len(problems) - 20} more lines"] if len(problems) > 20 else []))
    return prompts


def json_line(path: Path, n: int, line: str) -> tuple[Any, Optional[str]]:
    """(the value of JSONL line `n`, None) or (None, what is wrong with it, as ``file:line: ...``)."""
    try:
        return json.loads(line), None
    except RecursionError:  # json raises it, not a decode error, for nesting past Python's limit
        return None, f"{path}:{n}: not valid JSON (nested too deeply)"
    except json.JSONDecodeError as exc:
        return None, f"{path}:{n}: not valid JSON ({exc.msg})"


def json_document(path: Path, text: str, where: str = "") -> Any:
    """`text` (the whole of file `path`) as JSON; `ConfigError` naming the file and line (after `where`, e.g. the
    option) when it is not JSON."""
    try:
        return json.loads(text)
    except RecursionError:  # json raises it, not a decode error, for nesting past Python's limit
        raise ConfigError(f"{where}{path}: not valid JSON (nested too deeply)") from None
    except json.JSONDecodeError as exc:
        jsonl = " (one record per line is JSONL: name the file .jsonl)" if "Extra data" in exc.msg else ""
        raise ConfigError(f"{where}{path}:{exc.lineno}: not valid JSON ({exc.msg}){jsonl}") from None


def json_list_prompts(path: Path, text: str) -> list[str]:
    """A JSON list of strings or of records (as a JSONL record each)."""
    rows = json_document(path, text)
    if isinstance(rows, dict):
        lists = [k for k, v in rows.items() if isinstance(v, list)]
        hint = f"; the prompts may be its {lists[0]!r} list: give a file holding that list" if len(lists) == 1 else ""
        raise ConfigError(f"{path}: a JSON object, not a list of prompts{hint}")
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: JSON {type(rows).__name__}, not a list of prompts")
    prompts, problems = [], []
    for i, row in enumerate(rows):
        value, problem = (row.strip(), None) if isinstance(row, str) else record_text(row)
        if problem:
            problems.append(f"{path}: item {i}: {problem}")
        elif value:
            prompts.append(value)
    if problems:
        raise ConfigError(*problems[:20], *([f"{path}: and {len(problems) - 20} more items"] if len(problems) > 20 else []))
    return prompts


def table_prompts(path: Path, text: str, delimiter: str) -> list[str]:
    """The prompt column of a CSV/TSV file with a header row (a field may hold line breaks, in quotes)."""
    header, rows = table_rows(path, text, delimiter)
    column = next((f for f in TEXT_FIELDS if f in header), None)
    if column is None:
        shown = ", ".join(repr(h) for h in header[:8]) or "none"
        raise ConfigError(f"{path}: its header row names no prompt column (columns: {shown}); name the column of "
                          f"prompts one of {', '.join(TEXT_FIELDS)}")
    return [row[column].strip() for row in rows if row.get(column)]


def table_rows(path: Path, text: str, delimiter: str) -> tuple[list[str], list[dict[str, str]]]:
    """(the header's column names, lower-cased; one mapping per row) of a CSV/TSV file."""
    try:
        rows = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter))
    except csv.Error as exc:
        raise ConfigError(f"{path}: not a readable {'TSV' if delimiter == chr(9) else 'CSV'} file ({exc})") from None
    header = [h.strip().lower() for h in rows[0]] if rows else []
    return header, [dict(zip(header, row)) for row in rows[1:] if any(cell.strip() for cell in row)]


def record_text(row: Any) -> tuple[Optional[str], Optional[str]]:
    """(the prompt of one record, None) or (None, what is wrong with it).

    Example:
        >>> record_text({"instruction": "Write a haiku", "output": "..."})
        ('Write a haiku', None)
        >>> record_text({"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]})
        ('Hi', None)
        >>> record_text({"text": 1})
        (None, "its 'text' is a JSON int, not the text of a prompt")
    """
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not a record; give records with {WANTED}"
    for name in TEXT_FIELDS:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value.strip(), None
    for name, speaker, users, said in CHAT_FIELDS:
        turns = row.get(name)
        if isinstance(turns, list):
            first = next((t.get(said) for t in turns if isinstance(t, dict) and t.get(speaker) in users), None)
            if isinstance(first, str) and first.strip():
                return first.strip(), None
            return None, f"its {name!r} list has no user turn with text"
    given = next((name for name in TEXT_FIELDS if name in row), None)
    if given is not None:  # the field is there, its value is no text: say that, not that the field is missing
        value = row[given]
        what = "empty" if isinstance(value, str) else "null" if value is None else f"a JSON {type(value).__name__}"
        return None, f"its {given!r} is {what}, not the text of a prompt"
    keys = ", ".join(repr(k) for k in list(row)[:8]) or "none"
    return None, f"needs {WANTED}; this record's fields: {keys}"


def is_json_list(text: str) -> bool:
    """Whether `text` as a whole is a JSON list (a file of prompt lines may start with ``[INST]`` and be none)."""
    try:
        return isinstance(json.loads(text), list)
    except (ValueError, RecursionError):
        return False
