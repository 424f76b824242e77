"""Write prompts back into a user's YAML recipe without losing what they wrote around them.

A round trip through ruamel.yaml keeps comments, key order, quoting and indentation of the
input; only the ``positive_prompts`` lists of the experts that grew change. Prompts that span
lines are written as literal blocks (``|``), so code stays readable. It validates nothing:
`grow.write_grown_config` checks the result with `config.load_config`.
"""

from __future__ import annotations

import io
from typing import Mapping

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import LiteralScalarString


def _yaml() -> YAML:
    y = YAML()  # round-trip mode
    y.preserve_quotes = True
    y.width = 4096  # never fold a long prompt
    y.indent(mapping=2, sequence=4, offset=2)
    return y


def _scalar(text: str):
    return LiteralScalarString(text) if "\n" in text else text


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
        if current is None:
            seq = CommentedSeq()
            after = list(expert).index("positive_prompts_from") + 1 if "positive_prompts_from" in expert \
                else len(expert)
            expert.insert(after, "positive_prompts", seq)
            current = seq
        for p in prompts:
            current.append(_scalar(p))
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
