"""Publish a sharded MoE as the Hugging Face folder a build writes, one parameter at a time.

`save_hf_folder(model, output)` is a collective: every rank of the job calls it. Each parameter is gathered whole
once (``full_tensor``; a plain parameter is used as it is) and rank 0 streams every tensor made from it into the
build's safetensors layout (`checkpoint.writer.ShardedWriter`): the names a build writes, from the model's
`param_table` (transformers 5's fused ``mlp.experts.gate_up_proj`` (E, 2I, H) becomes ``...experts.{e}.w1.weight``
/ ``w3`` (Mixtral) or ``gate_proj`` / ``up_proj`` (Qwen-MoE), its router ``mlp.gate`` Mixtral's
``block_sparse_moe.gate``; a tied head is its embedding's entry, written right after it where llama.cpp needs
``lm_head.weight``), in the parameters' own dtypes, shards of at most `max_shard_size`, the index. Then config.json and generation_config.json (transformers' own, from the
model), the tokenizer, and our manifest (``moe_upcycle.json``: every file's sha256, so ``force=True`` may later
replace the folder). The folder is staged beside the target and renamed into place only when complete
(`output_dir.staged_output`); a failure on any rank stops every rank and nothing is published.

Memory: every rank holds one whole parameter while it is written (the largest is one layer's fused experts).
A model that holds no DTensor (one process) is written the same way.

From a ``torch.distributed.checkpoint`` (DCP) checkpoint: make the sharded MoE as for training (`upcycle_model` on
the sharded dense model), ``dcp.load`` the checkpoint into its state dict (any world size reads any other), then
call this. It writes no optimizer state (DCP keeps that) and no model card.
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.param_table import ParamTable, param_table
from moe_upcycle.checkpoint.output_dir import check_target, made_parent, staged_output
from moe_upcycle.checkpoint.writer import ShardedWriter, TensorSpec
from moe_upcycle.distributed.fsdp_layout import reshard
from moe_upcycle.distributed.local_fill import full_tensor
from moe_upcycle.distributed.rank_failures import all_or_none, world
from moe_upcycle.dtypes import dtype_name, model_dtype
from moe_upcycle.errors import ConfigError
from moe_upcycle.planning.llamacpp import LLAMACPP
from moe_upcycle.publish.manifest import write_recipe
from moe_upcycle.publish.model_files import copy_tokenizer_files, write_config
from moe_upcycle.recipe.schema import parse_size


def hf_table(model: torch.nn.Module) -> ParamTable:
    """`model`'s `param_table` with the tensors a build writes: a tied head gets its own tensor only where a build
    writes one (llama.cpp's Qwen2-MoE needs ``lm_head.weight``)."""
    layout = names.OUTPUT_LAYOUTS.get(getattr(model.config, "model_type", None))
    head = layout is not None and LLAMACPP[layout.model_type].needs_lm_head
    return param_table(model, written_aliases=(names.LM_HEAD,) if head else ())


def save_hf_folder(model: torch.nn.Module, output: Union[str, Path], *, tokenizer: Any = None,
                   max_shard_size: Union[int, str] = "5GB", force: bool = False, checksums: bool = True) -> Path:
    """Write `model` (sharded with FSDP2 or not) as the Hugging Face folder a build writes; call it on every rank.

    Args:
        model: the MoE (from `upcycle_model`, trained or not, or with a DCP checkpoint loaded into it).
        output: the folder to create (made atomically by rank 0).
        tokenizer: a folder whose tokenizer files are copied (the dense model's), or a tokenizer (its
            ``save_pretrained``); None: no tokenizer.
        max_shard_size: bytes per safetensors file, e.g. "5GB".
        force: replace an existing folder that an earlier build or export wrote (never a folder of yours).
        checksums: record every shard's sha256 in the manifest.

    Returns:
        The output folder (on every rank).

    Raises:
        ConfigError: an argument of the wrong type or value (all of them, named), raised on every rank before
            anything is written.
        OutputError: the folder cannot be written, or is not ours to replace; raised on every rank, and nothing is
            published.

    Example:
        >>> save_hf_folder(moe, "my-moe", tokenizer="path/to/dense")  # doctest: +SKIP
    """
    problems = [f"{name}: expected True or False, got {value!r}" for name, value in
                (("force", force), ("checksums", checksums)) if not isinstance(value, bool)]
    if not isinstance(output, (str, os.PathLike)) or not str(output):
        problems.append(f"output: expected a folder path, not {output!r}")
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        problems.append(f"model: expected the MoE (a transformers model), not {type(model).__name__}")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as exc:
        problems.append(f"max_shard_size: {exc}")
    if problems:
        raise ConfigError(*problems)
    target = Path(output).expanduser().resolve()
    folder = Path(tokenizer).expanduser() if isinstance(tokenizer, (str, Path)) else None
    if folder is not None and not folder.is_dir():
        raise ConfigError(f"tokenizer: {folder} is not a folder; pass the dense model's folder (its tokenizer files "
                          f"are copied), a loaded tokenizer, or None")
    if tokenizer is not None and folder is None and not hasattr(tokenizer, "save_pretrained"):
        raise ConfigError(f"tokenizer: expected a folder or a tokenizer with save_pretrained, not "
                          f"{type(tokenizer).__name__}")
    reshard(model)  # after an evaluation forward the root's parameters are whole: each rank gathers its shards
    table = hf_table(model)
    params = dict(model.named_parameters())
    rank, size = world()
    with ExitStack() as stack:
        writer: Optional[ShardedWriter] = None
        with all_or_none(f"preparing {target}"):
            if rank == 0:
                stack.enter_context(made_parent(target))
                check_target(target, force, inputs=[folder] if folder else [])
                stage = stack.enter_context(staged_output(target, force))
                writer = ShardedWriter(stage, [TensorSpec(t.key, t.shape, e.dtype) for e, t in table.to_hf()],
                                       max_bytes, checksums)
                stack.enter_context(_aborted_on_error(writer))
        for entry in table.entries:  # each storage gathered once (a tied head is its embedding's entry)
            whole = full_tensor(params[entry.name])  # every rank, in the same order
            with all_or_none(f"writing {entry.name} into {target}"):
                if writer is not None:
                    for tensor in entry.hf:
                        writer.write(tensor.key, whole if tensor.index is None else whole[tensor.index])
            del whole
        with all_or_none(f"finishing {target}"):
            if writer is not None:
                writer.close()
                _write_files(model, stage, tokenizer, folder)
                write_recipe(stage, None, writer.sha256, skip=() if checksums else writer.files,
                             extra={"exported": {"by": "moe_upcycle.distributed.save_hf_folder", "world_size": size}})
        with all_or_none(f"publishing {target}"):
            stack.close()  # rank 0: renamed into place
    return target


def hf_config(model: torch.nn.Module) -> dict:
    """The config.json a build writes for `model`: the fields transformers' ``save_pretrained`` writes (those that
    differ from the class defaults), the class in ``architectures`` (never the ``FSDP...`` class FSDP2 swaps in)
    and the legacy ``torch_dtype`` that transformers 4.x reads."""
    config = model.config.to_diff_dict()
    config.pop("transformers_version", None)
    layout = names.OUTPUT_LAYOUTS.get(config.get("model_type"))
    config["architectures"] = [layout.class_name if layout else type(model).__name__.removeprefix("FSDP")]
    # the weights' dtype as written (most bytes), not the one the model was made with: it may have been cast since
    config["dtype"] = config["torch_dtype"] = dtype_name(model_dtype(model))
    return dict(sorted(config.items()))


def _write_files(model: torch.nn.Module, stage: Path, tokenizer: Any, folder: Optional[Path]) -> None:
    """config.json, the tokenizer, then generation_config.json (the model's own wins over a copied one)."""
    write_config(stage, hf_config(model))
    if folder is not None:
        copy_tokenizer_files(folder, stage)
    elif tokenizer is not None:
        tokenizer.save_pretrained(str(stage))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(stage))


@contextmanager
def _aborted_on_error(writer: ShardedWriter) -> Iterator[None]:
    """Close the writer's open file when the export fails (before its staging folder is removed)."""
    try:
        yield
    except BaseException:
        writer.abort()
        raise
