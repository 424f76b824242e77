"""Are the output's tokenizer files the base's? ``verify``'s check, strict for our builds, fair to others.

A moe-upcycle build copies the base's tokenizer and generation files byte for byte, so for a folder
with our ``moe_upcycle.json`` any difference is a problem. A folder built elsewhere (mergekit-moe
re-saves the tokenizer through transformers and writes no generation_config.json) is judged by what
the files say, not their bytes:

- a JSON file is compared as data, without the keys a save adds and no loader reads
  (`SAVE_NOISE`), a top-level null or empty mapping or list read as unset (as loaders read it), with transformers 5's ``TokenizersBackend`` read as the fast tokenizer it is,
  with a tokenizer.json's merges in either of the tokenizers library's spellings, generation settings
  at generation's defaults read as unset, and an ``added_tokens_decoder`` (which transformers 4 writes
  into tokenizer_config.json) read as unset when it restates the folder's own tokenizer.json;
- a chat template or merges file that differs only in line endings or a final newline passes;
- a different ``pad_token`` is a note (it changes only how batches are padded);
- any other difference is a problem naming the file and where inside it the values first differ
  (``added_tokens[3].content``, ``model.vocab.zzz``);
- a missing generation_config.json is a note when config.json carries the same token ids and the
  base's file sets nothing but generation's defaults, else a problem naming what generation loses (an instruct model's
  extra end-of-turn id, its sampling defaults).

It reads small files only; it runs no model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_upcycle.checkpoint.names import tokenizer_files

# keys a save writes that no loader uses: where and how it was loaded, by which version
SAVE_NOISE = frozenset({"is_local", "local_files_only", "name_or_path", "_commit_hash", "transformers_version",
                        "_from_model_config"})
# transformers 5 saves every fast tokenizer as TokenizersBackend; 4.x wrote PreTrainedTokenizerFast
SAME_CLASS = {"TokenizersBackend": "PreTrainedTokenizerFast"}
PADDING_ONLY = frozenset({"pad_token", "pad_token_id", "padding_side"})
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# generation settings that say what generation does without them (transformers 4's defaults; 5 leaves them unset)
GENERATION_DEFAULTS = {"output_attentions": False, "output_hidden_states": False, "output_scores": False,
                       "return_dict_in_generate": False, "use_cache": True, "do_sample": False, "num_beams": 1,
                       "temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0}


def tokenizer_differences(base: Path, folder: Path, ours: bool) -> tuple[list[str], list[str]]:
    """(problems, notes) about the output's tokenizer and generation files against the base's.

    Args:
        base: the dense base's folder; folder: the output's.
        ours: the folder was built by moe-upcycle (it has moe_upcycle.json): bytes must match.
    """
    problems: list[str] = []
    notes: list[str] = []
    for name in tokenizer_files(base):
        mine, theirs = base / name, folder / name
        if not mine.is_file():
            continue
        if not theirs.is_file():
            if name == "generation_config.json" and not ours:
                _missing_generation_config(mine, folder, problems, notes)
            else:
                problems.append(f"{name}: the base has it but the output does not; copy it from {base}")
            continue
        if mine.read_bytes() == theirs.read_bytes():
            continue
        same_text = not ours and name.endswith((".jinja", ".txt")) and _text(mine) is not None
        if same_text and _text(mine) == _text(theirs):
            continue  # a template or merges file re-saved with other line endings or a final newline
        if ours or not name.endswith(".json"):
            problems.append(f"{name}: differs from the base's {mine}; the tokenizer must be the base's, byte for byte")
            continue
        a, b = _data(mine), _data(theirs)
        if a is None or b is None:
            problems.append(f"{name}: differs from the base's {mine}, and one of them is not valid JSON")
            continue
        changed = sorted(k for k in {*a, *b} if a.get(k, _ABSENT) != b.get(k, _ABSENT))
        padding, other = [k for k in changed if k in PADDING_ONLY], [k for k in changed if k not in PADDING_ONLY]
        if other:
            problems.append(f"{name}: says something other than the base's {mine}: {_shown(other, a, b)}; the "
                            f"tokenizer must be the base's — copy the file from the base")
        if padding:
            notes.append(f"{name}: {_shown(padding, a, b)} (padding only: single prompts tokenize and run the same)")
    return problems, notes


def _missing_generation_config(mine: Path, folder: Path, problems: list[str], notes: list[str]) -> None:
    """generation_config.json is in the base only: does generation lose anything config.json does not carry?"""
    gen = _data(mine) or {}
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        cfg = {}
    lost = [k for k in gen if not (cfg.get(k) == gen[k] if k in TOKEN_IDS else GENERATION_DEFAULTS.get(k, _ABSENT) == gen[k])]
    if lost:
        problems.append(f"generation_config.json: the base has it but the output does not, so generation loses "
                        f"{_shown(lost, gen, cfg, both=False)}; copy it from {mine.parent}")
    else:
        notes.append("generation_config.json: the base has it, the output does not; config.json carries the same "
                     "token ids, so generation runs the same")


def _text(path: Path) -> Any:
    """The file's text with line endings and trailing blank space normalised; None if unreadable."""
    try:
        return path.read_text(encoding="utf-8").replace("\r\n", "\n").rstrip()
    except (OSError, ValueError, RecursionError):
        return None


