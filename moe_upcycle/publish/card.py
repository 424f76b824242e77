"""The output's README.md model card, with Hugging Face hub front matter.

Written from the config and plan only (plus verification results when given, and the source
models' README.md/config.json for their license); it reads no tensors. The parameter counts come
from `planning.plan_report.parameter_counts`, as in ``moe-upcycle plan``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping, Optional, Sequence

import yaml

from moe_upcycle import __version__
from moe_upcycle.dtypes import dtype_name
from moe_upcycle.planning.plan_report import parameter_counts, readable_count
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.layer_words import moe_and_dense_said
from moe_upcycle.recipe.schema import UpcycleConfig
from moe_upcycle.planning.runtimes import runtime_section
from moe_upcycle.publish import grow_card
from moe_upcycle.publish.card_facts import Sources, cell, making_of
from moe_upcycle.publish.card_recipe import recipe_block
from moe_upcycle.recipe.mergekit_names import semantics_note

LICENSE_KEYS = ("license", "license_name", "license_link")
# the hub's license ids (https://huggingface.co/docs/hub/repositories-licenses): a card's `license:` is one of them
HUB_LICENSES = frozenset("""
apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0 bigcode-openrail-m afl-3.0
artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc cc0-1.0 cc-by-2.0 cc-by-2.5 cc-by-3.0
cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0 cc-by-nc-nd-3.0 cc-by-nc-nd-4.0
cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0 cdla-permissive-1.0 cdla-permissive-2.0 wtfpl
ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl lgpl-2.1 lgpl-3.0 isc lppl-1.3c
ms-pl mpl-2.0 odc-by odbl openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr
deepfloyd-if-license llama2 llama3 llama3.1 llama3.2 llama3.3 gemma unknown other
""".split())


def read_license(folder: Path) -> Optional[dict]:
    """A model folder's license as the hub takes it (`stated_license`), or None when it states none it can use.

    Returns:
        ``{"license": ...}`` plus ``license_name``/``license_link`` when the card gives them.
    """
    return stated_license(folder)[0]


def stated_license(folder: Path) -> tuple[Optional[dict], str]:
    """(a folder's license keys for the card's front matter, or None; what it states that the hub cannot take, or '').

    Read from its README.md front matter, else its config.json. A hub license is one id such as
    ``apache-2.0`` (`HUB_LICENSES`): a name written otherwise ("Apache 2.0", "MIT", "Llama 3.1") becomes
    its id, a one-item list its item; a value that names no id (several licenses, a mapping, an unknown
    name) is not copied, and is returned for the card's note.
    """
    front: dict = {}
    card = folder / "README.md"
    if card.is_file():
        try:
            text = card.read_text(encoding="utf-8", errors="replace")
        except OSError:  # unreadable: the card says to set the license, as for a card without one
            text = ""
        if text.startswith("---"):
            end = text.find("\n---", 3)
            try:
                loaded = yaml.safe_load(text[3:end]) if end > 0 else None
            except (yaml.YAMLError, RecursionError):
                loaded = None
            front = loaded if isinstance(loaded, dict) and loaded.get("license") is not None else {}
    if not front:
        config = folder / "config.json"
        try:
            loaded = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except (OSError, ValueError, RecursionError):
            loaded = {}
        front = {"license": loaded.get("license")} if isinstance(loaded, dict) else {}
    value = front.get("license")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if value is None or isinstance(value, str) and not value.strip():
        return None, ""
    hub_id = hub_license(value) if isinstance(value, str) else None
    if hub_id is None:
        return None, _shown_value(value)
    extra = {k: front[k] for k in LICENSE_KEYS[1:] if isinstance(front.get(k), str) and front[k].strip()}
    return {"license": hub_id, **extra}, ""


def hub_license(value: str) -> Optional[str]:
    """The hub license id a license name stands for, or None.

    Example:
        >>> hub_license("Apache 2.0"), hub_license("llama-3.1"), hub_license("apache"), hub_license("my terms")
        ('apache-2.0', 'llama3.1', None, None)
    """
    if value in HUB_LICENSES:
        return value
    words = re.sub(r"\b(the|licen[cs]e|version)\b", " ", value.strip().lower())
    slug = re.sub(r"-{2,}", "-", re.sub(r"[\s_/,;:()]+", "-", words.strip())).strip("-")
    for candidate in (slug, slug.replace("-v", "-"), re.sub(r"-(?=\d)", "", slug)):  # apache-v2.0, llama-3.1
        if candidate in HUB_LICENSES:
            return candidate
    return None


def _shown_value(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip().removesuffix("...").strip()
    return text if len(text) <= 80 else text[:77] + "..."


def choose_license(sources: Sequence[tuple[str, Path]]) -> tuple[Optional[dict], str]:
    """The license of the output: the base's (first) when every source that states one agrees.

    Args:
        sources: (name shown in the card, folder) of the base, then of each other source; the name is a
            hub id or ``local model NAME``, never a path (the card is published).

    Returns:
        (front matter keys or None, a note for the card when the user must set it).
    """
    found = [(name, *stated_license(path)) for name, path in sources]
    stated = [(name, keys) for name, keys, _ in found if keys]
    unusable = [(name, said) for name, keys, said in found if said]
    base = found[0][1] if found else None
    if base and not unusable and all(keys["license"] == base["license"] for _, keys in stated):
        return base, ""
    if unusable:
        listed = ", ".join(f"{name}: {said}" for name, said in unusable)
        return None, (f"A source model states a license that is not one Hugging Face Hub license id ({listed}): "
                      f"set `license:` in the front matter to the id that applies "
                      f"(https://huggingface.co/docs/hub/repositories-licenses; `other` with `license_name` for "
                      f"one not listed) before publishing.")
    if not stated:
        return None, ("No license was found in the base model's README.md or config.json: set `license:` in the "
                      "front matter to the base model's license before publishing.")
    listed = ", ".join(f"{name}: {keys['license']}" for name, keys in stated)
    return None, (f"The source models state different licenses ({listed}): set `license:` in the front matter "
                  f"to one that satisfies all of them before publishing.")


def model_card(config: UpcycleConfig, plan: Plan, verify_lines: Optional[list[str]] = None,
               sources: Optional[Mapping[str, Optional[Path]]] = None,
               self_check_lines: Optional[list[str]] = None) -> str:
    """The model card text.

    Args:
        config: the recipe as used.
        plan: the build plan (architecture, experts, parameter counts).
        verify_lines: markdown from `verify.VerifyResult.lines`, when verification ran.
        sources: reference -> folder of every model the recipe names, the base first, read for hub ids
            (``_name_or_path``) and licenses; default: the references alone.
        self_check_lines: markdown from `self_check_card.self_check_lines`, when the build made the self-check.
    """
    named = Sources(config, sources or {})
    bases = named.base_models()  # hub ids only: the hub rejects local paths in base_model
    license_keys, license_note = choose_license([(named.plain(ref), path) for ref, path in (sources or {}).items()
                                                 if path is not None])
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
    how = "\n".join(grow_card.making_of(plan) if plan.grow else making_of(config))
    heading = f"{plan.architecture} MoE upcycled from {named.plain(config.base_model)}"
    router = f"gate mode `{config.gate_mode}`"
    if plan.grow:  # a grown MoE: its experts are the base's and their copies (`grow_card`)
        rows = grow_card.expert_rows(config, plan, named.name, cell)
        heading, router = grow_card.title(plan, named.plain(config.base_model)), grow_card.router_words(plan)
    recipe = recipe_block(config, plan, named.shown)
    notes = "\n".join(f"- {named.without_paths(n, sources or {})}" for n in build_notes(config, plan))
    notes = f"\n## Notes from the build\n\n{notes}\n" if notes else ""
    verify = "\n".join(named.without_paths(line, sources or {}) for line in verify_lines) if verify_lines else "Not run. Run `moe-upcycle verify <this folder>` to check it."
    routing = ("\n## Routing self-check\n\n" + "\n".join(self_check_lines) + "\n") if self_check_lines else ""
    stored = "stored twice: llama.cpp requires output.weight" if plan.tied_head_written else "stored once"
    tied = f"\nThe input and output embeddings are tied ({stored}).\n" if plan.tied_embeddings else ""
    note = f"\n> **License:** {license_note}\n" if license_note else ""
    return f"""---
{front_text}
---

