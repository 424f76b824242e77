"""Read a recipe's YAML so that it means exactly one thing, in bounded time and memory.

`yaml.safe_load` has two traps for a recipe: a key written twice in one mapping silently keeps
the last value, and anchors/aliases can describe a "billion laughs" tree that is tiny on disk
but huge once anything walks it (validation, or formatting an error message that quotes it).

`load_recipe_yaml` composes the YAML into nodes first (aliases stay shared, so this is linear in
the file), then walks the node graph once, counting how many values the document expands to —
memoised per node, so a bomb is measured without being expanded — and refuses:

- a key repeated in one mapping, naming the key and both lines;
- a document that expands to more than `MAX_VALUES` values, or an alias that contains itself;
- a file larger than `MAX_FILE_BYTES`.

Only then are Python objects built. `load_yaml_text` does the same for any YAML text (prompt
files). It does not validate the recipe: that is `config`'s job.

Syntax errors and non-UTF-8 files are reported with the fix for what a config pasted from a web
page or model card typically has: tabs, look-alike spaces, Markdown fences, front matter, a line
of plain text above the config (an editor's title bar), a key glued to its value or indented
out of line with its neighbours, values starting with ``*``/``@``/`` ` ``,
UTF-16 or legacy encodings. A UTF-8 BOM and CRLF are read as mergekit-moe reads them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from moe_upcycle.errors import ConfigError
from moe_upcycle.inputs.text import encoding_hint

MAX_VALUES = 200_000  # a recipe with 1,000 experts of 100 prompts each is ~100k values
MAX_FILE_BYTES = 16 * 2**20


def load_recipe_yaml(path: Path) -> Any:
    """Parse the recipe at `path` (UTF-8 YAML) into plain Python objects.

    Raises:
        ConfigError: unreadable or oversized file, not UTF-8 (with the likely encoding), YAML syntax
            error (line, column, and the fix for tabs and look-alike spaces), a duplicate key, or an
            alias expansion that is too large or recursive.
        yaml.YAMLError, RecursionError: left to the caller, which names the file.
    """
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: the recipe is {size} bytes; a recipe is a small YAML file (at most "
                          f"{MAX_FILE_BYTES} bytes) — is this the right file?")
    data = path.read_bytes()
    if b"\x00" in data and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{path}: not a readable YAML file: a binary file (it holds NUL bytes), not a recipe; "
                          f"give the experts.yaml file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file ({encoding_hint(data, exc)}); re-save it as UTF-8 "
                          f"(in Notepad: Save as → Encoding: UTF-8)") from None
    lines = text.splitlines()
    bullets = sorted({n for n, line in enumerate(lines) if _BULLET_ITEM.match(line)} | set(_bulleted_prompts(lines)))
    if bullets:  # YAML reads them as keys named '• source_model', a duplicate key, or one prompt of every line
        raise ConfigError(f"{path}:{bullets[0] + 1}: {_syntax_hint(lines, bullets[0] + 1, '')}")
    try:
        parsed = load_yaml_text(text, str(path))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        if mark is None:
            raise
        hint = _syntax_hint(text.splitlines(), mark.line, str(exc.problem or ""))
        raise ConfigError(f"{path}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {exc.problem or exc}"
                          f"{'; ' + hint if hint else ''}") from None
    return parsed


# whitespace that looks like a space but is not one to YAML (pasted from web pages and CJK input methods)
_ODD_SPACES = {"\u00a0": "a non-breaking space (U+00A0)", "\u3000": "an ideographic space (U+3000)",
               "\u2002": "an en space (U+2002)", "\u2003": "an em space (U+2003)", "\u200b": "a zero-width space (U+200B)"}


# `• source_model: x`: a list item whose dash a rendered page (or a word processor) turned into a bullet
_BULLET = re.compile(r"^(\s*)[\u2022\u25e6\u25aa\u2023\u25cf\u2219\u00b7\u2013\u2014\u2012\u2212]\s+(?=[\w\"'])")


# the same where it is surely a bulleted recipe line, a key or a quoted prompt (a prompt may start with a bullet)
_BULLET_ITEM = re.compile(_BULLET.pattern + r"(?:[\"']|(?:source_model|positive_prompts|negative_prompts|name|"
                          r"noise_scale|residual_scale|expert_init|layers)\s*:)")


# `positive_prompts:` (or any `*_prompts:`) with nothing after it: the line that opens a list of prompts
_PROMPTS_KEY = re.compile(r"^\s*(?:-\s+)?\w*prompts\s*:\s*(?:#.*)?$")


def _bulleted_prompts(lines: list[str]) -> list[int]:
    """Lines under a `*_prompts:` key that start with a bullet instead of '-': YAML reads them all as one string
    ('• a • b'), which the recipe's check would then call a bare string and quote back, bullets and all.

    Only where every line from the key down to it is such a bullet line: a dialogue dash continuing a quoted prompt
    (``- "Dialogue:`` then ``– Hello``) or a flow list (``[a,`` then ``– b]``) is text, and is left to YAML."""
    found = []
    for n, line in enumerate(lines):
        if not _BULLET.match(line):
            continue
        indent = len(line) - len(line.lstrip())
        above = [m for m in range(n - 1, -1, -1) if lines[m].strip() and not lines[m].lstrip().startswith("#")]
        parent = next((m for m in above if len(lines[m]) - len(lines[m].lstrip()) < indent), None)
        between = [m for m in above if parent is not None and m > parent]
        if parent is not None and _PROMPTS_KEY.match(lines[parent]) and all(_BULLET.match(lines[m]) for m in between):
            found.append(n)
    return found


# `base_model:org/x` or `- source_model:org/x`: a recipe key glued to its value (YAML needs ': ')
_GLUED_KEY = re.compile(r"^(\s*(?:-\s+)?)(base_model|gate_mode|dtype|experts_per_token|experts|shared_experts|"
                        r"architecture|source_model|positive_prompts|negative_prompts|residual_scale|noise_scale|"
                        r"num_experts):(\S.*)$")


def _syntax_hint(lines: list[str], index: int, problem: str) -> str:
    """What to change, for the mistakes a config pasted from a web page or model card typically has.

    `index` is the 0-based line the parser stopped at; it often notices one line late.
    """
    fences = [n + 1 for n, line in enumerate(lines) if line.lstrip().startswith(("```", "~~~"))]
    if fences:
        return f"line {fences[0]} is a Markdown code fence; copy only the YAML between the fences"
    bullet = next((n for n in (index - 1, index, index - 2) if 0 <= n < len(lines) and _BULLET.match(lines[n])), None)
    if bullet is not None:
        mark = lines[bullet].lstrip()[0]
        dashed = _BULLET.sub(lambda m: m.group(1) + "- ", lines[bullet], count=1).strip()
        return (f"line {bullet + 1} starts with {mark!r} (U+{ord(mark):04X}), a list bullet copied from a rendered page; "
                f"YAML list items start with '-': write {dashed}")
    if "another document" in problem:
        return ("the file holds more than one YAML document (a '---' line after the config starts, e.g. a model "
                "card's front matter); keep only the config")
    if "undefined alias" in problem:
        return "a value that starts with * is read as an alias (*name); put it in quotes"
    if "'@'" in problem or "'`'" in problem:
        return "YAML reserves @ and ` at the start of a value; put the value in quotes"
    if "mapping values are not allowed" in problem or "expected" in problem:
        for n in (index - 1, index, index - 2):  # the parser notices a glued 'key:value' a line or two late
            glued = _GLUED_KEY.match(lines[n]) if 0 <= n < len(lines) else None
            if glued and ": " not in lines[n]:
                return (f"line {n + 1} has no space after '{glued.group(2)}:', so YAML reads "
                        f"{lines[n].strip()!r} as text, not a key; write {'- ' if '-' in glued.group(1) else ''}{glued.group(2)}: "
                        f"{glued.group(3)}")
    if "mapping values are not allowed" in problem or "expected '<document start>'" in problem:
        stray = _stray_text_line(lines, index)
        if stray:
            return stray
    if "mapping values are not allowed" in problem or "expected <block end>" in problem:
        misaligned = _misaligned_key(lines, index)
        if misaligned:
            return misaligned
    for n in (index, index - 1):
        line = lines[n] if 0 <= n < len(lines) else ""
        if "\t" in line:
            return f"line {n + 1} has a tab; YAML indents with spaces and needs a space after 'key:' — replace the tab with spaces"
        for char, name in _ODD_SPACES.items():
            if char in line:
                return f"line {n + 1} contains {name}, often pasted from a web page; replace it with a normal space"
    return ""


def _stray_text_line(lines: list[str], index: int) -> str:
    """The fix when a 'key:' on line `index` follows a line of plain text (not 'key: value', a list item or a comment).

    YAML then reads the text and the next line as one multi-line value and stops at that line's colon (or,
    with a comment between them, reads the text as a whole document): text copied along with the config (an editor's title bar such as ``GNU nano 6.2 config.yml``, a
    code block's ``yaml`` label, a heading) or a value with a second ``: `` in it.
    """
    line = lines[index] if 0 <= index < len(lines) else ""
    n = index - 1
    while n >= 0 and (not lines[n].strip() or lines[n].lstrip().startswith("#")):
        n -= 1
    prev = lines[n].strip() if n >= 0 else ""
    if prev and ":" not in prev and not prev.startswith(("-", "[", "{", "'", '"', "&", "*", "|", ">")):
        shown = prev if len(prev) <= 60 else prev[:57] + "..."
        what = ("a code block's language label" if prev.lower() in ("yaml", "yml")
                else "text copied along with the config, such as an editor's title bar or a heading")
        return (f"line {n + 1} ({shown!r}) is not a 'key: value' line, so YAML cannot read the config below it; "
                f"it looks like {what}: delete line {n + 1}, or make it a comment with #")
    key, sep, value = line.partition(": ")
    if sep and ": " in value and not value.lstrip().startswith(("'", '"', "[", "{")):
        return (f"line {index + 1} has a second ': ' inside the value of {key.strip().lstrip('- ')}; "
                f"put the value in quotes")
    return ""


def _misaligned_key(lines: list[str], index: int) -> str:
    """The fix when the 'key:' line `index` is indented differently from the key on the line above it.

    Keys of one mapping line up; in a list item (``- source_model: x``) they line up with the first key,
    after the dash. Indented less, YAML ends the item there; indented more, it reads the line as part of
    the value above it (the usual slip when an expert's ``positive_prompts:`` is pasted).
    """
    line = lines[index] if 0 <= index < len(lines) else ""
    n = index - 1
    while n >= 0 and (not lines[n].strip() or lines[n].lstrip().startswith("#")):
        n -= 1
    if n < 0 or not re.match(r"^\s*[\w-]+:(\s|$)", line) or not re.match(r"^\s*(-\s+)?[\w-]+:\s+\S", lines[n]):
        return ""
    want = re.match(r"^\s*(-\s+)?", lines[n]).end()  # where the key above starts (after its dash)
    have = len(line) - len(line.lstrip(" "))
    if have == want:
        return ""
    key = lines[n][want:].split(":", 1)[0]
    spaces = lambda k: f"{k} space{'' if k == 1 else 's'}"
    fix = f"indent it by {spaces(want)}" if want else "remove its indentation"
    return (f"line {index + 1} is indented {spaces(have)}, but the key above it ({key!r}, line {n + 1}) is "
            f"indented {spaces(want)}; keys of one mapping line up: {fix}")


def load_yaml_text(text: str, where: str) -> Any:
    """Parse YAML `text` like `yaml.safe_load`, refusing duplicate keys and alias bombs.

    Args:
        where: the file name, for messages (``where:line: ...``).

    Raises:
        ConfigError: a duplicate key, or an alias expansion that is too large or recursive.
        yaml.YAMLError, RecursionError: syntax errors, left to the caller.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, where, loader)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _check_nodes(root: yaml.Node, path: str, loader: yaml.SafeLoader) -> None:
    """Refuse duplicate keys and oversized or recursive alias expansions, without expanding anything.

    Iterative (no Python recursion), one visit per distinct node: `expanded[id]` is the number of
    values the node stands for once every alias in it is expanded.
    """
    expanded: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        ident = id(node)
        children = _children(node)
        if done:
            on_stack.discard(ident)
            total = 1 + sum(expanded[id(c)] for c in children)
            if total > MAX_VALUES:
                raise ConfigError(f"{path}:{_line(node)}: this value expands to more than {MAX_VALUES} values "
                                  f"through anchors and aliases (&name / *name); a recipe never needs that many — "
                                  f"write the values out or use fewer aliases")
            expanded[ident] = total
            continue
        if ident in expanded:
            continue
        if ident in on_stack:
            raise ConfigError(f"{path}:{_line(node)}: an alias refers to a value that contains it (a recursive "
                              f"anchor); the recipe would be infinite — remove the alias")
        if isinstance(node, yaml.MappingNode):
            _check_duplicate_keys(node, path, loader)
        on_stack.add(ident)
        stack.append((node, True))
        for child in children:
            if id(child) in on_stack:
                raise ConfigError(f"{path}:{_line(child)}: an alias refers to a value that contains it (a "
                                  f"recursive anchor); the recipe would be infinite — remove the alias")
            if id(child) not in expanded:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_duplicate_keys(node: yaml.MappingNode, path: str, loader: yaml.SafeLoader) -> None:
    """A key written twice in one mapping is an error (merge keys ``<<`` may be overridden, as YAML says).

    Keys are compared as YAML reads them, so ``yes:`` and ``true:``, or ``1:`` and ``0x1:``, are the same key.
    """
    seen: dict[Any, yaml.Node] = {}
    for key, _value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        value = loader.construct_object(key)
        name = key.value
        ident = (type(value).__name__, value) if value.__hash__ is not None else (key.tag, name)
        if ident in seen:
            shown = name if len(name) <= 60 else name[:57] + "..."
            raise ConfigError(f"{path}:{_line(key)}: key {shown!r} is given twice in the same mapping, on line "
                              f"{_line(seen[ident])} and line {_line(key)}; only one value can count — delete one")
        seen[ident] = key
