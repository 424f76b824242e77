"""Re-make the plan of a finished build from the recipe its manifest recorded (for `verify`).

The checks never read the recipe themselves: they get the recorded build's `CheckParams` and,
when they ask for it, its plan (which opens the sources' headers again).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from moe_upcycle.checkpoint.source import open_sources
from moe_upcycle.planning.plan import make_plan
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.params import CheckParams
from moe_upcycle.recipe.prompt_sets import set_names
from moe_upcycle.recipe.resolve import source_refs
from moe_upcycle.recipe.resolved import resolved
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
    # earlier builds could record output_router_logits: true, which recipes now refuse; verify checks the flag in
    # config.json itself, so the recorded recipe is read without it
    validated = load_config({k: v for k, v in config.items() if k != "output_router_logits"})
    return RecordedBuild(resolved(validated).checking, validated)


def recorded_config(manifest: dict, folder: Path) -> Optional[dict]:
    """The recipe a manifest records, its relative local paths read from the folder they are relative to.

    Builds record every local path relative to the output and ``paths_relative_to: "."``
    (`publish.manifest`); earlier builds recorded the recipe's relative paths (``base_model: ./base``,
    ``positive_prompts_from: story.txt``) as written, relative to the build's working folder, and
    ``paths_relative_to`` locates that folder from the output. A path that exists there, or is written ``./x`` or ``../x``, is given as that path; anything
    else (a hub id, a shipped prompt set) is kept as written. None when the manifest records no config.

    A build run in ``proj/`` with ``-o out`` and ``base_model: ./base`` records ``..``; verify run
    from any folder then reads ``proj/out/../base``.
    """
    config = manifest.get("config")
    if not isinstance(config, dict):
        return None
    root = manifest.get("paths_relative_to")
    if not isinstance(root, str) or not root:
        return config  # none recorded: relative paths are read from the current folder
    # both ends were real paths (getcwd, the resolved output), so undoing the relpath lexically is exact
    root_dir = Path(os.path.normpath(Path(folder).resolve() / root))
    # a path written ./x or ../x is the build folder's even when it is gone: the message then names where it looked
    return map_paths(config, lambda ref: os.path.normpath(root_dir / ref) if (root_dir / ref).exists()
                     or ref.startswith(("./", "../")) else ref)


def map_paths(config: dict, rebase: Callable[[str], str], every_path: bool = False) -> dict:
    """`config` with `rebase` applied to every relative local path it may hold: ``base_model``, each routed and
    shared expert's ``source_model`` and ``*_prompts_from``, ``calibration_text`` (both parts of a
    ``MODEL+ADAPTER``; never a shipped prompt-set name or a value that is not text, nor, unless `every_path`, an
    absolute or ``~`` path)."""
    sets = set(set_names())

    def one(ref, prompts=False):
        if not isinstance(ref, str) or not ref:
            return ref
        if not every_path and (os.path.isabs(os.path.expanduser(ref)) or ref.startswith("~")):
            return ref
        if prompts and ref in sets:  # a shipped set wins over a file of that name, as in the build
            return ref
        if "+" in ref:  # mergekit's MODEL+ADAPTER: each part on its own (a folder named a+b, whose parts are no paths,
            model, _, adapter = ref.partition("+")  # as a whole)
            parts = one(model), one(adapter)
            if parts != (model, adapter):
                return "+".join(parts)
        return rebase(ref)

    out = dict(config, base_model=one(config.get("base_model")))
    if "calibration_text" in config:
        out["calibration_text"] = one(config["calibration_text"])
    for key in ("experts", "shared_experts"):
        if isinstance(config.get(key), list):
            out[key] = [dict(e, source_model=one(e.get("source_model")),
                             **{f: one(e.get(f), prompts=True) for f in ("positive_prompts_from", "negative_prompts_from")
                                if f in e})
                        if isinstance(e, dict) else e for e in config[key]]
    return out
