"""The `moe-upcycle` command line (Typer + rich): `app` with every command registered."""

from moe_upcycle.cli.app import app
from moe_upcycle.cli import commands, prompt_commands  # noqa: F401  (register their commands on `app`)

__all__ = ["app"]
