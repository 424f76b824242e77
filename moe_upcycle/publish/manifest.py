"""Our manifest, ``moe_upcycle.json``: tool version, recipe, seed, verification and every file's sha256.

It is also how the tool recognises a folder it wrote (`checkpoint.output_dir.RECIPE_NAME`). The
recipe's relative paths were read from the folder the build ran in; when it has any,
``paths_relative_to`` records that folder relative to the output (``..`` for ``-o out`` in it), so
`verify` and `route` find the same sources and prompt files from any folder
(`planning.replan.recorded_config`). A recipe of absolute paths and hub ids records no such field.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence

from moe_upcycle import __version__
from moe_upcycle.checkpoint.names import CHAT_TEMPLATE_DIR
from moe_upcycle.checkpoint.output_dir import RECIPE_NAME
from moe_upcycle.planning.replan import relative_local_paths
from moe_upcycle.recipe.schema import UpcycleConfig


def write_recipe(folder: Path, config: Optional[UpcycleConfig], shard_hashes: dict[str, str],
                 skip: Sequence[str] = (), verification: Optional[dict] = None, extra: Optional[dict] = None) -> None:
    """Record tool version, resolved config, seed, verification and the sha256 of every output file.

    Args:
        config: the recipe; None for a folder no recipe made (a trained model exported by
            `distributed.dcp_export`): no config and no seed are recorded.
        shard_hashes: digests computed while writing (not computed again here).
        skip: files left unhashed (the shards with ``checksums: false``).
        extra: more top-level fields (an export says what wrote it).
    """
    hashes = dict(shard_hashes)
    templates = folder / CHAT_TEMPLATE_DIR  # the named chat templates: the one folder a build writes
    for path in sorted([*folder.iterdir(), *(templates.iterdir() if templates.is_dir() else ())]):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in hashes and name not in skip:
            hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    recipe = {"tool": "moe-upcycle", "version": __version__}
    if config is not None:
        recipe.update(config=config.model_dump(mode="json"), seed=config.seed)
    recipe.update(extra or {}, sha256=dict(sorted(hashes.items())))
    if config is not None and relative_local_paths(recipe["config"]):  # only then: the field tells where the build ran
        try:  # from the staging folder, a sibling of the output: the same path as from the output itself
            recipe["paths_relative_to"] = os.path.relpath(os.getcwd(), Path(folder).resolve())
        except OSError:  # the working folder was deleted meanwhile: relative paths lead nowhere anyway
            pass
    if verification is not None:
        recipe["verify"] = verification
    (folder / RECIPE_NAME).write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")
