"""`prompts grow` keeps the user's YAML as written and reads pools as paragraphs, lines or JSONL."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from typer.testing import CliRunner

from moe_upcycle.cli import app
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.recipe.rewrite import write_grown_config
from moe_upcycle.errors import ConfigError
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
    inst = tmp_path / "inst.txt"  # starts with '[' but is not JSON: lines, as before
    inst.write_text("[INST] Write a poem [/INST]\n[INST] Sort a list [/INST]\n")
    assert read_pool_file(inst).format == "lines" and read_pool_file(inst).prompts[1] == "[INST] Sort a list [/INST]"


@pytest.mark.parametrize("name, body, fmt", [
    ("pool.json", json.dumps([{"text": "Sort a list in Python"}, {"prompt": "Solve 2x = 8"}]), "json"),
    ("strings.json", json.dumps(["Sort a list in Python", "Solve 2x = 8"]), "json"),
    ("spread.txt", '[\n  "Sort a list in Python",\n  "Solve 2x = 8"\n]\n', "json"),
    ("pool.csv", 'id,Text,label\n1,Sort a list in Python,code\n2,"Solve 2x = 8",math\n', "csv"),
    ("pool.tsv", "prompt\tlabel\nSort a list in Python\tcode\nSolve 2x = 8\tmath\n", "tsv"),
    ("alpaca.jsonl", json.dumps({"instruction": "Sort a list in Python", "input": "", "output": "sorted(x)"}) + "\n"
     + json.dumps({"question": "Solve 2x = 8", "answer": "4"}) + "\n", "jsonl"),
    ("chat.jsonl", json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Sort a list in Python"},
                                            {"role": "assistant", "content": "sorted(x)"}]}) + "\n"
     + json.dumps({"conversations": [{"from": "human", "value": "Solve 2x = 8"}, {"from": "gpt", "value": "4"}]})
     + "\n", "jsonl"),
])
def test_pool_records_of_common_dataset_shapes(name, body, fmt, tmp_path):
    """Before: a JSON list or a CSV file was read as lines, so `[{"text": ...}]` or the header row `id,Text,label`
    became a candidate prompt; Alpaca and chat records were refused."""
    path = tmp_path / name
    path.write_text(body)
    pool = read_pool_file(path)
    assert (pool.format, pool.prompts) == (fmt, ["Sort a list in Python", "Solve 2x = 8"])


@pytest.mark.parametrize("name, body, words", [
    ("obj.json", json.dumps({"data": [{"text": "a"}]}), ["obj.json: a JSON object, not a list of prompts",
                                                         "the prompts may be its 'data' list"]),
    ("bad.csv", "id,label\n1,code\n", ["bad.csv: its header row names no prompt column (columns: 'id', 'label')",
                                         "text, prompt, instruction"]),
    ("nums.json", "[1, {\"text\": \"ok\"}]", ["nums.json: item 0: a JSON int, not a record"]),
    ("chat.jsonl", json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n",
     ["chat.jsonl:1: its 'messages' list has no user turn with text"]),
    ("pretty.jsonl", '{\n  "text": "a"\n}\n', ["pretty.jsonl:1: not valid JSON",
                                                 "a record spread over lines is JSON: name the file .json"]),
    ("data.parquet", "PAR1\x00\x15\x04", ["data.parquet: not UTF-8 text: it holds NUL bytes", "Parquet",
                                            "export its prompts as JSONL or CSV"]),
    ("utf16.txt", "Sort a list".encode("utf-16-le").decode("latin-1"), ["not UTF-8 text: it holds NUL bytes",
                                                                         "UTF-16 without a byte-order mark"]),
])
def test_pool_files_that_hold_no_prompts_as_read_are_named(name, body, words, tmp_path):
    path = tmp_path / name
    path.write_bytes(body.encode("latin-1") if "\x00" in body else body.encode())
    with pytest.raises(ConfigError) as info:
        read_pool_file(path)
    text = " ".join(info.value.problems)
    for w in words:
        assert w in text, text


def test_prompt_files_read_records_as_the_pool_does(tmp_path):
    """`positive_prompts_from: prompts.jsonl` gave the JSON text of each line as a prompt."""
    from moe_upcycle.recipe.prompt_sets import read_prompt_file

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"instruction": "Sort a list"}) + "\n" + json.dumps({"text": "Solve 2x = 8"}) + "\n")
    csv_file = tmp_path / "p.csv"
    csv_file.write_text("prompt,label\nSort a list,code\n\"Solve 2x = 8, for x\",math\n")
    records = tmp_path / "p.yaml"
    records.write_text("prompts:\n  - text: Sort a list\n  - Solve 2x = 8\n")
    assert read_prompt_file(jsonl) == ["Sort a list", "Solve 2x = 8"]
    assert read_prompt_file(csv_file) == ["Sort a list", "Solve 2x = 8, for x"]
    assert read_prompt_file(records) == ["Sort a list", "Solve 2x = 8"]


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
    bad = runner.invoke(app, ["prompts", "grow", str(src), "--pool", str(pool), "--pool-format", "xml"])
    assert bad.exit_code == 1 and "--pool-format: 'xml' is not a format" in bad.stderr


HOSTILE_PROMPTS = ["How do I sort by two columns?", "a, b", "[x]", "{y}", "key: value", "# not a comment", "*star",
                   "&anchor", "!tag", "%pct", "@at", "`tick", "'single'", '"double"', "trailing space ", " leading",
                   "yes", "No", "ON", "null", "~", "0x10", "12:30", "2024-01-01", "1_000", "-dash", "? q", "colon:",
                   "ends with #", "a ] b", "x #y", "<<", "|pipe", ">gt", "tab\there", "C:\\path\\file", "\u00a0nbsp",
                   "don't stop", "What is 7 squared?", "写一首诗 🙂", "", "def f(x):\n    return x\n", " indented\ncode",
                   "a\n\n\nb"]
LIST_STYLES = {
    "flow": "experts:\n  - source_model: m\n    positive_prompts: [\"a\"]\n",
    "block": "experts:\n  - source_model: m\n    positive_prompts:\n      - a\n",
    "block flush with its key": "experts:\n- source_model: m\n  positive_prompts:\n  - a\n",
    "one prompt as a string": "experts:\n- source_model: m\n  positive_prompts: a\n",
    "no list yet": "experts:\n- source_model: m\n",
}


def test_added_prompts_read_back_exactly_in_every_list_style():
    """Every added prompt is read back (by PyYAML, which reads recipes) as exactly the text picked, whatever the
    list's style. Before: in a flow list [...] 'How do I sort by two columns?' made the YAML unparsable (a
    traceback from `prompts grow`), and in any list 'yes' / 'No' / 'ON' came back as booleans and '? q' as a
    mapping: ruamel writes YAML 1.2, where those are plain text."""
    import yaml

    from moe_upcycle.recipe.yaml_write import add_prompts

    for style, text in LIST_STYLES.items():
        out = add_prompts(text, {0: HOSTILE_PROMPTS})
        before = [] if style == "no list yet" else ["a"]
        assert yaml.safe_load(out)["experts"][0]["positive_prompts"] == before + HOSTILE_PROMPTS, (style, out)
    flow = add_prompts(LIST_STYLES["flow"], {0: ["plain words", "How do I sort by two columns?", "yes"]})
    assert 'positive_prompts: ["a", plain words, "How do I sort by two columns?", "yes"]' in flow  # bare where safe


def test_grow_on_a_flow_style_recipe_writes_what_it_picked(tiny_llama, tmp_path):
    """`prompts grow` on a recipe whose prompts are flow lists (positive_prompts: ["..."]) with the shipped pool,
    whose prompts end in '?': exit 0, and the grown recipe loads with the picks appended (before: a YAML
    ParserError traceback, nothing written)."""
    src = tmp_path / "flow.yaml"
    src.write_text(f"base_model: {tiny_llama}\ngate_mode: cheap_embed\nexperts:\n"
                   f"  - source_model: {tiny_llama}\n    positive_prompts: [\"write a python function that sorts a list\"]\n"
                   f"  - source_model: {tiny_llama}\n    positive_prompts: [\"tell me a bedtime story about a dragon\"]\n")
    result = runner.invoke(app, ["prompts", "grow", str(src), "--pool", str(POOL)])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    grown = load_config(tmp_path / "flow.grown.yaml").expert_list()
    pool = set(read_pool_file(POOL).prompts)
    added = [p for e in grown for p in e.positive_prompts[1:]]
    assert added and set(added) <= pool, added
    assert any(p.endswith("?") for p in added), added  # the shipped pool's questions, the case that broke


def test_a_grown_list_shared_through_an_alias_grows_only_where_grown(tiny_llama, tmp_path):
    """Expert 0's positive prompts are anchored (&code) and reused as expert 1's negative prompts (*code): the
    picks for expert 0 are added to expert 0 only. Before, they also became expert 1's negatives, silently."""
    src = tmp_path / "alias.yaml"
    src.write_text(f"base_model: {tiny_llama}\ngate_mode: cheap_embed\nexperts:\n"
                   f"  - source_model: {tiny_llama}\n    name: code\n    positive_prompts: &code\n"
                   f"      - write a python function that sorts a list\n"
                   f"  - source_model: {tiny_llama}\n    name: story\n    positive_prompts: [a bedtime story]\n"
                   f"    negative_prompts: *code\n")
    out = write_grown_config(src, {"code": ["Fix this loop.", "yes"], "story": ["Tell me about dragons?"]})
    experts = {e.name: e for e in load_config(out).expert_list()}
    assert experts["code"].positive_prompts == ["write a python function that sorts a list", "Fix this loop.", "yes"]
    assert experts["story"].negative_prompts == ["write a python function that sorts a list"]
    assert experts["story"].positive_prompts == ["a bedtime story", "Tell me about dragons?"]


