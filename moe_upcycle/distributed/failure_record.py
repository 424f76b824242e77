"""What failed on one rank of a job, as a record other ranks read (`world`) and raise as their own error.

A `Failure` is written into the job's store as JSON when a rank's work raises: its kind (an `UpcycleError`, a
signal, or a bug), the exception class, its messages, the rank and host. `Failure.exception` gives the error to
raise on another rank: the same class with ``rank R of N (host H): `` before each message; a `Terminated` with the
signal's number for a signal (so the exit code is 128 + it there too); a `RankError` for a bug, whose traceback is
in that rank's own output.

It does not talk to other ranks (see `world`).
"""

from __future__ import annotations

import importlib
import signal
import socket
from dataclasses import dataclass
from typing import Any, Optional

from moe_upcycle.errors import RankError, UpcycleError
from moe_upcycle.terminal.signals import Terminated


@dataclass(frozen=True)
class Failure:
    """What failed on a rank, as recorded in the store: enough to raise the same error on another rank."""

    seq: int  # order among the job's failures (1 = first)
    rank: int
    size: int
    host: str
    kind: str  # "error" (an UpcycleError), "interrupt" (a signal) or "bug" (any other exception)
    cls: str  # module:qualname of the exception class
    problems: tuple[str, ...]
    signum: int = 0

    @property
    def where(self) -> str:
        return f"rank {self.rank} of {self.size} (host {self.host})"

    def exception(self) -> BaseException:
        """The error to raise on another rank: the same class and messages with the rank in front, a
        `Terminated` for a signal, a `RankError` for a bug (its traceback is in that rank's output)."""
        if self.kind == "interrupt":
            exc: BaseException = Terminated(self.signum)
            exc.where = f" on rank {self.rank} of {self.size}, host {self.host}"
        else:
            cls = _exception_class(self.cls)
            if self.kind == "error" and cls is not None and issubclass(cls, UpcycleError):
                exc = cls(*[f"{self.where}: {p}" for p in self.problems])
            elif cls is not None and issubclass(cls, MemoryError) or self.cls.endswith(":OutOfMemoryError"):
                exc = (cls or MemoryError)(f"{self.where}: {' '.join(self.problems)}")  # cli.out_of_memory says it
            else:
                name = self.cls.rsplit(":", 1)[-1]
                exc = RankError(f"{self.where} failed with {name}: {' '.join(self.problems)} (a bug: its traceback "
                                f"is in that rank's output)")
        exc.failed_rank = self.rank
        return exc

    @classmethod
    def of(cls, exc: BaseException, seq: int, rank: int, size: int) -> "Failure":
        kind = ("interrupt" if isinstance(exc, KeyboardInterrupt) else
                "error" if isinstance(exc, UpcycleError) else "bug")
        problems = tuple(exc.problems) if isinstance(exc, UpcycleError) else (str(exc),)
        return cls(seq, rank, size, socket.gethostname(), kind, f"{type(exc).__module__}:{type(exc).__qualname__}",
                   problems, int(getattr(exc, "signum", signal.SIGINT)) if kind == "interrupt" else 0)


def _exception_class(name: str) -> Optional[type]:
    module, _, qualname = name.partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) and issubclass(found, BaseException) else None
