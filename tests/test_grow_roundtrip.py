"""`prompts grow` keeps the user's YAML as written and reads pools as paragraphs, lines or JSONL."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from moe_upcycle.cli import app
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.recipe.rewrite import write_grown_config
from moe_upcycle.prompts.pool import read_pool_file

runner = CliRunner()
POOL = Path(__file__).resolve().parent / "data" / "pool.jsonl"

RECIPE = """\
# My frankenMoE: keep this comment
base_model: {base}   # the dense base
gate_mode: cheap_embed
experts:
  - source_model: {base}
    name: code            # programming
    positive_prompts:
      - "Write a Python function that reverses a string."
      - 'Fix the off-by-one error in this loop.'
  - source_model: {base}
    name: math
    positive_prompts_from: math   # a shipped set
"""

CODE_BLOCK = "Why does this fail?\n\n```python\ndef add(a, b):\n    return a +\n```"


def test_grown_yaml_keeps_comments_quotes_and_layout(tiny_llama, tmp_path):
    src = tmp_path / "experts.yaml"
    src.write_text(RECIPE.format(base=tiny_llama))
    picks = {"code": ["Explain this stack trace.", "def f():\n    return 1"], "math": ["What is 7 squared?"]}
    out = write_grown_config(src, picks)
    text = out.read_text()
    before = RECIPE.format(base=tiny_llama).splitlines()
    # every line the user wrote is still there, in order, comments and quotes included
    lines, at = text.splitlines(), 0
    for line in before:
        at = lines.index(line, at) + 1  # raises when a line is missing or out of order
    assert "# My frankenMoE: keep this comment" in text and "name: code            # programming" in text
    assert "      - 'Fix the off-by-one error in this loop.'" in text
    # additions: plain, a literal block for the multi-line prompt, a new list after positive_prompts_from
    assert "      - Explain this stack trace.\n      - |-\n        def f():\n            return 1\n" in text
    assert "    positive_prompts_from: math   # a shipped set\n    positive_prompts:\n      - What is 7 squared?" in text
    grown = load_config(out)
    experts = {e.name: e for e in grown.expert_list()}
    assert experts["code"].positive_prompts[-2:] == ["Explain this stack trace.", "def f():\n    return 1"]
    assert experts["math"].positive_prompts[0] == "What is 7 squared?"  # listed prompts come before the set's
    assert len(experts["math"].positive_prompts) == len(load_config(src).expert_list()[1].positive_prompts) + 1


def test_pool_formats(tmp_path):
    paragraphs = tmp_path / "pool.txt"
    paragraphs.write_text(f"What is 2 + 2?\n\n{CODE_BLOCK.replace(chr(10) * 2, chr(10))}\n\n\nTell me a story.\n")
    pool = read_pool_file(paragraphs)
    assert pool.format == "paragraphs"
    assert pool.prompts == ["What is 2 + 2?", "Why does this fail?\n```python\ndef add(a, b):\n    return a +\n```",
                            "Tell me a story."]
    assert pool.describe(paragraphs) == "3 candidates from pool.txt, read as paragraphs (blank-line separated)"
    lines = tmp_path / "lines.txt"
    lines.write_text("one prompt\nanother prompt\n")
    assert read_pool_file(lines).format == "lines" and read_pool_file(lines).prompts == ["one prompt", "another prompt"]
    assert read_pool_file(POOL).format == "jsonl" and len(read_pool_file(POOL).prompts) == 16


def test_cli_says_which_pool_format_it_used(tiny_llama, tmp_path):
    src = tmp_path / "experts.yaml"
    src.write_text(RECIPE.format(base=tiny_llama))
    pool = tmp_path / "pool.txt"
    pool.write_text("Write a Rust function that parses an integer.\n\nWhat is the integral of x^2?\n")
    result = runner.invoke(app, ["prompts", "grow", str(src), "--pool", str(pool)])
    assert result.exit_code == 0, result.output
    assert "Pool: 2 candidates from pool.txt, read as paragraphs (blank-line separated)." in result.stdout
    text = (tmp_path / "experts.grown.yaml").read_text()
    assert text.startswith("# My frankenMoE: keep this comment\n")
    result = runner.invoke(app, ["prompts", "grow", str(src), "--pool", str(pool), "--pool-format", "lines",
                                 "-o", str(tmp_path / "b.yaml")])
    assert result.exit_code == 0 and "read as lines (one prompt per line)" in result.stdout
    bad = runner.invoke(app, ["prompts", "grow", str(src), "--pool", str(pool), "--pool-format", "csv"])
    assert bad.exit_code == 1 and "--pool-format: 'csv' is not a format" in bad.stderr
