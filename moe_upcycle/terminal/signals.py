"""Termination signals as exceptions, so clean-up runs and the exit code says which signal.

SIGINT (Ctrl-C) is Python's `KeyboardInterrupt` already. SIGTERM (``kill``, a job scheduler),
SIGHUP (a closed terminal, a dropped SSH connection) and SIGQUIT (Ctrl-\\) would otherwise end the
process on the spot, leaving ``.<name>.partial-*`` and ``.<name>.lock`` beside the target. `terminations_raise`
turns them into `Terminated`, a `KeyboardInterrupt` subclass carrying the signal number, so every
``finally`` runs; `exit_code` gives 128 + the signal number (130, 143, 129), as shells report.

`signals_held` delays them over a block that must not be cut short (a swap of folders, a clean-up).

`quiet_startup` covers the moments outside a command — imports, argument parsing — by exiting
at once, with that code and no traceback (nothing has been written then).
It handles signals only in the main thread; elsewhere it changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

HANDLED = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None),
                            getattr(signal, "SIGQUIT", None)) if s is not None)


class Terminated(KeyboardInterrupt):
    """A termination signal (SIGTERM, SIGHUP, SIGQUIT) turned into an exception; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(exc: BaseException) -> int:
    """128 + the signal number behind `exc` (SIGINT for a plain KeyboardInterrupt)."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


def signal_name(exc: BaseException) -> str:
    return signal.Signals(int(getattr(exc, "signum", signal.SIGINT))).name


def _raise_terminated(signum, frame):  # noqa: ARG001
    raise Terminated(signum)


@contextlib.contextmanager
def terminations_raise(sigint: bool = False) -> Iterator[None]:
    """Within the block, SIGTERM, SIGHUP and SIGQUIT raise `Terminated` (previous handlers restored after).

    Args:
        sigint: also make SIGINT raise `KeyboardInterrupt` (Python's own handler) within the block,
            replacing `quiet_startup`'s; the command line's commands use this.

    Signals the parent set to be ignored (``nohup`` ignores SIGHUP, background jobs SIGINT) stay ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = {s: _raise_terminated for s in HANDLED}
    if sigint:
        wanted[signal.SIGINT] = signal.default_int_handler
    previous = {}
    try:
        for s, handler in wanted.items():
            if signal.getsignal(s) is not signal.SIG_IGN:
                previous[s] = signal.signal(s, handler)
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def quiet_startup() -> None:
    """From now on, outside a command's `terminations_raise`, SIGINT/SIGTERM/SIGHUP end the process
    at once: no traceback, exit code 128 + signal. For the command line's start-up (imports,
    argument parsing), when nothing has been written yet.

    Signals the parent set to be ignored stay ignored.
    """
    for s in (signal.SIGINT, *HANDLED):
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _exit_quietly)


def _exit_quietly(signum, frame):  # noqa: ARG001
    os._exit(128 + signum)


@contextlib.contextmanager
def signals_held(drop: bool = False) -> Iterator[None]:
    """Delay SIGINT/SIGTERM/SIGHUP/SIGQUIT until the block ends, so what it does (a swap of folders, a clean-up)
    is never left half done.

    Python-level handlers (not a thread signal mask: torch's threads would still take the signal) note what
    arrives; it is raised again, to the handlers in place before, at the end, unless `drop` (the process is
    stopping already). Outside the main thread it changes nothing.
    """
    pending: list[int] = []
    held = (signal.SIGINT, *HANDLED)
    try:
        previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in held}
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(pending if not drop else ()):
            signal.raise_signal(s)
