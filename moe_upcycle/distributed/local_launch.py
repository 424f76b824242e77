"""``build --workers N``: run the same command as the N processes of a torchrun job on this machine.

`run_workers` calls torch's own launcher in this process (`torch.distributed.run`, what ``torchrun --standalone
--nproc-per-node N -m moe_upcycle ARGS`` runs): a rendezvous on a free local port, N workers
``python -m moe_upcycle ARGS`` with this command's arguments (``--workers N`` among them: a worker checks that it
runs in a job of that size), SIGINT/SIGTERM/SIGHUP/SIGQUIT passed on to them, every worker stopped when one
fails. The workers say what the build says (the lead does); this process adds nothing of its own (the launcher's
log lines and failure table are left out), and exits with the lead's exit code (else the first failed worker's).

It builds nothing itself, and does not reach other machines: for several nodes, run torchrun on each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Iterator

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

    with _launcher_quiet(), _log_dir() as logs:
        args = parse_args(["--standalone", f"--nproc-per-node={workers}", *logs, "--module", "moe_upcycle", *command])
        try:
            run(args)
        except ChildFailedError as exc:
            failed = exc.failures.get(0) or min(exc.failures.values(), key=lambda f: f.timestamp)
            return failed.exitcode if failed.exitcode > 0 else 128 - failed.exitcode  # -N: killed by signal N
        except SignalException as exc:  # the workers were sent the signal; the lead said what it stopped
            return 128 + int(exc.sigval)
    return 0


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
