"""`python -m moe_upcycle` is the same as the `moe-upcycle` command.

A signal while the command line is still importing exits quietly with 128 + signal number
(`signals.quiet_startup`); within a command, clean-up runs first and the exit code is the same.
When the command is done, the process ends without the interpreter's teardown (`exit.finish`). Start-up's
imports run without the cyclic garbage collector (`import_gc`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from moe_upcycle.terminal import import_gc
from moe_upcycle.terminal.exit import finish
from moe_upcycle.terminal.signals import quiet_startup


def main() -> None:
    """The ``moe-upcycle`` entry point."""
    import_gc.pause()  # until torch is in (`cli.app.cli_errors`): start-up makes no garbage worth a pass
    quiet_startup()  # each command then handles signals itself (`cli.app.cli_errors`)
    standard_streams()
    problem = _cwd_problem()
    if problem:  # before torch loads: it dies on a deleted current folder with a foreign "FATAL ERROR"
        sys.stderr.write(f"error: {problem}\n")
        finish(1)
    _no_shadowing()
    from moe_upcycle.cli import app

    try:
        app(prog_name="moe-upcycle")  # click's standalone mode ends with SystemExit
    except SystemExit as done:
        finish(done.code)
    except OSError as exc:  # --help or --version to a full disk (`> /dev/full`): commands say it themselves
        if exc.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
            raise
        with contextlib.suppress(OSError):
            sys.stderr.write(f"error: writing to standard output failed ({exc.strerror}); send it to a file on a "
                             f"disk with room, or to a terminal\n")
        finish(1)
    finish(0)


def standard_streams() -> None:
    """Make the standard streams safe to write to, whatever the command was started with.

    - A closed descriptor 0, 1 or 2 (``>&-``) is opened on /dev/null: otherwise the next file opened (a shard,
      the lock) would get that number, and anything a library writes to stdout or stderr would land in it;
      Python's ``sys.stdout`` is then None, and every print would fail.
    - Text the stream's encoding cannot hold (``PYTHONIOENCODING=ascii``, a Latin-1 locale: "Δ", a non-ASCII
      expert name) is written as ``\u0394`` escapes instead of failing.
    - ``COLUMNS`` that is not a positive number (``COLUMNS=0``) is dropped: rich would print every message in
      zero columns, that is not at all.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)  # the lowest free number: `fd` itself
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    columns = os.environ.get("COLUMNS")
    if columns is not None and not (columns.strip().isdigit() and int(columns) > 0):
        del os.environ["COLUMNS"]


def _no_shadowing() -> None:
    """`python -m moe_upcycle` puts the current folder first on sys.path, so a ``yaml.py`` or ``torch.py`` of the
    user's there was imported instead of the library (three tracebacks). This package is loaded by then, and its
    modules come from it, so the entry can go."""
    if sys.path and not getattr(sys.flags, "safe_path", False) and sys.path[0] in ("", os.getcwd()):  # 3.11+: -P
        del sys.path[0]


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
