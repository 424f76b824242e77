"""A fake Hugging Face cache in which the hub ids of published configs are tiny local models.

`build_hub_cache` writes ``models--org--name/{refs,snapshots}`` for every ``org/name[@revision]``
a set of configs names, each snapshot a folder of symlinks to a stand-in of the right family
(Phi ids → tiny Phi, Qwen3 ids → tiny Qwen3, other Qwen ids → tiny Qwen2, the rest → tiny Llama),
each id a fixed choice among the family's stand-ins. `local_refs` lists the references that are
folders (``name`` or ``/abs/path``), which a test lays out itself.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from pathlib import Path
from typing import Any, Optional

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def model_refs(data: Any) -> set[str]:
    """Every model reference (base, experts, shared experts) a parsed config names; malformed parts are skipped."""
    if not isinstance(data, dict):
        return set()
    refs = {data["base_model"]} if isinstance(data.get("base_model"), str) else set()
    for section in ("experts", "shared_experts"):
        items = data.get(section)
        for e in items if isinstance(items, list) else []:
            if isinstance(e, dict) and isinstance(e.get("source_model"), str):
                refs.add(e["source_model"])
    return refs


def is_hub_ref(ref: str) -> bool:
    return ref.count("/") == 1 and not ref.startswith(("/", ".", "~"))


def local_refs(data: Any) -> set[str]:
    """The references of a config that are folders, not hub ids."""
    return {r for r in model_refs(data) if not is_hub_ref(r)}


def family(repo: str) -> str:
    name = repo.lower()
    return "phi" if "phi-2" in name or "phi2" in name else "qwen3" if "qwen3" in name else (
        "qwen2" if "qwen" in name else "llama")


def build_hub_cache(root: Path, stand_ins: dict[str, list[Path]], refs: set[str],
                    overrides: Optional[dict[str, Path]] = None) -> Path:
    """Serve every hub id of `refs` from `root` (a Hugging Face cache folder); returns `root`.

    Args:
        stand_ins: family -> its stand-in model folders.
        overrides: hub id -> the folder to serve for it (e.g. a model of another size).
    """
    overrides = overrides or {}
    for ref in sorted(r for r in refs if is_hub_ref(r.partition("@")[0])):
        repo, _, revision = ref.partition("@")
        choices = stand_ins[family(repo)]
        model = overrides.get(repo) or choices[zlib.crc32(repo.encode()) % len(choices)]
        commit = revision if COMMIT_RE.match(revision) else hashlib.sha1(repo.encode()).hexdigest()
        folder = root / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / commit
        if not snapshot.exists():
            snapshot.mkdir(parents=True)
            for file in Path(model).iterdir():
                (snapshot / file.name).symlink_to(file)
        (folder / "refs").mkdir(exist_ok=True)
        if not COMMIT_RE.match(revision):
            (folder / "refs" / (revision or "main")).write_text(commit)
    return root
