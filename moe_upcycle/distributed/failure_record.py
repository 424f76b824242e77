"""What failed on one rank of a job, as a record other ranks read and raise as their own error.

A `Failure` travels as one JSON record (`record` / `from_record`: plain strings and numbers, never a pickle)
through the job's c10d store, whoever sends it (`world` for a build, `rank_failures` inside a training job): its
kind (an `UpcycleError`, a signal, a bug, or a rank gone without a word), the exception class, its messages, the
rank and host. `Failure.exception` gives the error to raise on another rank: the same class with
``rank R of N (host H): `` before each message; a `Terminated` with the signal's number for a signal (so the exit
code is 128 + it there too); a `RankError` for a bug, whose traceback is in that rank's own output, and for a
rank whose process ended without recording anything (killed by a signal, out of memory, a crash).

It does not talk to other ranks (see `world`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any, Optional

from moe_upcycle.errors import RankError, UpcycleError
from moe_upcycle.terminal.signals import Terminated

# set by ``build --workers`` for its ranks: it names a dead rank and its signal (it alone knows how the rank
# ended), so the `RankError` of a rank gone carries ``said_by_launcher`` and the lead prints nothing of its own
LAUNCHER_ENV = "MOE_UPCYCLE_WORKERS"
LEAD_GONE = " (rank 0's staging folder beside the output stays until the next build to that output clears it)"


@dataclass(frozen=True)
class Failure:
    """What failed on a rank, as recorded in the store: enough to raise the same error on another rank."""

    seq: int  # order among the job's failures (1 = first)
    rank: int
    size: int
    host: str
    kind: str  # "error" (an UpcycleError), "interrupt" (a signal), "bug" (any other exception) or "gone"
    cls: str  # module:qualname of the exception class
    problems: tuple[str, ...]
    signum: int = 0

    @property
    def where(self) -> str:
        return f"rank {self.rank} of {self.size} (host {self.host})"

    def exception(self) -> BaseException:
        """The error to raise on another rank: the same class and messages with the rank in front, a
        `Terminated` for a signal, a `RankError` for a bug (its traceback is in that rank's output)."""
        if self.kind == "gone":  # recorded by the rank that found it gone: its process ended without a word
            exc = RankError(f"{self.where} left the job without a word ({' '.join(self.problems)}): it was killed "
                           f"(by a signal, or the out-of-memory killer: see dmesg) or crashed, see its output; "
                           f"every rank stopped and nothing was published"
                           f"{LEAD_GONE if self.rank == 0 else ''}")
            exc.said_by_launcher = bool(os.environ.get(LAUNCHER_ENV))
        elif self.kind == "interrupt":
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

    def record(self) -> str:
        """This failure as one JSON object (what travels between ranks)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_record(cls, text: str | bytes) -> "Failure":
        """The `Failure` that `record` wrote (the one place a record is read back)."""
        fields = json.loads(text)
        return cls(**{**fields, "problems": tuple(fields["problems"])})

    @classmethod
    def gone(cls, seq: int, rank: int, size: int, host: str, how: str) -> "Failure":
        """A rank found gone by another (`how`: what was seen, e.g. "its process ended")."""
        return cls(seq, rank, size, host, "gone", "", (how,))

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
