"""Error types for moe-upcycle.

Every problem caused by the user's input (config, checkpoints, output folder) is an
`UpcycleError`. The CLI catches these (and running out of GPU or machine memory, `cli.out_of_memory`),
prints them and exits 1; anything else is a bug and keeps its traceback. Messages say what is wrong,
where (field, file, tensor) and what to do.
"""

from __future__ import annotations

import errno
from typing import Optional


class UpcycleError(Exception):
    """Base class of all user-facing errors.

    Args:
        problems: One or more problem descriptions. Several are reported together, so a user
            fixes them all in one go instead of one per run.
    """

    def __init__(self, *problems: str):
        self.problems = [p for p in problems if p]
        super().__init__("\n".join(self.problems))


class ConfigError(UpcycleError):
    """The YAML config is malformed or inconsistent."""


class SourceError(UpcycleError):
    """A source checkpoint is missing, unreadable or does not fit the base model."""


class PlanError(UpcycleError):
    """The config cannot be turned into an output checkpoint (e.g. architecture mismatch)."""


class OutputError(UpcycleError):
    """The output folder cannot be written (exists, locked, inside a source, disk full)."""


class RankError(UpcycleError):
    """Another process of a distributed build (torchrun) failed, or this one could not join the job; the message
    names the rank and host."""


class UpcycleWarning(UserWarning):
    """Something the build can go on with but the user should know (NaN in a source, a lossy cast).

    Issued with `warnings.warn`; the CLI prints each one as ``warning: ...``.
    """


class DependencyError(UpcycleError):
    """An optional extra (matplotlib, bitsandbytes) or a device the request needs is not available."""


def memory_ran_out(exc: BaseException) -> Optional[str]:
    """``"GPU"`` or ``"machine"`` when `exc` says that memory ran out, else None.

    torch raises ``torch.OutOfMemoryError`` for a GPU and a RuntimeError ("can't allocate memory") for the CPU;
    Python raises MemoryError; the kernel answers ENOMEM, which libraries pass on as text ("Cannot allocate memory
    (12)" from a failed mmap, "failed to map segment from shared object" from a library that could not load,
    "can't start new thread"). Not a bug and not the user's files: the command says so (`cli.out_of_memory`).

    Example:
        >>> memory_ran_out(RuntimeError("unable to mmap 90868376 bytes from file <x>: Cannot allocate memory (12)"))
        'machine'
        >>> memory_ran_out(ValueError("weight_map is a list")) is None
        True
    """
    text = str(exc).lower()
    if type(exc).__name__ == "OutOfMemoryError" or "cuda out of memory" in text or "cuda error: out of memory" in text:
        return "GPU"
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return "machine"
    said = any(words in text for words in _NO_MEMORY)
    refused = "operation not permitted" in text or "permission denied" in text  # e.g. a library on a noexec mount
    return "machine" if said and not refused else None


def reraise_if_out_of_memory(exc: BaseException) -> None:
    """Raise `exc` itself when memory ran out: a caller that turns loading failures into "this file is damaged"
    must not say that of a file that only did not fit."""
    if memory_ran_out(exc):
        raise exc


_NO_MEMORY = ("can't allocate memory", "cannot allocate memory", "not enough memory", "can't start new thread",
              "failed to map segment from shared object")
