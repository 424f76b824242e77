"""The `moe-upcycle` command line (Typer + rich): `app` with every command registered."""

from moe_upcycle.cli.app import app
from moe_upcycle.cli import commands, prompt_commands  # noqa: F401  (register their commands on `app`)
from moe_upcycle.cli.examples import add_examples

add_examples(app)  # an example line at the end of every command's --help

__all__ = ["app"]
