"""Files in a built folder that the build did not write: ``verify``'s look at what else would load or upload.

The manifest (``moe_upcycle.json``) records the sha256 of every file a build wrote, so anything else in
the folder came later: a stale export, a training checkpoint, a file copied in by hand. All of it is
uploaded with the folder (``huggingface_hub`` skips only ``.git`` and its own ``.cache/huggingface``),
and some of it changes what a loader reads, whatever the build wrote:

- ``model.safetensors`` beside a sharded build: transformers looks for that file first and loads it
  instead of the index's shards;
- any other ``model*.safetensors``: llama.cpp's ``convert_hf_to_gguf.py`` reads every such file in the
  folder, with or without an index;
- a tokenizer file (`names.is_tokenizer_file`: special_tokens_map.json, chat_template.jinja, ...):
  AutoTokenizer reads it, so the special tokens or the chat template are no longer the base's.

Those are problems; any other file is a note naming it. Nothing here reads a file's content.
"""

from __future__ import annotations

import os
from pathlib import Path

from moe_upcycle.checkpoint.names import is_tokenizer_file

HUB_IGNORED = (".git", ".cache/huggingface")  # never uploaded by huggingface_hub's upload_folder
MAX_NAMED = 5


def stray_files(folder: Path, written: set[str], manifest: str) -> tuple[list[str], list[str]]:
    """(problems, notes) about the files in `folder` that are neither in `written` nor the `manifest` itself.

    Args:
        folder: the built model folder.
        written: the files the build wrote, relative to `folder` (the manifest's sha256 names).
        manifest: the manifest's file name.

    Example:
        A ``checkpoint-500/`` of 3 files gives the note ``not written by the build: checkpoint-500/ (3 files);
        they are uploaded with the folder``.
    """
    problems: list[str] = []
    others: dict[str, int] = {}  # a top-level name -> how many files under it
    for rel in _files(folder):
        if rel in written or rel == manifest:
            continue
        why = _loaded_instead(rel, written)
        if why:
            problems.append(f"{rel}: not written by the build, but {why}; remove it (or rebuild into an empty folder)")
        else:
            top, sep, _ = rel.partition("/")
            others[top + sep] = others.get(top + sep, 0) + 1
    notes = []
    if others:
        named = [name if not name.endswith("/") else f"{name} ({n} file{'s' * (n != 1)})" for name, n in others.items()]
        shown = ", ".join(named[:MAX_NAMED]) + (f" and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else "")
        notes.append(f"not written by the build: {shown}; they are uploaded with the folder (remove what should not be)")
    return problems, notes


def _loaded_instead(rel: str, written: set[str]) -> str:
    """Why a loader reads this unwritten file (relative path) along with or instead of the build's, or ''."""
    if rel == "model.safetensors" and any(name.endswith(".safetensors.index.json") for name in written):
        return "transformers loads model.safetensors instead of the index's shards"
    if "/" not in rel and rel.startswith("model") and rel.endswith(".safetensors"):
        return "llama.cpp's convert_hf_to_gguf.py reads every model*.safetensors in the folder"
    if is_tokenizer_file(rel):
        return "AutoTokenizer reads it, so the tokenizer is no longer the base's"
    return ""


def _files(folder: Path) -> list[str]:
    """Every file and link under `folder`, relative and '/'-separated, sorted; huggingface_hub's ignored folders
    left out, links to folders not followed."""
    found: list[str] = []
    for root, dirs, names in os.walk(folder):
        rel_root = Path(root).relative_to(folder).as_posix()
        prefix = "" if rel_root == "." else rel_root + "/"
        linked = [d for d in dirs if (Path(root) / d).is_symlink()]
        dirs[:] = [d for d in dirs if d not in linked and prefix + d not in HUB_IGNORED]
        found += [prefix + n for n in names + linked]
    return sorted(found)