def _data(path: Path) -> Any:
    """The file's JSON with `SAVE_NOISE` removed, class names and merges in one spelling; None if unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return {"": data}
    # null, {} and [] read as unset; so do generation's defaults, which transformers 4 writes and 5 leaves out
    data = {k: v for k, v in data.items() if k not in SAVE_NOISE and v is not None and v != {} and v != []
            and not (path.name == "generation_config.json" and GENERATION_DEFAULTS.get(k, _ABSENT) == v)}
    if path.name == "tokenizer_config.json" and _restates_added_tokens(data.get("added_tokens_decoder"), path.parent):
        del data["added_tokens_decoder"]
    if isinstance(data.get("tokenizer_class"), str):
        data["tokenizer_class"] = SAME_CLASS.get(data["tokenizer_class"], data["tokenizer_class"])
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("merges"), list):  # "a b" or ["a", "b"]
        data["model"] = {**model, "merges": [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]}
    return data


def _restates_added_tokens(decoder: Any, folder: Path) -> bool:
    """Whether tokenizer_config.json's ``added_tokens_decoder`` says only what the folder's tokenizer.json says:
    each id with the content and special flag of its added token there (transformers 4 writes it on every save)."""
    if not isinstance(decoder, dict) or not decoder:
        return False
    try:
        added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens")
    except (OSError, ValueError, RecursionError, AttributeError):
        return False
    if not isinstance(added, list):
        return False
    known = {str(t.get("id")): (t.get("content"), t.get("special")) for t in added if isinstance(t, dict)}
    return all(isinstance(v, dict) and known.get(str(k)) == (v.get("content"), v.get("special"))
               for k, v in decoder.items())


def _shown(keys: list[str], a: dict, b: dict, both: bool = True, limit: int = 3) -> str:
    """Each key where the values first differ inside it, with the base's (`a`) and, with `both`, the output's value."""
    parts = []
    for key in keys[:limit]:
        path, x, y = _first_difference(key, a.get(key, _ABSENT), b.get(key, _ABSENT)) if both else (key, a[key], None)
        parts.append(f"{path} {_value(x)} in the base, {_value(y)} here" if both else f"{path} {_value(x)}")
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(parts) + more


def _first_difference(path: str, a: Any, b: Any) -> tuple[str, Any, Any]:
    """The first place inside two JSON values where they differ: (path such as added_tokens[0].normalized, a, b)."""
    while True:
        if isinstance(a, dict) and isinstance(b, dict):
            key = next((k for k in sorted({*a, *b}) if a.get(k, _ABSENT) != b.get(k, _ABSENT)), None)
            if key is None:
                return path, a, b
            path, a, b = f"{path}.{key}", a.get(key, _ABSENT), b.get(key, _ABSENT)
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                return path, a, b
            path, a, b = f"{path}[{i}]", a[i], b[i]
        else:
            return path, a, b


def _value(value: Any) -> str:
    if value is _ABSENT:
        return "unset"
    text = json.dumps(value, ensure_ascii=False)
    if isinstance(value, list) and len(text) > 40:
        return f"a list of {len(value)}"
    return text if len(text) <= 40 else text[:37] + "..."


_ABSENT = object()
