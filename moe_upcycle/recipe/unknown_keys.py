"""The unknown-key rule: a misspelt key is an error, a genuinely unknown key is refused or ignored.

mergekit-moe ignores every key it does not know, misspellings included (``postive_prompts`` is
dropped and the build then fails for want of prompts, or routes without them). We tell the two
apart:

- a key within a small edit distance of a known key at the same place (``gate_mdoe``,
  ``experts[0].positve_prompts``, ``Base_Model``), or a known synonym (``num_experts_per_tok``),
  is always an error with "did you mean";
- any other unknown key (``tokenizer_source``, ``merge_method``) is an error by default, because a
  setting we do not apply should not pass unnoticed; with ``allow_unknown_keys`` (CLI
  ``--allow-unknown-keys``) it is removed before validation and reported as a warning, which
  builds a mergekit config unchanged.

"Small" is an optimal-string-alignment distance (a transposition counts once) of at most 1 for
keys up to 4 characters, 2 up to 8, 3 beyond, after ignoring case and ``-`` versus ``_``.

It only looks at key names; values are the schema's job.
"""

from __future__ import annotations

import typing
import warnings
from typing import Any, Optional

from pydantic import BaseModel

from moe_upcycle.errors import UpcycleWarning

# names other tools use for our keys
SYNONYMS = {"num_experts_per_tok": "experts_per_token", "num_experts_per_token": "experts_per_token",
            "top_k": "experts_per_token", "torch_dtype": "dtype", "out_dtype": "dtype", "model": "source_model",
            "source": "source_model", "base": "base_model", "gate": "gate_mode", "prompts": "positive_prompts",
            "positive": "positive_prompts", "negative": "negative_prompts"}


def edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance (insertions, deletions, substitutions, adjacent swaps).

    Example:
        >>> edit_distance("gate_mdoe", "gate_mode")
        1
    """
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def intended_key(key: Any, valid: list[str]) -> Optional[str]:
    """The known key a misspelt `key` stands for, or ``None`` when it is genuinely unknown."""
    text = str(key).strip().lower().replace("-", "_")
    if text in valid:
        return text
    if SYNONYMS.get(text) in valid:
        return SYNONYMS[text]
    limit = 1 if len(text) <= 4 else 2 if len(text) <= 8 else 3
    best = min(valid, key=lambda v: (edit_distance(text, v), v), default=None)
    return best if best is not None and edit_distance(text, best) <= limit else None


def key_elsewhere(key: Any, root: type[BaseModel], where: list) -> Optional[str]:
    """Where in the recipe `key` belongs when it is a valid key of another section, else None.

    Example: ``positive_prompts`` at the top level belongs in ``experts[i]``; ``ratio`` beside
    ``num_experts`` belongs in ``expert_init``. `where` is the YAML path the key was found at.
    """
    if not isinstance(key, str):
        return None
    here = [p for p in where if not isinstance(p, int)]
    sections: list[tuple[str, list, type[BaseModel]]] = [("", [], root)]
    for path, names, model in sections:  # breadth first
        for name, field in model.model_fields.items():
            inner = model_in(field.annotation)
            if inner is not None and len(names) < 2:
                shown = f"{name}[i]" if typing.get_origin(field.annotation) is list else name
                sections.append((f"{path}.{shown}" if path else shown, names + [name], inner))
    homes = [(path, names) for path, names, model in sections if key in model.model_fields and names != here]
    # a section inside the one the key was found in wins (experts[i].ratio -> experts[i].expert_init), then the shallowest
    homes.sort(key=lambda home: (home[1][:len(here)] != here, len(home[1])))
    if not homes:
        return None
    return f"in {homes[0][0]}" if homes[0][0] else "at the top level"


def drop_repeated_keys(data: dict, root: type[BaseModel]) -> dict:
    """A copy of `data` without the top-level keys an expert entry repeats with the top level's value (published
    recipes write ``architecture: qwen`` under every expert too; mergekit-moe ignores them), reported once per
    key as an `UpcycleWarning`. A repeat with another value is kept, for the schema's message.

    Example:
        >>> import warnings; warnings.simplefilter("ignore")
        >>> from moe_upcycle.recipe.schema import UpcycleConfig
        >>> drop_repeated_keys({"architecture": "qwen", "experts": [{"source_model": "a", "architecture": "qwen"}]},
        ...                    UpcycleConfig)
        {'architecture': 'qwen', 'experts': [{'source_model': 'a'}]}
    """
    out, repeats = dict(data), {}
    for section, field in root.model_fields.items():
        inner = model_in(field.annotation)
        items = out.get(section)
        if inner is None or not isinstance(items, list):
            continue
        kept = []
        for i, item in enumerate(items):
            if isinstance(item, dict):
                same = [k for k, v in item.items() if isinstance(k, str) and k not in inner.model_fields
                        and k in root.model_fields and k in data and _same(v, data[k])]
                for key in same:
                    repeats.setdefault(key, []).append(f"{section}[{i}]")
                item = {k: v for k, v in item.items() if k not in same}
            kept.append(item)
        out[section] = kept
    for key, places in repeats.items():
        shown = (", ".join(places[:3]) + f" and {len(places) - 3} more" if len(places) > 3 else
                 " and ".join([", ".join(places[:-1]), places[-1]]) if len(places) > 1 else places[0])
        warnings.warn(f"{key}: repeated in {shown} with the top level's value; the copies are ignored (the MoE has "
                      f"one {key}, set at the top level) — remove them to silence this warning", UpcycleWarning,
                      stacklevel=3)
    return out


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def drop_unknown_keys(data: dict, model: type[BaseModel]) -> dict:
    """A copy of `data` without its genuinely unknown keys, each reported as an `UpcycleWarning`.

    Misspelt keys are kept, so that validation reports them with "did you mean".
    """
    dropped: list[tuple[str, Optional[str]]] = []
    cleaned = _walk(data, model, "", dropped, model, [])
    for path, home in dropped:
        moved = f"; if it was meant for moe-upcycle, it belongs {home}" if home else ""
        warnings.warn(f"{path}: unknown key ignored (mergekit-moe ignores it too){moved}; remove it to silence this "
                      f"warning", UpcycleWarning, stacklevel=3)
    return cleaned


def _walk(value: Any, model: Optional[type[BaseModel]], where: str, dropped: list, root: type[BaseModel],
          loc: list) -> Any:
    if model is None:
        return value
    if isinstance(value, list):
        return [_walk(v, model, f"{where}[{i}]", dropped, root, loc + [i]) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    valid = list(model.model_fields)
    out = {}
    for key, item in value.items():
        path = f"{where}.{key}" if where else str(key)
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None and intended_key(key, valid) is None:
            dropped.append((path, key_elsewhere(key, root, loc)))
            continue
        out[key] = _walk(item, model_in(field.annotation) if field else None, path, dropped, root, loc + [key])
    return out


def model_in(annotation: Any) -> Optional[type[BaseModel]]:
    """The pydantic model inside a field annotation (``list[ExpertConfig]`` -> ExpertConfig), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = model_in(arg)
        if found:
            return found
    return None
