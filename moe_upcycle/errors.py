"""Error types for moe-upcycle.

Every problem caused by the user's input (config, checkpoints, output folder) is an
`UpcycleError`. The CLI catches these (and running out of GPU or machine memory, `cli.out_of_memory`),
prints them and exits 1; anything else is a bug and keeps its traceback. Messages say what is wrong,
where (field, file, tensor) and what to do.
"""

from __future__ import annotations


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


class UpcycleWarning(UserWarning):
    """Something the build can go on with but the user should know (NaN in a source, a lossy cast).

    Issued with `warnings.warn`; the CLI prints each one as ``warning: ...``.
    """


class DependencyError(UpcycleError):
    """An optional extra (matplotlib, bitsandbytes) or a device the request needs is not available."""
