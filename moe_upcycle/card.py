"""The output's README.md model card, with Hugging Face hub front matter.

Written from the config and plan only (plus verification results when given); it reads no tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from .config import UpcycleConfig
from .plan import Plan


def parameter_counts(plan: Plan) -> tuple[int, int]:
    """(total, active per token) parameters of the output model."""
    total = active = 0
    n_experts = len(plan.expert_names)
    for step in plan.steps:
        n = 1
        for d in step.shape:
            n *= d
        total += n
        active += n * plan.experts_per_token // n_experts if step.kind == "expert" else n
    return total, active


def model_card(config: UpcycleConfig, plan: Plan, verify_lines: Optional[list[str]] = None) -> str:
    """The model card text."""
    bases = list(dict.fromkeys([config.base_model] + [e.source_model for e in config.experts]))
    front = {
        "base_model": bases,
        "base_model_relation": "merge",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["moe", plan.architecture, "upcycling", "moe-upcycle"],
    }
    total, active = parameter_counts(plan)
    experts = config.expert_list()
    rows = "\n".join(f"| {i} | {e.name} | {e.source_model} | {len(e.positive_prompts)} |" for i, e in enumerate(experts))
    recipe = yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True), sort_keys=False, allow_unicode=True)
    verify = "\n".join(verify_lines) if verify_lines else "Not run. Run `moe-upcycle verify <this folder>` to check it."
    return f"""---
{yaml.safe_dump(front, sort_keys=False).strip()}
---

# {plan.architecture} MoE upcycled from {config.base_model}

Built with [moe-upcycle](https://pypi.org/project/moe-upcycle/): {len(experts)} experts,
{plan.experts_per_token} active per token, gate mode `{config.gate_mode}`.
Parameters: {total / 1e6:.2f}M total, {active / 1e6:.2f}M active per token.

## Experts

| # | name | source model | positive prompts |
|---|------|--------------|------------------|
{rows}

## Recipe

```yaml
{recipe.strip()}
```

## Verification

{verify}

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
```
"""


def write_model_card(folder: Path, config: UpcycleConfig, plan: Plan, verify_lines: Optional[list[str]] = None) -> None:
    (folder / "README.md").write_text(model_card(config, plan, verify_lines), encoding="utf-8")