# {heading}
{note}{local_note}
Built with moe-upcycle {__version__}: {len(plan.expert_names)} experts,
{plan.experts_per_token} active per token, {router}, dtype `{dtype_name(plan.dtype)}`.{_layers(plan)}

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
{notes}{routing}
## Recipe

Every key, with the value this build used (`# default`: not set in the recipe). Local models and files are
named by folder or file name only; `moe_upcycle.json` beside this card records their paths relative to this
folder, for `moe-upcycle verify` on the machine that built it. The same recipe and seed give the same files.

```yaml
{recipe}
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


def build_notes(config: UpcycleConfig, plan: Plan) -> list[str]:
    """What the build said about the model (the plan's notes and cautions, and the note for a mergekit config built
    with moe-upcycle's router semantics), each once."""
    note = semantics_note(config)
    return list(dict.fromkeys([*plan.notes, *([note] if note else [])]))


def _layers(plan: Plan) -> str:
    """Where the experts are, when some layers keep the dense MLP (``moe_layers:``)."""
    if not plan.dense_layers:
        return ""
    return f"\n{moe_and_dense_said(plan.moe_layers, plan.num_layers)}."


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
                     sources: Optional[Mapping[str, Optional[Path]]] = None,
                     self_check_lines: Optional[list[str]] = None) -> None:
    (folder / "README.md").write_text(model_card(config, plan, verify_lines, sources, self_check_lines),
                                      encoding="utf-8")
