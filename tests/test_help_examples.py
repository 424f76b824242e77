"""Every command's --help ends with an example line that names the command; the top-level help says where to start;
defaults read one way ([default: ...]), never "(default ...)" in the prose."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from moe_upcycle.cli import app

runner = CliRunner()


def every_command(group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, command in group.commands.items():
        found.append((*path, name))
        if getattr(command, "commands", None):  # a group (typer may bring its own click)
            found += every_command(command, (*path, name))
    return found


COMMANDS = every_command(typer.main.get_command(app))


def last_line(text: str) -> str:
    return [line.strip() for line in text.splitlines() if line.strip()][-1]


def test_every_command_is_listed():
    assert {" ".join(c) for c in COMMANDS} == {"build", "plan", "verify", "demo", "route", "lint", "prompts",
                                               "prompts grow"}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_ends_with_an_example_of_that_command(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    line = last_line(result.stdout)
    assert line.startswith(f"Example: moe-upcycle {' '.join(command)}"), line
    assert not re.search(r"\(default[: ]", result.stdout), result.stdout  # one style: [default: ...]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c[0] != "prompts" or len(c) > 1], ids=" ".join)
def test_the_example_parses(command):
    """The example's arguments are ones the command takes: parsed with click (nothing runs)."""
    from moe_upcycle.cli.examples import EXAMPLES

    cmd = typer.main.get_command(app)
    for name in command:
        cmd = cmd.commands[name]
    args = EXAMPLES[" ".join(command)].split()[1 + len(command):]
    ctx = cmd.make_context(" ".join(command), list(args), resilient_parsing=False)
    assert ctx.params is not None


def test_top_level_help_says_where_to_start():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "Start with: moe-upcycle demo" in result.stdout
    assert last_line(result.stdout) == "Example: moe-upcycle build experts.yaml out"


def test_flag_defaults_read_in_brackets():
    out = runner.invoke(app, ["verify", "--help"], env={"COLUMNS": "200"}).stdout
    assert re.search(r"--base .*\[default: \(the recipe's base_model\)\]", out)
    out = runner.invoke(app, ["lint", "--help"], env={"COLUMNS": "200"}).stdout
    assert re.search(r"--threshold .*\[default: \(0\.70\)\]", out)
