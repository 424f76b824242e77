"""mergekit-moe's command-line options, met in a command line copied from a model card.

``mergekit-moe config.yaml merge --copy-tokenizer --allow-crimes --out-shard-size 1B --lazy-unpickle``
is how many published MoEs say they were made. Given to ``build`` or ``plan``, such options would end
in the parser's bare "No such option". (mergekit's ``--out-shard-size`` counts parameters, not bytes: its
``1B`` is 2GB of bfloat16.) `explain` says instead, for each, what moe-upcycle does or
takes in its place, and gives the command line to run; nothing is run with a guess.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Optional

# the commands that take a recipe, as mergekit-moe does
COMMANDS = ("build", "plan")


@dataclass(frozen=True)
class Flag:
    """One mergekit-moe option: how many values follow it, what moe-upcycle does instead, and the options
    of ours it becomes (``{value}`` stands for its value; empty: nothing to write)."""

    values: int
    instead: str
    ours: tuple[str, ...] = ()


FLAGS = {
    "--copy-tokenizer": Flag(0, "the base's tokenizer is always copied"),
    "--no-copy-tokenizer": Flag(0, "the base's tokenizer is always copied (an MoE without one cannot be verified)"),
    "--allow-crimes": Flag(0, "not needed: shapes and families are checked and every problem is named"),
    "--lazy-unpickle": Flag(0, "weights are always read lazily (safetensors mapped, .bin with weights_only)"),
    "--no-lazy-unpickle": Flag(0, "weights are always read lazily"),
    "--low-cpu-memory": Flag(0, "tensors are always streamed one at a time"),
    "--trust-remote-code": Flag(0, "not needed: the families read (Llama, Mistral, Qwen2, Qwen3) run no model code"),
    "--no-trust-remote-code": Flag(0, "no model code is ever run"),
    "--write-model-card": Flag(0, "a model card is always written"),
    "--no-write-model-card": Flag(0, "a model card is always written (delete README.md if you do not want it)"),
    "--safe-serialization": Flag(0, "the output is always safetensors"),
    "--i-understand-this-is-not-useful-without-training": Flag(0, "not needed for random routers"),
    "--allow-all-same": Flag(0, "not needed: identical experts build, with a note"),
    "--multi-stream": Flag(0, "not needed"),
    "--gpu-rich": Flag(0, "not needed"),
    "--verbose": Flag(0, "progress is always shown (-q before the command hides it)"),
    "-v": Flag(0, "progress is always shown"),
    "--quiet": Flag(0, "write -q before the command", ("@quiet",)),
    "--cuda": Flag(0, "runs the models on the GPU", ("--device", "cuda")),
    "--no-cuda": Flag(0, "runs the models on the CPU", ("--device", "cpu")),
    "--read-to-gpu": Flag(0, "runs the models on the GPU", ("--device", "cuda")),
    "--out-shard-size": Flag(1, "mergekit counts parameters per shard, not bytes: {value} parameters are {size} in "
                                "bfloat16 or float16 ({size32} in float32)", ("--max-shard-size", "{size}")),
    "--random-seed": Flag(1, "set it in the recipe: seed: {value}"),
    "--num-threads": Flag(1, "not needed"),
    "--transformers-cache": Flag(1, "set HF_HOME (or HF_HUB_CACHE) to that folder instead"),
    "--lora-merge-cache": Flag(1, "not needed: model+adapter is merged as it is read"),
    "--load-in-4bit": Flag(0, "not needed: hidden-state gates read the base one layer at a time, at full precision"),
    "--load-in-8bit": Flag(0, "not needed: hidden-state gates read the base one layer at a time, at full precision"),
}


def explain(command: str, args: list[str]) -> Optional[str]:
    """The message for mergekit-moe options among `args` (the arguments after `command`), or None when there are none.

    Example:
        >>> print(explain("build", ["config.yml", "merge", "--copy-tokenizer", "--out-shard-size", "1B"]))
        --copy-tokenizer, --out-shard-size 1B are mergekit-moe's options, not moe-upcycle's: --copy-tokenizer: the base's tokenizer is always copied; --out-shard-size 1B: mergekit counts parameters per shard, not bytes: 1B parameters are 2GB in bfloat16 or float16 (4GB in float32) → --max-shard-size 2GB. Run: moe-upcycle build config.yml merge --max-shard-size 2GB
    """
    if command not in COMMANDS:
        return None
    found, said, run = translate(command, args)
    if not found:
        return None
    return (f"{', '.join(found)} {'is' if len(found) == 1 else 'are'} mergekit-moe's option"
            f"{'' if len(found) == 1 else 's'}, not moe-upcycle's: {'; '.join(said)}. Run: {run}")


def translate(command: str, args: list[str]) -> tuple[list[str], list[str], str]:
    """(the mergekit-moe options found, what each becomes, the moe-upcycle command line to run instead)."""
    kept, found, said, quiet = [], [], [], False
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        flag = FLAGS.get(name) if name.startswith("-") else None
        if flag is None:
            kept.append(arg)
            i += 1
            continue
        value = inline if eq else (args[i + 1] if flag.values and i + 1 < len(args) else "")
        i += 1 + (flag.values if not eq else 0)
        shown = f"{name} {value}".strip()
        found.append(shown)
        sizes = {"size": _bytes(value, 2), "size32": _bytes(value, 4), "value": value}
        ours = [part.format(**sizes) for part in flag.ours if part != "@quiet"]
        quiet = quiet or "@quiet" in flag.ours
        kept += ours
        said.append(f"{shown}: {flag.instead.format(**sizes)}" + (f" → {' '.join(ours)}" if ours else ""))
    run = " ".join(["moe-upcycle", *(["-q"] if quiet else []), command, *(shlex.quote(a) for a in kept)])
    return found, said, run


def _bytes(value: str, per_parameter: int) -> str:
    """mergekit's shard size (parameters: ``1B`` a billion, ``500M``, ``2K``, a plain number) as bytes in our units,
    at `per_parameter` bytes each (2 for bfloat16 and float16, 4 for float32).

    Example:
        >>> _bytes("1B", 2), _bytes("500m", 2), _bytes("2K", 4), _bytes("5000000000", 2)
        ('2GB', '1GB', '8KB', '10GB')
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMbB]?)\s*", value)
    if not m:
        return value
    count = float(m.group(1)) * {"k": 1e3, "m": 1e6, "b": 1e9, "": 1}[m.group(2).lower()] * per_parameter
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= size:
            return f"{count / size:g}{unit}"
    return f"{count:g}"
