"""Named prompt sets (``positive_prompts_from: code``) and prompt files.

A prompt set is a YAML file with ``name``, ``description`` and ``prompts`` (at least
`MIN_SET_PROMPTS` varied prompts). The shipped sets live in ``gate_configs/prompts/`` of the
source tree; the package reaches them as package data through ``moe_upcycle/data/prompts``, a
symlink to that folder that setuptools resolves into real files when it builds a wheel, so set
names resolve the same way from a source checkout and from an installed package. Where the
symlink is not honoured (e.g. a Windows checkout) the source tree's folder is used directly.

An expert may instead name a file: a prompt-set YAML, a YAML/JSON list of strings, or a text file
with one prompt per line. This module reads prompts; it does not tokenize or run models.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import yaml

from moe_upcycle.errors import ConfigError
from moe_upcycle.recipe.yaml_load import load_yaml_text
from moe_upcycle.terminal.hints import show_ref, variable_hint, windows_path_hint
from moe_upcycle.inputs.records import json_list_prompts, jsonl_prompts, table_prompts
from moe_upcycle.inputs.text import check_texts, read_utf8

MIN_SET_PROMPTS = 20
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # moe_upcycle/
_SET_DIRS = (_PACKAGE_DIR / "data" / "prompts", _PACKAGE_DIR.parent / "gate_configs" / "prompts")


def set_dir() -> Optional[Path]:
    """The folder holding the shipped prompt sets (package data first, then the source tree); one the user may not
    enter (a clone in another user's private folder) is passed over, as if the package shipped no sets there."""
    for folder in _SET_DIRS:
        try:
            if folder.is_dir() and any(folder.glob("*.yaml")):
                return folder
        except OSError:
            continue
    return None


def set_names() -> list[str]:
    """Names of the shipped prompt sets, sorted."""
    folder = set_dir()
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder else []


def check_set_file(path: Path) -> list[str]:
    """Problems with one prompt-set YAML (empty list when it is valid).

    A valid set has exactly the keys ``name`` (equal to the file stem), ``description`` and
    ``prompts`` (at least `MIN_SET_PROMPTS` distinct, non-blank strings).
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        return [f"{path}: not a readable YAML file ({exc})"]
    if not isinstance(data, dict):
        return [f"{path}: a prompt set is a mapping with name, description and prompts"]
    problems = []
    extra = sorted(set(data) - {"name", "description", "prompts"})
    if extra:
        problems.append(f"{path}: unknown key(s) {extra}; a prompt set has name, description and prompts")
    if data.get("name") != path.stem:
        problems.append(f"{path}: name is {data.get('name')!r}; it must equal the file name {path.stem!r}")
    if not isinstance(data.get("description"), str) or not data["description"].strip():
        problems.append(f"{path}: description: write one sentence saying what the prompts are for")
    prompts = data.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) and p.strip() for p in prompts):
        problems.append(f"{path}: prompts must be a list of non-empty strings")
    elif len(set(prompts)) < MIN_SET_PROMPTS:
        problems.append(f"{path}: prompts has {len(set(prompts))} distinct prompts; a set needs at least "
                        f"{MIN_SET_PROMPTS} varied ones")
    return problems


def resolve_reference(ref: str) -> Path:
    """The file a ``*_prompts_from`` value names: a shipped set name, else a file path.

    Raises:
        ValueError: neither a known set nor an existing file (lists the known sets).
    """
    if not ref.strip():
        raise ValueError(f"{ref!r} is empty; name a prompt set ({', '.join(set_names()) or 'none found'}) or give "
                         f"the path of a YAML/JSON/text prompt file")
    folder = set_dir()
    path = Path(os.path.expanduser(ref))
    try:
        if folder is not None and "/" not in ref and (folder / f"{ref}.yaml").is_file():
            return folder / f"{ref}.yaml"
        if path.is_file():
            return path
        exists = path.exists()
    except OSError as exc:  # a name too long to look up, a folder that cannot be read
        raise ValueError(f"{show_ref(ref)} cannot be looked up ({exc.strerror or exc}); give the path of a "
                         f"YAML/JSON/text prompt file") from None
    if exists and not path.is_dir():
        raise ValueError(f"{show_ref(ref)} is not a regular file (a pipe or a device), and a recipe is read more "
                         f"than once (plan, lint, build); write the prompts to a file")
    if path.is_symlink():
        raise ValueError(f"{ref!r} is a symbolic link that leads nowhere (a symlink loop or a broken link); fix it")
    if path.is_dir():
        raise ValueError(f"{ref!r} is a folder; give the path of a YAML/JSON/text prompt file in it, or name a "
                         f"prompt set ({', '.join(set_names()) or 'none found'})")
    written = variable_hint(ref) or windows_path_hint(ref)
    if written:
        raise ValueError(f"{show_ref(ref)} is not an existing file: {written}")
    raise ValueError(f"{ref!r} is neither a prompt set ({', '.join(set_names()) or 'none found'}) nor an "
                     f"existing file; name a set or give the path of a YAML/JSON/text prompt file")


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from a file: prompt-set YAML (``prompts:``), YAML/JSON list (of strings, or of records as
    `inputs.records` reads them), JSONL, CSV or TSV records, or text (one per line).

    Raises:
        ConfigError: unreadable file, wrong shape, or no prompts.
    """
    text = read_utf8(path, f"prompt file {path}", fix="; give a YAML/JSON list of prompts, JSONL/CSV records or a "
                                                       "text file, one per line")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        prompts = jsonl_prompts(path, text)
    elif suffix in (".csv", ".tsv"):
        prompts = table_prompts(path, text, "\t" if suffix == ".tsv" else ",")
    elif suffix in (".yaml", ".yml", ".json"):
        try:
            data = json.loads(text) if suffix == ".json" else load_yaml_text(text, str(path))
        except (json.JSONDecodeError, yaml.YAMLError, RecursionError) as exc:
            raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()} ({exc})") from None
        if isinstance(data, dict) and "prompts" in data:
            data = data["prompts"]
        if isinstance(data, list) and any(isinstance(p, dict) for p in data):
            prompts = json_list_prompts(path, json.dumps(data))  # records: {"text": ...}, {"instruction": ...}
        elif not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise ConfigError(f"{path}: expected a list of prompt strings, or a mapping with a prompts: list")
        else:
            prompts = [p for p in data if p.strip()]
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"{path}: contains no prompts")
    check_texts(prompts, f"{path}: prompt")
    return prompts


@lru_cache(maxsize=64)
def _cached(path: str, mtime: float) -> tuple[str, ...]:
    return tuple(read_prompt_file(Path(path)))


def load_prompts(ref: str, where: str) -> list[str]:
    """The prompts a ``*_prompts_from`` value names.

    Args:
        ref: a shipped set name (``code``) or a file path.
        where: the YAML path that gave it, for messages.

    Raises:
        ConfigError: the reference cannot be resolved or read.
    """
    try:
        path = resolve_reference(ref)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        return list(_cached(str(path.resolve()), path.stat().st_mtime))
    except ConfigError as exc:  # the file's own problems, with the YAML field that named it
        raise ConfigError(*[f"{where}: {problem}" for problem in exc.problems]) from None
