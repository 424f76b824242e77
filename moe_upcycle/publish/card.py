"""The output's README.md model card, with Hugging Face hub front matter.

Written from the config and plan only (plus verification results when given, and the source
models' README.md/config.json for their license); it reads no tensors. The parameter counts come
from `planning.plan_report.parameter_counts`, as in ``moe-upcycle plan``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional, Sequence

import yaml

from moe_upcycle import __version__
from moe_upcycle.checkpoint import names
from moe_upcycle.planning.plan_report import parameter_counts, readable_count
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.schema import UpcycleConfig
from moe_upcycle.planning.runtimes import runtime_section
from moe_upcycle.publish.card_facts import Sources, cell, making_of

LICENSE_KEYS = ("license", "license_name", "license_link")


def read_license(folder: Path) -> Optional[dict]:
    """A model folder's license: its README.md front matter, else its config.json; None if neither says.

    Returns:
        ``{"license": ...}`` plus ``license_name``/``license_link`` when the card gives them.
    """
    card = folder / "README.md"
    if card.is_file():
        try:
            text = card.read_text(encoding="utf-8", errors="replace")
        except OSError:  # unreadable: the card says to set the license, as for a card without one
            text = ""
        if text.startswith("---"):
            end = text.find("\n---", 3)
            try:
                front = yaml.safe_load(text[3:end]) if end > 0 else None
            except (yaml.YAMLError, RecursionError):
                front = None
            # only text: the hub's license fields are strings (a list or a mapping would make our card invalid)
            if isinstance(front, dict) and isinstance(front.get("license"), str) and front["license"].strip():
                return {k: front[k] for k in LICENSE_KEYS if isinstance(front.get(k), str) and front[k].strip()}
    config = folder / "config.json"
    if config.is_file():
        try:
            value = json.loads(config.read_text(encoding="utf-8")).get("license")
        except (OSError, ValueError, RecursionError, AttributeError):
            value = None
        if isinstance(value, str) and value.strip():
            return {"license": value}
    return None


def choose_license(source_paths: Sequence[Path]) -> tuple[Optional[dict], str]:
    """The license of the output: the base's (first path) when every source that states one agrees.

    Returns:
        (front matter keys or None, a note for the card when the user must set it).
    """
    found = {str(p): read_license(p) for p in source_paths}
    stated = {p: lic for p, lic in found.items() if lic}
    base = found.get(str(source_paths[0])) if source_paths else None
    if base and all(lic["license"] == base["license"] for lic in stated.values()):
        return base, ""
    if not stated:
        return None, ("No license was found in the base model's README.md or config.json: set `license:` in the "
                      "front matter to the base model's license before publishing.")
    listed = ", ".join(f"{p}: {lic['license']}" for p, lic in stated.items())
    return None, (f"The source models state different licenses ({listed}): set `license:` in the front matter "
                  f"to one that satisfies all of them before publishing.")


def model_card(config: UpcycleConfig, plan: Plan, verify_lines: Optional[list[str]] = None,
               source_paths: Sequence[Path] = (), sources: Optional[Mapping[str, Optional[Path]]] = None) -> str:
    """The model card text.

    Args:
        config: the recipe as used.
        plan: the build plan (architecture, experts, parameter counts).
        verify_lines: markdown from `verify.VerifyResult.lines`, when verification ran.
        source_paths: folders of the base (first) and expert models, read for their license.
        sources: reference -> folder of every model the recipe names, read for hub ids
            (``_name_or_path``); default: the references alone.
    """
    named = Sources(config, sources or {})
    bases = named.base_models()  # hub ids only: the hub rejects local paths in base_model
    license_keys, license_note = choose_license(list(source_paths))
    front = {
        **({"base_model": bases} if bases else {}),
        "base_model_relation": "merge",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        **(license_keys or {}),
        "tags": ["moe", plan.architecture, "upcycling", "moe-upcycle"],
    }
    front_text = yaml.safe_dump(front, sort_keys=False, allow_unicode=True).strip()
    if license_keys is None:
        front_text += "\n# license: (set the base model's license here; see the note below)"
    total, active = parameter_counts(plan)
    experts = config.expert_list()
    rows = "\n".join(f"| {i} | {cell(e.name)} | {cell(named.name(e.source_model))} | {len(e.positive_prompts)} | "
                     f"{cell(_changes(e))} |" for i, e in enumerate(experts))
    shared = "".join(f"| shared {i} | {cell(e.name or '-')} | {cell(named.name(e.source_model))} | {len(e.positive_prompts)} "
                     f"| {cell(_changes(e))} |\n" for i, e in enumerate(config.shared_experts))
    local = named.local()
    local_note = (f"\nMade from {len(local)} local model(s) with no hub id ("
                  f"{', '.join(named.name(r) for r in local)}), so `base_model` lists "
                  f"{'only the hub models' if bases else 'none'}; add their hub ids before publishing if they are "
                  f"published.\n" if local else "")
    how = "\n".join(making_of(config))
    recipe = yaml.safe_dump(_public_recipe(config, named), sort_keys=False, allow_unicode=True)
    verify = "\n".join(named.without_paths(line, sources or {}) for line in verify_lines) if verify_lines else "Not run. Run `moe-upcycle verify <this folder>` to check it."
    stored = ("stored twice: llama.cpp requires output.weight" if any(st.name == names.LM_HEAD for st in plan.steps)
              else "stored once")
    tied = f"\nThe input and output embeddings are tied ({stored}).\n" if plan.tied_embeddings else ""
    note = f"\n> **License:** {license_note}\n" if license_note else ""
    return f"""---
{front_text}
---