def test_a_windows_recipe_stays_crlf_with_its_byte_order_mark(tiny_llama, tmp_path):
    """A recipe saved by Notepad (BOM, CRLF) is written back with both, every line CRLF, and loads with the picks;
    before, the grown file was LF without the BOM."""
    src = tmp_path / "win.yaml"
    text = (f"base_model: {tiny_llama}\ngate_mode: cheap_embed\nexperts:\n  - source_model: {tiny_llama}\n"
            f"    name: code\n    positive_prompts:\n      - write code\n  - source_model: {tiny_llama}\n"
            f"    name: story\n    positive_prompts: [a story]\n")
    src.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    out = write_grown_config(src, {"code": ["def f():\n    return 1"], "story": ["Once upon a time?"]})
    raw = out.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf") and raw.count(b"\n") == raw.count(b"\r\n") > 10
    experts = {e.name: e for e in load_config(out).expert_list()}
    assert experts["code"].positive_prompts == ["write code", "def f():\n    return 1"]
    assert experts["story"].positive_prompts == ["a story", "Once upon a time?"]


def test_in_place_through_a_symlink_updates_the_recipe_and_keeps_the_link(tiny_llama, tmp_path):
    """`grow current.yaml --in-place`, current.yaml a link to v3.yaml: v3.yaml gets the picks and the link stays
    a link (before, the link was replaced by a regular file and v3.yaml was left as it was)."""
    real = tmp_path / "v3.yaml"
    real.write_text(f"base_model: {tiny_llama}\ngate_mode: cheap_embed\nexperts:\n  - source_model: {tiny_llama}\n"
                    f"    name: code\n    positive_prompts: [write code]\n  - source_model: {tiny_llama}\n"
                    f"    name: story\n    positive_prompts: [a story]\n")
    link = tmp_path / "current.yaml"
    link.symlink_to(real.name)
    out = write_grown_config(link, {"code": ["Fix this bug."]}, in_place=True)
    assert out == real and link.is_symlink() and link.resolve() == real
    assert load_config(real).expert_list()[0].positive_prompts == ["write code", "Fix this bug."]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current.yaml", "v3.yaml"]  # no temporary file left


