"""``build --workers N``: run the same command as the N processes of a torchrun job on this machine.

`run_workers` calls torch's own launcher in this process (`torch.distributed.run`, what ``torchrun --standalone
--nproc-per-node N -m moe_upcycle ARGS`` runs): a rendezvous on a free local port, N workers
``python -m moe_upcycle ARGS`` with this command's arguments (``--workers N`` among them: a worker checks that it
runs in a job of that size), SIGINT/SIGTERM/SIGHUP/SIGQUIT passed on to them, every worker stopped when one
fails. The workers say what the build says (the lead does); this process adds nothing of its own (the launcher's
log lines and failure table are left out), and exits with the lead's exit code (else the first failed worker's),
but for a worker killed by a signal (SIGKILL from the out-of-memory killer, a crash's SIGSEGV): it alone knows how
that one ended, so it says which rank and by what signal, once (the lead, told by `failure_record.LAUNCHER_ENV`,
leaves it to this process; `world` found the rank gone at once and stopped every rank).

It builds nothing itself, and does not reach other machines: for several nodes, run torchrun on each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
from typing import Iterator, Optional

from moe_upcycle.distributed.failure_record import LAUNCHER_ENV
from moe_upcycle.errors import ConfigError
from moe_upcycle.terminal.cpus import usable_cpus

LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def run_workers(workers: int, command: list[str]) -> int:
    """Run ``python -m moe_upcycle *command`` as `workers` local processes of one job; returns the exit code.

    Args:
        workers: how many processes (ranks).
        command: the command line's arguments after the program name (``build CFG OUT ... --workers N``).

    Raises:
        ConfigError: more than twice as many workers as this machine has CPUs (`check_workers`).
    """
    check_workers(workers)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    with _launcher_quiet(), _log_dir() as logs, _told_workers(workers):
        args = parse_args(["--standalone", f"--nproc-per-node={workers}", *logs, "--module", "moe_upcycle", *command])
        try:
            run(args)
        except ChildFailedError as exc:
            codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
            line = killed_line(codes, workers)
            if line is not None:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
            failed = exc.failures.get(0) or min(exc.failures.values(), key=lambda f: f.timestamp)
            return failed.exitcode if failed.exitcode > 0 else 128 - failed.exitcode  # -N: killed by signal N
        except SignalException as exc:  # the workers were sent the signal; the lead said what it stopped
            return 128 + int(exc.sigval)
    return 0


def killed_line(codes: dict[int, int], workers: int) -> Optional[str]:
    """What to say when a worker ended without a word, else None (the lead said what stopped the build).

    A worker killed by a signal has minus the signal's number as exit code; one that left by an exit code the
    command never gives (it gives 0, 1 and 128 + a signal it handled) ended without a word too. The first such rank
    is named with how it ended. That nothing was written is said only when the lead ended by itself (exit code 1:
    it removed the staging folder, then left the message to this process), not when the lead is the one killed.

    Example:
        >>> killed_line({1: -9, 0: 1}, 2)
        'rank error: rank 1 of 2 was killed by SIGKILL (the out-of-memory killer? see dmesg); every rank stopped and nothing was written under the output name'
        >>> killed_line({1: 1, 0: 1}, 2) is None
        True
    """
    ours = {0, 1, *(128 + int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT))}
    silent = sorted(rank for rank, code in codes.items() if code < 0 or code not in ours)
    if not silent:
        return None
    rank, code = silent[0], codes[silent[0]]
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {"SIGKILL": " (the out-of-memory killer? see dmesg)", "SIGSEGV": " (a crash: see its output)",
               "SIGBUS": " (a file it read was cut short, or its disk failed? see its output)",
               "SIGABRT": " (a crash: see its output)"}.get(name, "")
        how = f"was killed by {name}{why}"
    else:
        how = f"ended with exit code {code} without a word (see its output)"
    end = ("every rank stopped and nothing was written under the output name" if codes.get(0, 0) in (0, 1) and
           rank != 0 else "the output was not published (a staging folder beside it may be left; the next build "
                          "to the same output removes it)")
    return f"rank error: rank {rank} of {workers} {how}; {end}"


@contextlib.contextmanager
def _told_workers(workers: int) -> Iterator[None]:
    """The workers know this process says how a killed one ended (`LAUNCHER_ENV`)."""
    before = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = str(workers)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = before


def check_workers(workers: int) -> None:
    """Refuse more local workers than twice the CPUs this process may run on. A worker is a process of its own that
    imports torch and writes with three threads, half of its time waiting on the disk: two to a core may still
    overlap, more only share them (and ``--workers 100000`` would start processes until the machine stalled).

    Raises:
        ConfigError: `workers` is above twice the CPU count.
    """
    cpus = usable_cpus()
    if workers > 2 * cpus:
        raise ConfigError(f"--workers {workers}: this machine has {cpus} CPU{'s' if cpus != 1 else ''} for this "
                          f"process; more than {2 * cpus} workers (two to a CPU) only share them, each a process "
                          f"importing torch — give --workers {cpus} (one to a CPU) or at most {2 * cpus}; for more "
                          f"processes, run torchrun on several machines sharing the output's filesystem")


@contextlib.contextmanager
def _log_dir() -> Iterator[list[str]]:
    """The launcher's ``--log-dir``: a temporary folder removed at the end (left to itself, torch's launcher makes a
    ``/tmp/torchelastic_*`` folder per run and leaves it), or none where the user set ``PET_LOG_DIR`` (theirs)."""
    if os.environ.get("PET_LOG_DIR"):
        yield []
        return
    with tempfile.TemporaryDirectory(prefix="moe-upcycle-workers-") as folder:
        yield ["--log-dir", folder]


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    """The launcher's own log lines (rendezvous, OMP_NUM_THREADS, "Sending process ... SIGTERM") are left out."""
    # each of torch's elastic modules sets its own logger's level: every one is set here, not their parent
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(LOGGERS)]
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