# {plan.architecture} MoE upcycled from {named.plain(config.base_model)}
{note}{local_note}
Built with moe-upcycle {__version__}: {len(experts)} experts,
{plan.experts_per_token} active per token, gate mode `{config.gate_mode}`, dtype `{str(plan.dtype).removeprefix("torch.")}`.

| parameters | count |
|---|---|
| total | {readable_count(total)} |
| active per token | {readable_count(active)} |
{tied}
## Experts

| # | name | source model | positive prompts | changes |
|---|------|--------------|------------------|---------|
{rows}
{shared}
## How the experts were made

{how}

## Recipe

```yaml
{recipe.strip()}
```

## Verification

{verify}

{runtime_section(plan)}

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
inputs = tokenizer("Once upon a time", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=32)[0]))
```
"""


def _public_recipe(config: UpcycleConfig, named: Sources) -> dict:
    """The recipe for the card: local folders shown by name only (the full paths are in moe_upcycle.json)."""
    data = config.model_dump(mode="json", exclude_defaults=True)
    shown = {ref: named.shown(ref) for ref in named.refs}
    data["base_model"] = shown.get(data["base_model"], data["base_model"])
    for key in ("experts", "shared_experts"):
        for e in data.get(key, []):
            e["source_model"] = shown.get(e["source_model"], e["source_model"])
    if data.get("output"):
        data["output"] = Path(data["output"]).name
    return data


def _changes(expert) -> str:
    parts = []
    if expert.noise_scale:
        parts.append(f"noise {expert.noise_scale:g}")
    if expert.residual_scale is not None and expert.residual_scale != 1.0:
        parts.append(f"down_proj x{expert.residual_scale:g}")
    if expert.expert_init is not None:
        parts.append(f"init {expert.expert_init.method}")
    return ", ".join(parts) or "none"


def write_model_card(folder: Path, config: UpcycleConfig, plan: Plan, verify_lines: Optional[list[str]] = None,
                     source_paths: Sequence[Path] = (), sources: Optional[Mapping[str, Optional[Path]]] = None) -> None:
    (folder / "README.md").write_text(model_card(config, plan, verify_lines, source_paths, sources), encoding="utf-8")
