"""Write prompts back into a user's YAML recipe without losing what they wrote around them.

A round trip through ruamel.yaml keeps comments, key order, quoting and indentation of the
input; only the ``positive_prompts`` lists of the experts that grew change. Prompts that span
lines are written as literal blocks (``|``), so code stays readable; the others bare where PyYAML
reads them back as the same text in that list's style (block or ``[...]``), else double-quoted. It
validates nothing: `rewrite.write_grown_config` checks that the result reads back as written.
"""

from __future__ import annotations

import io
from typing import Mapping

import yaml

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import DoubleQuotedScalarString, LiteralScalarString


def _yaml() -> YAML:
    y = YAML()  # round-trip mode
    y.preserve_quotes = True
    y.width = 4096  # never fold a long prompt
    y.indent(mapping=2, sequence=4, offset=2)
    return y


def _scalar(text: str, flow: bool = False):
    """How one added prompt is written: a literal block when it spans lines, bare when PyYAML (which reads the
    recipe) reads it back as the same text in this list's style, else double-quoted. ruamel (which writes it)
    follows YAML 1.2, so on its own it writes ``yes`` bare (PyYAML: True) and, inside ``[...]``, ``two columns?``
    bare (PyYAML: a syntax error)."""
    if "\n" in text:
        return LiteralScalarString(text)
    try:
        bare = yaml.safe_load(f"[{text}]" if flow else f"- {text}") == [text]
    except yaml.YAMLError:
        bare = False
    return text if bare and text == text.strip() else DoubleQuotedScalarString(text)


def add_prompts(text: str, added: Mapping[int, list[str]]) -> str:
    """The YAML `text` with prompts appended to ``experts[i].positive_prompts`` for each i in `added`.

    Args:
        text: the recipe as written by the user.
        added: expert index (in ``experts:``) -> prompts to append.

    Returns:
        The new YAML text; everything else is as it was (comments included).

    Example:
        >>> print(add_prompts("experts:  # mine\\n  - source_model: m\\n    positive_prompts: [a]\\n", {0: ["b"]}), end="")
        experts:  # mine
          - source_model: m
            positive_prompts: [a, b]
    """
    y = _yaml()
    sample = text.splitlines()
    data = y.load(text)
    _match_indent(y, sample)
    experts = data.get("experts") or []
    for i, prompts in added.items():
        if not prompts:
            continue
        expert = experts[i]
        if not isinstance(expert, CommentedMap):
            continue
        current = expert.get("positive_prompts")
        if isinstance(current, str):  # one prompt written as a string: now a list of it and the new ones
            current = expert["positive_prompts"] = CommentedSeq([current])
        elif isinstance(current, CommentedSeq) and current.anchor.value is not None:
            # an anchored list (&code) that an alias (*code) reuses elsewhere, e.g. as another expert's
            # negative_prompts: grow this expert's own copy, or the new prompts would land there too
            copy = CommentedSeq(current)
            if current.fa.flow_style():
                copy.fa.set_flow_style()
            current = expert["positive_prompts"] = copy
        if current is None:
            seq = CommentedSeq()
            after = list(expert).index("positive_prompts_from") + 1 if "positive_prompts_from" in expert \
                else len(expert)
            expert.insert(after, "positive_prompts", seq)
            current = seq
        flow = bool(current.fa.flow_style())  # [a, b] in the input
        for p in prompts:
            current.append(_scalar(p, flow))
    buf = io.StringIO()
    y.dump(data, buf)
    return buf.getvalue()


def _match_indent(y: YAML, lines: list[str]) -> None:
    """Use the input's list style: ``- item`` flush with its key, or indented under it."""
    for k, line in enumerate(lines[:-1]):
        nxt = lines[k + 1]
        if line.rstrip().endswith(":") and nxt.lstrip().startswith("- "):
            key_indent = len(line) - len(line.lstrip())
            dash = len(nxt) - len(nxt.lstrip()) - key_indent
            y.indent(mapping=2, sequence=dash + 2, offset=dash)
            return
