"""`python -m moe_upcycle` is the same as the `moe-upcycle` command.

A signal while the command line is still importing exits quietly with 128 + signal number
(`signals.quiet_startup`); within a command, clean-up runs first and the exit code is the same.
When the command is done, the process ends without the interpreter's teardown (`exit.finish`).
"""

from moe_upcycle.terminal.exit import finish
from moe_upcycle.terminal.signals import quiet_startup


def main() -> None:
    """The ``moe-upcycle`` entry point."""
    quiet_startup()  # each command then handles signals itself (`cli.app.cli_errors`)
    from moe_upcycle.cli import app

    try:
        app(prog_name="moe-upcycle")  # click's standalone mode ends with SystemExit
    except SystemExit as done:
        finish(done.code)
    finish(0)


if __name__ == "__main__":
    main()
