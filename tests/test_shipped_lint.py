"""The lint is quiet about the shipped frankenMoE recipe's prompt sets as shipped: a new user who builds it sees no
prompt warning (three code prompts that all-MiniLM-L6-v2 read as requests for math or writing were reworded)."""

from __future__ import annotations

from pathlib import Path

from moe_upcycle.prompts.embed import load_embedder
from moe_upcycle.prompts.lint import lint_config
from moe_upcycle.recipe.resolve import expert_prompts
from moe_upcycle.recipe.schema import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_frankenmoe_prompt_sets_lint_clean():
    config = load_config(ROOT / "gate_configs" / "frankenmoe_4x_prompts.yaml")
    report = lint_config(expert_prompts(config.expert_list()), load_embedder())
    assert [e.name for e in report.experts] == ["chat", "code", "math", "writer"]
    assert report.problems() == []