def test_in_place_keeps_the_recipes_permissions(tiny_llama, tmp_path):
    """A private (0600) or group-writable (0664) recipe keeps its mode when grown in place (before: the new file
    got the umask's default, 0644)."""
    src = tmp_path / "private.yaml"
    src.write_text(f"base_model: {tiny_llama}\ngate_mode: cheap_embed\nexperts:\n  - source_model: {tiny_llama}\n"
                   f"    name: code\n    positive_prompts: [write code]\n  - source_model: {tiny_llama}\n"
                   f"    name: story\n    positive_prompts: [a story]\n")
    for mode in (0o600, 0o664):
        src.chmod(mode)
        write_grown_config(src, {"code": [f"Fix bug {mode}."]}, in_place=True)
        assert src.stat().st_mode & 0o777 == mode
        # the new NAME.grown.yaml beside it gets the recipe's mode too: a private recipe's prompts stay private
        grown = write_grown_config(src, {"code": [f"Grow {mode}."]}, output=tmp_path / f"grown-{mode:o}.yaml")
        assert grown.stat().st_mode & 0o777 == mode
    src.chmod(0o444)  # a read-only recipe (a checkout, chmod a-w): the new file is the owner's to edit
    grown = write_grown_config(src, {"code": ["Grow read-only."]}, output=tmp_path / "grown-ro.yaml")
    assert grown.stat().st_mode & 0o777 == 0o644
