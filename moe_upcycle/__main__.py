"""`python -m moe_upcycle` is the same as the `moe-upcycle` command."""

from moe_upcycle.cli import app

app(prog_name="moe-upcycle")
