"""`python -m moe_upcycle` is the same as the `moe-upcycle` command.

A signal while the command line is still importing exits quietly with 128 + signal number
(`signals.quiet_startup`); within a command, clean-up runs first and the exit code is the same.
"""

from .signals import quiet_startup


def main() -> None:
    """The ``moe-upcycle`` entry point."""
    quiet_startup()  # each command then handles signals itself (`cli.cli_errors`)
    from .cli import app

    app(prog_name="moe-upcycle")


if __name__ == "__main__":
    main()
