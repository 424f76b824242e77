"""Re-make the plan of a finished build from the recipe its manifest recorded (for `verify`).

The checks never read the recipe themselves: they get the recorded build's `CheckParams` and,
when they ask for it, its plan (which opens the sources' headers again).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_upcycle.checkpoint.source import open_sources
from moe_upcycle.planning.plan import make_plan
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.params import CheckParams
from moe_upcycle.recipe.resolve import check_params, source_refs
from moe_upcycle.recipe.schema import UpcycleConfig, load_config


@dataclass(frozen=True)
class RecordedBuild:
    """A recorded recipe, resolved: what the checks need, and its plan on demand."""

    check: CheckParams
    config: UpcycleConfig

    def plan(self) -> Plan:
        """The build's plan, re-made from the sources' headers.

        Raises:
            UpcycleError: a source is gone or no longer fits the recipe.
        """
        return make_plan(self.config, open_sources(source_refs(self.config)))


def recorded_build(config: dict) -> RecordedBuild:
    """Resolve the ``config`` recorded in a manifest.

    Raises:
        UpcycleError: the recorded config no longer validates.
    """
    validated = load_config(config)
    return RecordedBuild(check_params(validated), validated)
