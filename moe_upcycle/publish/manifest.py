"""Our manifest, ``moe_upcycle.json``: tool version, recipe, seed, verification and every file's sha256.

It is also how the tool recognises a folder it wrote (`checkpoint.output_dir.RECIPE_NAME`). It is
uploaded with the folder, so it names no absolute path, home folder or user name of the machine
that built it (`portable_ref`): a model from the Hugging Face cache is recorded by its hub id and
the commit the build read (``org/name@<commit>``), a local folder or prompt file by its path
relative to the output (``../base``), with ``paths_relative_to: "."`` saying so, so that `verify OUT`
and `route OUT` find the same sources and prompt files from any working folder
(`planning.replan.recorded_config`). A local path that only the home folder leads to is written
``~/...``; one whose every spelling names the user (``/data/<user>/m`` from an output elsewhere) is
recorded by its folder name alone, and the build says that `verify` will need ``--base``.
Manifests of earlier builds (recipe paths as written, ``paths_relative_to`` the working folder)
are read as before.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Optional, Sequence

from moe_upcycle import __version__
from moe_upcycle.checkpoint.names import CHAT_TEMPLATE_DIR
from moe_upcycle.checkpoint.output_dir import RECIPE_NAME
from moe_upcycle.checkpoint.model_refs import resolve_model
from moe_upcycle.errors import UpcycleError
from moe_upcycle.planning.replan import map_paths
from moe_upcycle.recipe.schema import UpcycleConfig


def write_recipe(folder: Path, config: Optional[UpcycleConfig], shard_hashes: dict[str, str],
                 skip: Sequence[str] = (), verification: Optional[dict] = None, extra: Optional[dict] = None,
                 target: Optional[Path] = None, unset: Sequence[str] = ()) -> list[str]:
    """Record tool version, resolved config, seed, verification and the sha256 of every output file.

    Args:
        folder: where the files are (the staging folder of a build).
        config: the recipe; None for a folder no recipe made (a trained model exported by
            `distributed.dcp_export`): no config and no seed are recorded.
        shard_hashes: digests computed while writing (not computed again here).
        skip: files left unhashed (the shards with ``checksums: false``).
        verification: `verify`'s result as a dict; its local paths are written as the recipe's are.
        extra: more top-level fields (an export says what wrote it).
        target: the folder the output is published as (paths are recorded relative to it); default `folder`.
        unset: config fields recorded as left out, because their default depends on the base (a grown MoE's
            gate_mode and experts_per_token, `planning.grow.left_out`): re-planning resolves them the same way.

    Returns:
        Notes for the user: the sources recorded by name only (see the module docstring).
    """
    recorded = PortableRefs(Path(target if target is not None else folder))
    hashes = dict(shard_hashes)
    templates = folder / CHAT_TEMPLATE_DIR  # the named chat templates: the one folder a build writes
    for path in sorted([*folder.iterdir(), *(templates.iterdir() if templates.is_dir() else ())]):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in hashes and name not in skip:
            hashes[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    recipe = {"tool": "moe-upcycle", "version": __version__}
    if config is not None:
        dumped = {k: v for k, v in config.model_dump(mode="json").items() if k not in unset}
        portable = map_paths(dumped, recorded.ref, every_path=True)
        portable["output"] = None  # the folder itself: where it was written is the machine's business
        recipe.update(config=portable, seed=config.seed)
    recipe.update(extra or {}, sha256=dict(sorted(hashes.items())))
    if recorded.relative:  # only then: relative paths are read from the output folder itself
        recipe["paths_relative_to"] = "."
    if verification is not None:
        recipe["verify"] = recorded.scrub(verification, {str(Path(folder).resolve()): ".", str(folder): "."})
    (folder / RECIPE_NAME).write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")
    return [f"{RECIPE_NAME} records {ref} by its folder name, {name!r}, alone: every path to it from the output "
            f"names your user name, and the manifest is uploaded with the folder; `moe-upcycle verify` of the "
            f"output will need --base" for ref, name in recorded.unlocated.items()]


class PortableRefs:
    """Model and file references as the manifest records them, for an output published as `target`.

    `ref` maps one reference; the attributes say what it did: `relative` (a path relative to the output
    was written), `unlocated` (reference -> the name recorded instead of a path), `written` (each local
    form of a reference -> what was recorded, for `scrub`).
    """

    def __init__(self, target: Path):
        self.target = Path(os.path.expanduser(target)).resolve()
        self.home = Path.home().resolve()
        self.user = _user()
        self.relative = False
        self.unlocated: dict[str, str] = {}
        self.written: dict[str, str] = {}

    def ref(self, ref: str) -> str:
        """`ref` as recorded: a hub id with its commit, a path relative to the output, ``~/...``, or a name."""
        path = Path(os.path.expanduser(ref))
        if not path.exists():  # a hub id (or something no longer there: recorded as written)
            return self._pinned(ref)
        real = path.resolve()
        recorded = _cached_hub_id(real) or self._path(ref, real)
        # the absolute spellings that messages (verify's) may hold: what `scrub` replaces
        self.written.update({form: recorded for form in (str(real), str(path.absolute()), ref) if os.path.isabs(form)})
        return recorded

    def _path(self, ref: str, real: Path) -> str:
        rel = Path(os.path.relpath(real, self.target)).as_posix()
        rel = rel if rel.startswith("../") or rel == ".." else f"./{rel}"
        under_home = real.is_relative_to(self.home)
        options = []
        if not under_home or self.target.is_relative_to(self.home):  # else the way climbs into /home/<user>
            options.append(rel)
        if under_home:
            options.append("~/" + real.relative_to(self.home).as_posix() if real != self.home else "~")
        for option in options:
            if self.user not in Path(option).parts:
                self.relative = self.relative or option == rel
                return option
        self.unlocated[ref] = real.name
        return real.name

    def _pinned(self, ref: str) -> str:
        """A hub id resolved from the local cache, with the commit the build read (`ref` itself otherwise)."""
        from moe_upcycle.terminal.hints import is_hub_id

        if not is_hub_id(ref.partition("@")[0]):
            return ref
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                snapshot = resolve_model(ref, "manifest")
        except UpcycleError:
            return ref
        found = _cached_hub_id(snapshot)
        return f"{ref.partition('@')[0]}@{found.partition('@')[2]}" if found else ref

    def scrub(self, data, extra: Optional[dict[str, str]] = None):
        """`data` (JSON values) with every local form of a recorded reference replaced by what was recorded."""
        forms = {**self.written, **(extra or {})}
        # one pass, the longest spelling first (a folder before its parent): a replacement is never replaced again
        pattern = re.compile("|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))) if forms else None

        def clean(value):
            if isinstance(value, str):
                return pattern.sub(lambda m: forms[m.group(0)], value) if pattern else value
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value
        return clean(data)


def _cached_hub_id(path: Path) -> Optional[str]:
    """``org/name@<commit>`` for a snapshot folder of the Hugging Face cache (``models--org--name/snapshots/<commit>``,
    or a folder inside it), else None."""
    parts = path.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--") and parts[i - 1].count("--") >= 2:
            org, name = parts[i - 1][len("models--"):].split("--", 1)
            sub = "/".join(parts[i + 2:])
            return None if sub else f"{org}/{name}@{parts[i + 1]}"
    return None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's uid): the home folder is what names the user
        return Path.home().name
