"""`python -m moe_upcycle` is the same as the `moe-upcycle` command.

A signal while the command line is still importing exits quietly with 128 + signal number
(`signals.quiet_startup`); within a command, clean-up runs first and the exit code is the same.
When the command is done, the process ends without the interpreter's teardown (`exit.finish`).
"""

from __future__ import annotations

import errno
import os
import sys

from moe_upcycle.terminal.exit import finish
from moe_upcycle.terminal.signals import quiet_startup


def main() -> None:
    """The ``moe-upcycle`` entry point."""
    quiet_startup()  # each command then handles signals itself (`cli.app.cli_errors`)
    problem = _cwd_problem()
    if problem:  # before torch loads: it dies on a deleted current folder with a foreign "FATAL ERROR"
        sys.stderr.write(f"error: {problem}\n")
        finish(1)
    from moe_upcycle.cli import app

    try:
        app(prog_name="moe-upcycle")  # click's standalone mode ends with SystemExit
    except SystemExit as done:
        finish(done.code)
    finish(0)


def _cwd_problem() -> str | None:
    try:
        os.getcwd()
    except OSError as exc:
        what = ("no longer exists (it was deleted or moved)" if exc.errno == errno.ENOENT else
                f"cannot be read ({exc.strerror or exc})")
        return f"the current folder {what}; cd to a folder that exists and run the command again"
    return None


if __name__ == "__main__":
    main()
