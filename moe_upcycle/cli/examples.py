"""One example command line at the end of every command's ``--help``, and where to start in the top-level help.

The examples are one table (`EXAMPLES`: command -> example); `add_examples` puts each in its command's epilog once
every command is registered (`cli.__init__`). It changes help text only, never parsing.
"""

from __future__ import annotations

import typer

START = "New here? Start with: moe-upcycle demo (a tiny MoE built and checked in seconds, no download)."
EXAMPLES = {
    "build": "moe-upcycle build experts.yaml out",
    "plan": "moe-upcycle plan experts.yaml",
    "verify": "moe-upcycle verify out",
    "demo": "moe-upcycle demo",
    "route": "moe-upcycle route out --labeled labeled.tsv",
    "lint": "moe-upcycle lint experts.yaml",
    "prompts": "moe-upcycle prompts grow experts.yaml --pool pool.txt",
    "prompts grow": "moe-upcycle prompts grow experts.yaml --pool pool.txt",
}


def example_line(command: str) -> str:
    """The epilog of `command` (``prompts grow`` for a sub-command)."""
    return f"Example: {EXAMPLES[command]}"


def add_examples(app: typer.Typer) -> None:
    """Put `EXAMPLES` in the epilogs of `app`'s commands and groups, and `START` in its own.

    Raises:
        KeyError: a registered command without an example (the table must name every command).
    """
    app.info.epilog = f"{START}\n\n{example_line('build')}"
    _commands(app, "")


def _commands(app: typer.Typer, prefix: str) -> None:
    for info in app.registered_commands:
        name = prefix + (info.name or info.callback.__name__.replace("_", "-"))
        info.epilog = example_line(name)
    for group in app.registered_groups:
        name = prefix + (group.name or "")
        group.typer_instance.info.epilog = example_line(name)
        _commands(group.typer_instance, name + " ")
