"""Verify a built MoE folder: does it load, is every tensor there, how far is it from the dense base?

`verify(folder)` checks, in order: the safetensors files and index (truncated or inconsistent
shards), the sha256 recorded in ``moe_upcycle.json``, the tensors on disk against the plan (re-made
from the recorded recipe, headers only), the router fields of config.json, and loading with
``AutoModelForCausalLM``/``AutoTokenizer`` exactly as a user would (missing, unexpected or
mismatched keys; and, against the plan, which layers it built as MoE blocks — ``moe_layers:``): in the
folder's own dtype and with the experts implementation transformers
picks for it, so an output that cannot run where it is published (a bf16 build whose experts
grouped_mm cannot multiply) fails here, and so do NaN logits; the greedy continuations shown are
this run's. Then, against the dense base (the recipe's ``base_model`` unless given), it compares
logits on sample prompts (max |Δlogit|, top-1 agreement, mean KL(dense‖moe)) and perplexity on a
text, both models in fp32, so the numbers measure the upcycling, not the dtype's arithmetic.

What it costs: each model is loaded once. A 16-bit output runs as written (prompts and the
continuations), then is upcast in place to fp32 (exact: the same logits as an fp32 load, without a
second load) for the comparison run. The prompts are tokenized once, by the output's tokenizer,
and every model gets the same ids; they run as batches, and the continuations are generated as one
batch, so each model makes a handful of forward calls (prompts, text, `max_new_tokens` decoding
steps) rather than one per prompt and per new token. The continuations are 8 new tokens by default
(16 before issue 17): they are shown, not scored, so no reported figure depends on their length.
The dense base generates only past the first token where its greedy choice departs from the MoE's
continuation (`continuations.accept_draft`). The MoE is freed before the dense base is
loaded, so memory peaks at the MoE in fp32, never both models. Config fields are read under
each architecture's own names (`names.OutputLayout.experts_key`: ``num_local_experts`` for
Mixtral, ``num_experts`` for Qwen MoE).

Every failed check becomes a problem in the `VerifyResult` (``ok`` is False) rather than an
exception, so a build can record it in the model card. Thresholds: ``max_kl``/``min_agreement``
when given; when the recipe makes every expert an unmodified copy of the base (a
function-preserving upcycle) they default to `IDENTITY_MAX_KL`/`IDENTITY_MIN_AGREEMENT`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
from dataclasses import replace
from importlib.resources import files
from pathlib import Path
from typing import Optional, Union

import torch

from moe_upcycle.check.compare import (TokenizerLoadError, compare_logits, encode_inputs, load_causal_lm, run_model,
                                        upcast_to_fp32)
from moe_upcycle.check.stray_files import stray_files
from moe_upcycle.check.tokenizer_files import tokenizer_differences
from moe_upcycle.check.verify_report import VerifyResult
from moe_upcycle.checkpoint.names import layout_of_config, output_layout
from moe_upcycle.checkpoint.output_dir import build_running, folder_identity
from moe_upcycle.checkpoint.ownership import written_files
from moe_upcycle.checkpoint.manifest_file import MANIFEST as RECIPE_NAME, load_manifest
from moe_upcycle.checkpoint.headers import TensorInfo, read_safetensors_header
from moe_upcycle.checkpoint.lora import Adapter, split_ref
from moe_upcycle.checkpoint.model_refs import resolve_model
from moe_upcycle.checkpoint.source import open_checkpoint
from moe_upcycle.checkpoint.weight_files import index_files
from moe_upcycle.checkpoint.writer import INDEX_NAME
from moe_upcycle.dtypes import dtype_name
from moe_upcycle.errors import ConfigError, SourceError, UpcycleError, reraise_if_out_of_memory
from moe_upcycle.planning import hybrid
from moe_upcycle.planning.model_config import TRAINING_SWITCHES
from moe_upcycle.planning.replan import RecordedBuild, recorded_build, recorded_config
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.layer_words import layers_said
from moe_upcycle.recipe.params import CheckParams
from moe_upcycle.recipe.values import device_problem
from moe_upcycle.inputs.text import decode_utf8, read_utf8
from moe_upcycle.check.moe_folder import require_moe
from moe_upcycle.terminal.progress import advance, stage, staged

IDENTITY_MAX_KL = 1e-3  # nats per position; bf16 output of stories260K measures 1.4e-4, a corrupted expert > 0.1
IDENTITY_MIN_AGREEMENT = 0.95
MERGEKIT_RECIPE = "mergekit_moe_config.yml"  # mergekit-moe saves its config beside its output
EDITABLE_FILES = ("README.md",)  # a publisher may edit the card (e.g. the license); not a failure
MAX_NEW_TOKENS = 1024  # each token is a forward pass of both models (100,000 took minutes even on stories260K)
VERIFY_STEPS = 5  # progress: files and plan, load the MoE, run it, load the dense base, run it


def default_prompts() -> list[str]:
    """The sample prompts shipped with the package (moe_upcycle/data/verify_prompts.txt)."""
    return read_prompts(files("moe_upcycle") / "data" / "verify_prompts.txt")


def default_text() -> str:
    """The short perplexity text shipped with the package (moe_upcycle/data/verify_text.txt)."""
    return _read_text(files("moe_upcycle") / "data" / "verify_text.txt", "--text")


def read_prompts(path) -> list[str]:
    """Prompts from a text file: one per line; blank lines and ``#`` comments are skipped. A ``.jsonl``, ``.json``,
    ``.csv``, ``.tsv``, ``.yaml`` or ``.yml`` file is read as `route --prompts` reads it (records, lists).

    Raises:
        SourceError: the file is missing or holds no prompt.
    """
    if isinstance(path, (str, Path)) and Path(path).suffix.lower() in (".jsonl", ".json", ".csv", ".tsv", ".yaml",
                                                                         ".yml"):
        from moe_upcycle.recipe.prompt_sets import read_prompt_file

        try:
            return read_prompt_file(Path(path))
        except UpcycleError as exc:
            raise SourceError(*[f"--prompts: {problem}" for problem in exc.problems]) from None
    lines = _read_text(path, "--prompts").splitlines()
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise SourceError(f"--prompts: {path} holds no prompt; write one prompt per line")
    return prompts


def _read_text(path, option: str) -> str:
    if isinstance(path, (str, Path)):
        return read_utf8(Path(path), f"{option}: {path}", SourceError, fix="; give a UTF-8 text file")
    return decode_utf8(path.read_bytes(), f"{option}: {path}", SourceError)  # a package resource


def _listed(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_files(folder: Path, result: VerifyResult) -> tuple[dict[str, TensorInfo], list[str]]:
    """Check shards against the index (every header intact); return the tensors on disk, and the weight files
    that could not be read (already reported: their tensors are not reported again as missing)."""
    index = folder / INDEX_NAME
    if index.is_file() and (folder / "model.safetensors").is_file():  # transformers looks for that file first
        result.notes.append(f"model.safetensors and {INDEX_NAME} are both here: transformers loads model.safetensors "
                            f"and ignores the index, so model.safetensors is the file checked")
        by_file = {"model.safetensors": None}
    elif index.is_file():
        try:  # the loaders' own reading of an index: no name outside the folder, every shard there
            by_file: dict[str, Optional[set]] = index_files(index)
        except SourceError as exc:
            result.problems += exc.problems
            return {}, []
        except OSError as exc:
            result.problems.append(f"{index}: cannot read it ({exc.strerror or exc})")
            return {}, []
    elif (folder / "model.safetensors").is_file():
        by_file = {"model.safetensors": None}
    else:
        result.problems.append(f"{folder}: no {INDEX_NAME} or model.safetensors; the weights are missing")
        return {}, []
    tensors: dict[str, TensorInfo] = {}
    unread: list[str] = []
    for file, listed in by_file.items():
        try:
            found = read_safetensors_header(folder / file)
        except SourceError as exc:
            result.problems += exc.problems
            unread.append(file)
            continue
        if listed is not None:
            if listed - set(found):
                result.problems.append(f"{file}: the index lists {_listed(sorted(listed - set(found)))} in this "
                                       f"shard but it does not contain them")
            if set(found) - listed:
                result.problems.append(f"{file}: holds {_listed(sorted(set(found) - listed))} which the index does "
                                       f"not list; transformers loads every tensor of a shard it reads, so these "
                                       f"replace or add to the listed ones — remove them, or rebuild")
        tensors.update(found)
    return tensors, unread


def check_hashes(folder: Path, recipe: dict, result: VerifyResult) -> None:
    """Compare every file's sha256 with the one recorded at build time."""
    listed = [folder / name for name in recipe.get("sha256", {})]
    with stage("hash", total=sum(p.stat().st_size for p in listed if p.is_file()), unit="bytes") as st:
        _check_hashes(folder, recipe, result, st)


def _check_hashes(folder: Path, recipe: dict, result: VerifyResult, st) -> None:
    for name, digest in sorted(recipe.get("sha256", {}).items()):
        path = folder / name
        if not path.is_file():
            result.problems.append(f"{name}: recorded in {RECIPE_NAME} but missing from the folder")
            continue
        h = hashlib.sha256()
        try:
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(2**24), b""):
                    h.update(chunk)
                    st.advance(len(chunk), note=name)
        except OSError as exc:
            result.problems.append(f"{name}: cannot read it ({exc.strerror or exc}); its sha256 was not checked")
            continue
        if h.hexdigest() != digest:
            if name in EDITABLE_FILES:
                result.notes.append(f"{name} was edited after the build (its sha256 differs from {RECIPE_NAME})")
            else:
                result.problems.append(f"{name}: sha256 differs from the one recorded in {RECIPE_NAME} at build time; "
                                       f"the file was modified or damaged — rebuild it")


def check_against_plan(tensors: dict[str, TensorInfo], plan: Plan, result: VerifyResult,
                       files_unread: bool = False) -> None:
    """Every planned tensor on disk with its planned shape and dtype, and nothing else (none is called missing when
    a weight file could not be read: that file is the finding)."""
    planned = {s.name: s for s in plan.steps}
    result.planned_tensors = len(planned)
    missing = [] if files_unread else sorted(set(planned) - set(tensors))
    unexpected = sorted(set(tensors) - set(planned))
    if missing:
        result.problems.append(f"{len(missing)} planned tensor(s) missing from the output: {_listed(missing)}")
    if unexpected:
        result.problems.append(f"{len(unexpected)} tensor(s) in the output that the plan does not have: "
                               f"{_listed(unexpected)}")
    for name in sorted(set(planned) & set(tensors)):
        s, t = planned[name], tensors[name]
        if (s.shape, s.dtype) != (t.shape, t.dtype):
            result.problems.append(f"tensor {name}: on disk {list(t.shape)} {t.dtype}, planned {list(s.shape)} "
                                   f"{s.dtype}")


@staged("verify", total=VERIFY_STEPS)
def verify(
    folder: Union[str, Path],
    base: Union[str, Path, None] = None,
    *,
    text: Union[str, Path, None] = None,
    prompts: Union[str, Path, None] = None,
    max_kl: Optional[float] = None,
    min_agreement: Optional[float] = None,
    hashes: bool = True,
    max_new_tokens: int = 8,
    device: str = "cpu",
    check: Optional[CheckParams] = None,
    plan: Optional[Plan] = None,
) -> VerifyResult:
    """Verify an MoE folder — the library form of ``moe-upcycle verify``.

    Args:
        folder: the built model folder.
        base: the dense model to compare with; default: the recipe's ``base_model``.
        text: a text file for perplexity; default: the short text shipped with the package.
        prompts: a file of prompts, one per line; default: the shipped prompts plus each
            expert's first positive prompt.
        max_kl: fail when mean KL(dense‖moe) is above this.
        min_agreement: fail when top-1 agreement is below this (0..1).
        hashes: check each file's sha256 against ``moe_upcycle.json``.
        max_new_tokens: length of the greedy continuations (each new token is a decoding step, a
            forward pass of the whole model; the continuations are shown, not scored).
        device: where both models run ("cpu", "cuda").
        check, plan: the build's own (``build --verify``); default: re-made from the recorded recipe.

    Returns:
        The result; ``result.ok`` is False when any check failed.

    Raises:
        SourceError: the folder, an explicitly given base, text or prompts file cannot be read.

    Example:
        >>> verify("tiny-moe").ok  # doctest: +SKIP
        True
    """
    folder = Path(os.path.expanduser(folder)).resolve()
    if not folder.exists():
        raise SourceError(f"OUT: {folder} does not exist; give the folder a build wrote")
    if not (folder / "config.json").is_file():
        raise SourceError(f"OUT: {folder} is not a model folder (no config.json); give the folder a build wrote")
    _check_options(device, max_new_tokens, max_kl, min_agreement)
    experts = require_moe(folder)  # a dense folder would "pass" against its own base
    base_given = _explicit_base(base, folder, experts)  # before any model is loaded: a wrong --base fails at once
    running = build_running(folder)
    if running:  # its --force swap would replace the folder while it is read
        raise SourceError(f"OUT: {running}; verify the folder after that build finishes")
    before = folder_identity(folder)
    replaced = (f"{folder} was replaced while verify read it (a build --force into it finished meanwhile), so what "
                f"it found mixes two builds; run verify again")
    try:
        result = _checked(folder, base, base_given, text=text, prompts=prompts, max_kl=max_kl,
                          min_agreement=min_agreement, hashes=hashes, max_new_tokens=max_new_tokens, device=device,
                          check=check, plan=plan)
    except (UpcycleError, OSError):
        if folder_identity(folder) != before:
            raise SourceError(replaced) from None
        raise
    if folder_identity(folder) != before:  # a build --force put another folder in its place meanwhile
        result.problems = [replaced]
    return result


def _checked(folder: Path, base, base_given: Optional[tuple[Path, Optional[Adapter]]], *, text, prompts,
             max_kl: Optional[float], min_agreement: Optional[float], hashes: bool, max_new_tokens: int, device: str,
             check: Optional[CheckParams], plan: Optional[Plan]) -> VerifyResult:
    """`verify`'s checks of a folder that stays in place while they run (arguments as `verify` resolved them)."""
    result = VerifyResult(folder=str(folder))
    recipe = load_manifest(folder)  # raises when it is there but damaged
    recorded: Optional[RecordedBuild] = None
    if check is None and recipe is not None:
        config = recorded_config(recipe, folder)
        if config is None:
            result.notes.append(f"{RECIPE_NAME}: it records no config; checks without the recipe")
        else:
            try:
                recorded = recorded_build(config)
                check = recorded.check
            except UpcycleError as exc:
                result.notes.append(f"{RECIPE_NAME}: its config is unreadable ({exc}); checks without the recipe")
    if recipe is None and check is None:
        result.notes.append(f"no {RECIPE_NAME} (not built by moe-upcycle?): sha256 and plan checks skipped")
    text_str = _read_text(Path(text), "--text") if text is not None else default_text()
    if text is not None and not text_str.strip():
        raise SourceError(f"--text: {text} holds no text, so there is no perplexity to measure; give a text file "
                          f"(or leave --text out for the shipped text)")
    prompt_list = read_prompts(prompts) if prompts is not None else _default_prompts(check)

    tensors, unread = check_files(folder, result)
    result.num_tensors = len(tensors)
    if hashes and recipe is not None:
        check_hashes(folder, recipe, result)
    if recipe is not None and isinstance(recipe.get("sha256"), dict):  # what the build wrote: anything else came later
        problems, notes = stray_files(folder, written_files(folder, recipe["sha256"], links=True), RECIPE_NAME)
        result.problems += problems
        result.notes += notes
    if plan is None and recorded is not None:
        try:
            plan = recorded.plan()
        except UpcycleError as exc:
            result.notes.append(f"could not re-make the plan from {RECIPE_NAME} ({'; '.join(exc.problems)}); "
                                f"tensors checked by transformers only")
    if plan is not None:
        check_against_plan(tensors, plan, result, bool(unread))
    switches = _check_config(folder, plan, result)
    if unread:  # transformers would only say the same file is "not found"
        result.notes.append("not loaded with transformers: a weight file cannot be read (see above)")
        return result

    advance("verify", note="loading the MoE with transformers")
    try:
        # as a user would: the folder's own dtype (a training switch turned off, named above: the rest is checked)
        moe = load_causal_lm(folder, dtype="auto", device=device, overrides=dict.fromkeys(switches, False))
    except TokenizerLoadError as exc:
        result.problems.append(str(exc))
        return result
    except Exception as exc:  # any loading failure is the finding, whatever transformers raises
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        result.problems.append(f"does not load with transformers AutoModelForCausalLM: {_first_line(exc)}")
        return result
    result.loaded_class = moe.class_name
    dtype = moe.model.dtype
    result.loaded_dtype = dtype_name(dtype)
    result.experts_implementation = getattr(moe.model.config, "_experts_implementation", None)
    for kind, keys in (("missing", moe.missing_keys), ("unexpected", moe.unexpected_keys),
                       ("mismatched", moe.mismatched_keys)):
        if keys:
            result.problems.append(f"transformers reports {len(keys)} {kind} key(s) when loading: {_listed(keys)}")
    if plan is not None and moe.class_name != output_layout(plan.architecture).class_name:
        result.problems.append(f"loaded as {moe.class_name}, expected {output_layout(plan.architecture).class_name}")
    _check_moe_layers(moe.model, plan, result)
    _check_layer_kinds(moe.model, plan, result)
    max_positions = int(getattr(moe.model.config, "max_position_embeddings", 0) or 2**31)
    inputs = encode_inputs(moe.tokenizer, prompt_list, text_str, max_positions)  # one tokenization for both models
    advance("verify", note=f"running the MoE on {len(prompt_list)} prompts")
    as_written = inputs if dtype == torch.float32 else replace(inputs, text=None)  # 16-bit: perplexity in fp32 below
    try:
        user_run = run_model(moe, prompt_list, text_str, max_new_tokens=max_new_tokens, inputs=as_written)
    except Exception as exc:  # e.g. grouped_mm on unaligned bf16 experts: the output does not run as written
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        result.problems.append(f"loads but does not run in transformers ({result.loaded_dtype}, experts: "
                               f"{result.experts_implementation}): {_first_line(exc)}")
        return result
    if not all(bool(t.isfinite().all()) for t in user_run.logits):
        result.problems.append(f"non-finite logits (NaN/inf) when run as written ({result.loaded_dtype})")
    # the comparison measures the upcycling, not the dtype: both models in fp32 (the thresholds' calibration).
    # A 16-bit model is upcast in place, not loaded a second time: bf16/fp16 -> fp32 is exact and the experts
    # implementation comes from config.json either way, so the logits are an fp32 load's, bit for bit.
    moe_run = user_run
    if dtype != torch.float32:
        user_run.logits = []  # checked above; the fp32 run's are compared
        upcast_to_fp32(moe.model)
        moe_run = run_model(moe, prompt_list, text_str, continuation_prompts=0, inputs=inputs)
    del moe
    gc.collect()  # the MoE is gone before the dense base is loaded: one model in memory at a time
    result.perplexity_moe, result.text_tokens = moe_run.perplexity, moe_run.text_tokens
    advance("verify", note="loading the dense base")

    base_path, adapter = base_given or _resolve_base(check, result, folder)
    if base_given and check is not None:
        _note_other_base(base, base_given, check.base_model, result)
    dense_run = None
    if base_path is not None:
        result.base = str(base if base is not None else check.base_model if check is not None else base_path)
        grown_from = _moe_experts(base_path)
        if grown_from:  # a grown MoE (`planning.grow`): "dense base" below is the MoE it grew
            result.notes.append(f"the base is an MoE ({grown_from} experts): the grown model is compared with the MoE "
                                f"it grew")
        problems, notes = tokenizer_differences(base_path, folder, ours=recipe is not None)
        result.problems += problems
        result.notes += notes
        try:
            dense = load_causal_lm(base_path, device=device, adapter=adapter)
        except SourceError:
            raise
        except Exception as exc:  # the reference itself is broken: the user must fix --base
            reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
            raise SourceError(f"dense base {base_path} does not load with transformers ({type(exc).__name__}: "
                              f"{exc}); pass a working --base DENSE") from None
        _note_tokenizer_difference(dense.tokenizer, prompt_list, inputs, result)
        advance("verify", note=f"running the dense base on {len(prompt_list)} prompts")
        dense_run = run_model(dense, prompt_list, text_str, max_new_tokens=max_new_tokens, inputs=inputs,
                              drafts=user_run.continuation_ids)  # decodes only where it departs from the MoE's
        advance("verify", note="compared")
        del dense
        gc.collect()
        result.comparison = compare_logits(dense_run.logits, moe_run.logits)
        result.perplexity_dense = dense_run.perplexity
    result.continuations = [{"prompt": p, "dense": dense_run.continuations[i] if dense_run else None, "moe": m}
                            for i, (p, m) in enumerate(zip(prompt_list, user_run.continuations))]
    _apply_thresholds(result, max_kl, min_agreement, check)
    return result


def _default_prompts(check: Optional[CheckParams]) -> list[str]:
    prompts = default_prompts()
    if check is not None:  # route through every expert: its first positive prompt
        prompts += list(check.routing_prompts)
    return list(dict.fromkeys(prompts))


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def _note_tokenizer_difference(dense_tokenizer, prompts: list[str], inputs, result: VerifyResult) -> None:
    """Note when the base's own tokenizer splits a prompt differently from the output's (both get the output's ids)."""
    differ = [p for p, ids in zip(prompts, inputs.prompts)
              if dense_tokenizer(p, return_tensors="pt")["input_ids"].tolist() != ids.tolist()]
    if differ:
        result.notes.append(f"transformers loads the base's tokenizer as {type(dense_tokenizer).__name__}, which "
                            f"tokenizes {len(differ)} prompt(s) differently from the output's (e.g. {differ[0]!r}); "
                            f"both models were fed the output's token ids")


def _check_moe_layers(model: torch.nn.Module, plan: Optional[Plan], result: VerifyResult) -> None:
    """Record which layers transformers built as MoE blocks, and compare them with the plan's (``moe_layers:``)."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if layers is None:
        return
    result.num_layers = len(layers)
    result.moe_layers = [i for i, layer in enumerate(layers)
                         if hasattr(layer, "block_sparse_moe") or hasattr(getattr(layer, "mlp", None), "experts")]
    if plan is not None and tuple(result.moe_layers) != plan.moe_layers:
        result.problems.append(f"transformers built MoE blocks in {layers_said(result.moe_layers)}, but the "
                               f"recipe makes {plan.moe_layers_text()} MoE layers; config.json's mlp_only_layers / "
                               f"decoder_sparse_step do not say what the build wrote — rebuild it")


def _check_layer_kinds(model: torch.nn.Module, plan: Optional[Plan], result: VerifyResult) -> None:
    """A hybrid output (Qwen3.5-MoE): transformers built each layer's token mixer as the dense base's layer_types
    says (``linear_attn``: Gated DeltaNet, ``self_attn``: full attention), so every copied tensor found its module."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    want = hybrid.layer_types(plan.base_config) if plan is not None else None
    if layers is None or not want or not output_layout(plan.architecture).layer_kinds:
        return
    built = ["linear_attention" if hasattr(layer, "linear_attn") else "full_attention" if hasattr(layer, "self_attn")
             else type(layer).__name__ for layer in layers]
    wrong = [i for i, (b, w) in enumerate(zip(built, want)) if b != w]
    if wrong or len(built) != len(want):
        i = wrong[0] if wrong else min(len(built), len(want))
        result.problems.append(f"transformers built layer {i} as {built[i] if i < len(built) else 'nothing'}, but the "
                               f"dense base's layer_types says {want[i] if i < len(want) else 'nothing'} "
                               f"({len(wrong)} layer(s) differ); config.json's layer_types is not the base's — "
                               f"rebuild")


def _check_config(folder: Path, plan: Optional[Plan], result: VerifyResult) -> list[str]:
    """Check config.json's expert fields against the recipe and fail a training switch left on (returned, so the
    model is loaded with it off and every other check still runs)."""
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    layout = layout_of_config(cfg)
    experts_key = layout.experts_key if layout else "num_local_experts"  # each architecture's own field name
    result.num_experts = cfg.get(experts_key)
    result.experts_per_token = cfg.get("num_experts_per_tok")
    switches = [key for key in TRAINING_SWITCHES if cfg.get(key) is True]
    for key in switches:
        result.problems.append(
            f"config.json: {key} is true, and published so: {TRAINING_SWITCHES[key]}. Set \"{key}\": false in "
            f"config.json (from a training script: model.config.{key} = False before save_pretrained); the other "
            f"checks ran with it false")
    if plan is not None:
        for key, want in ((experts_key, len(plan.expert_names)), ("num_experts_per_tok", plan.experts_per_token)):
            if cfg.get(key) != want:
                result.problems.append(f"config.json: {key} is {cfg.get(key)} but the recipe has {want}")
    return switches


def _check_options(device: str, max_new_tokens: int, max_kl: Optional[float],
                   min_agreement: Optional[float]) -> None:
    """Refuse a device name, continuation length or threshold that could only fail (or run for hours) later."""
    problems = []
    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    if max_kl is not None and not (number(max_kl) and max_kl >= 0):  # NaN fails too: no KL is ever above NaN
        problems.append(f"max_kl: {max_kl!r} is not a threshold; give a number >= 0 (nats per position)")
    if min_agreement is not None and not (number(min_agreement) and 0 <= min_agreement <= 1):
        problems.append(f"min_agreement: {min_agreement!r} is not a fraction; give a number from 0 to 1")
    if device_problem(device):
        problems.append(f"device: {device_problem(device)}")
    if not (number(max_new_tokens) and isinstance(max_new_tokens, int) and 1 <= max_new_tokens <= MAX_NEW_TOKENS):
        problems.append(f"max_new_tokens: {max_new_tokens!r} is not a number of tokens from 1 to {MAX_NEW_TOKENS}; "
                        f"the continuations are a glance at the text (default 8)")
    if problems:
        raise ConfigError(*problems)


def _moe_experts(path: Path) -> Optional[int]:
    """The routed-expert count of model folder `path` when it is an MoE, else None (dense, or unreadable: the load
    says why)."""
    try:
        return require_moe(path, "--base")
    except SourceError:
        return None


def _explicit_base(base, folder: Path, experts: int) -> Optional[tuple[Path, Optional[Adapter]]]:
    """The folder (and LoRA adapter) of an explicitly given --base, which must be a model; None when not given.
    An MoE is a base only for a grown MoE (`planning.grow`): one with fewer experts than `folder`'s `experts`."""
    if base is None:
        return None
    path, adapter = _model_and_adapter(str(base), "--base")  # given explicitly: an error if absent
    if not (path / "config.json").is_file():
        raise SourceError(f"--base: {path} is not a model folder (no config.json); give the dense model's folder")
    count = _moe_experts(path)  # None: dense, as it should be (or an unreadable config.json, which the load reports)
    grown = count is not None and count < experts and path.resolve() != folder  # a grown MoE against its base
    if count is not None and not grown:  # an MoE as the reference: the MoE itself (a typo) would PASS against itself
        raise SourceError(f"--base: {path} is itself a Mixture-of-Experts ({count} experts), not a dense model; "
                          f"verify compares the MoE with the dense model it was built from (or a grown MoE with the "
                          f"MoE it grew, which has fewer experts) — give that folder (the recipe's base_model)")
    return path, adapter


def _model_and_adapter(ref: str, field_name: str) -> tuple[Path, Optional[Adapter]]:
    """A reference's folder, and for mergekit's ``model+adapter`` the adapter merged into the dense reference."""
    if split_ref(ref)[1] is None:
        return resolve_model(ref, field_name), None
    checkpoint = open_checkpoint(ref, field_name)  # headers only: checks the adapter against the model
    return checkpoint.path, checkpoint.adapter


def _note_other_base(base, given: tuple[Path, Optional[Adapter]], recorded: str, result: VerifyResult) -> None:
    """Say so when --base is not the base_model the recipe recorded: the figures then measure the distance to
    another model (and a PASSED says nothing about the build). Silent when the recorded base cannot be found."""
    try:
        path, adapter = _model_and_adapter(recorded, f"{RECIPE_NAME} base_model")
    except UpcycleError:
        return
    same_adapter = (adapter is None) == (given[1] is None) and (adapter is None or
                                                                 adapter.path.resolve() == given[1].path.resolve())
    if path.resolve() != given[0].resolve() or not same_adapter:
        result.notes.append(f"--base {base} is not the base_model this MoE was built from ({recorded}, as "
                            f"{RECIPE_NAME} records it): the comparison below measures how far the MoE is from "
                            f"{base}, not from its own base")


def _resolve_base(check: Optional[CheckParams], result: VerifyResult,
                  folder: Path) -> tuple[Optional[Path], Optional[Adapter]]:
    """The recipe's base_model (and its LoRA adapter) — or, for a mergekit-moe output, the base_model its
    ``mergekit_moe_config.yml`` names — or None (with a note) when there is none to compare with."""
    where, base = f"{RECIPE_NAME} base_model", check.base_model if check is not None else None
    if base is None:
        where, base = MERGEKIT_RECIPE + " base_model", _mergekit_base(folder)
    if base is None:
        result.notes.append("no dense base to compare with (no recipe); pass --base DENSE")
        return None, None
    try:
        found = _model_and_adapter(base, where)
    except SourceError as exc:
        result.notes.append(f"dense comparison skipped: {exc.problems[0]} (pass --base DENSE)")
        return None, None
    if check is None:
        result.notes.append(f"dense base: {base}, as {MERGEKIT_RECIPE} names it (pass --base DENSE for another)")
    return found


def _mergekit_base(folder: Path) -> Optional[str]:
    """base_model of the mergekit-moe config saved beside its output, or None (absent, unreadable, not a name)."""
    import yaml

    try:
        data = yaml.safe_load((folder / MERGEKIT_RECIPE).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    base = data.get("base_model") if isinstance(data, dict) else None
    return base if isinstance(base, str) and base.strip() else None


def _apply_thresholds(result: VerifyResult, max_kl: Optional[float], min_agreement: Optional[float],
                      check: Optional[CheckParams]) -> None:
    given = [name for name, value in (("--max-kl", max_kl), ("--min-agreement", min_agreement)) if value is not None]
    if check is not None and check.function_preserving:
        max_kl = IDENTITY_MAX_KL if max_kl is None else max_kl
        min_agreement = IDENTITY_MIN_AGREEMENT if min_agreement is None else min_agreement
    c = result.comparison
    if c is None:  # no dense base: a threshold the user asked for fails, the recipe's own default is only unchecked
        if given:
            result.problems.append(f"{' and '.join(given)} compare with the dense base, which was not loaded (see the "
                                   f"note); pass --base DENSE")
        elif max_kl is not None:
            result.notes.append(f"the experts are unchanged copies of the base, so the MoE should compute what it "
                                f"does (mean KL <= {max_kl:g}, top-1 agreement >= {min_agreement:.0%}); without the "
                                f"base this was not checked — pass --base DENSE to check it")
        return
    result.max_kl, result.min_agreement = max_kl, min_agreement
    if max_kl is not None and not math.isfinite(c.mean_kl):
        result.problems.append(f"mean KL(dense‖moe) is {c.mean_kl}, not a number to check a threshold against: the "
                               f"MoE's or the dense base's logits hold NaN or inf (see perplexity), so the comparison "
                               f"says nothing; check both models' weights")
    elif max_kl is not None and c.mean_kl > max_kl:
        result.problems.append(f"mean KL(dense‖moe) is {c.mean_kl:.4g} nats, above the threshold {max_kl:g}; "
                               f"the MoE's predictions moved away from the dense model's")
    if min_agreement is not None and c.top1_agreement < min_agreement:
        result.problems.append(f"top-1 agreement with the dense model is {c.top1_agreement:.1%}, below the "
                               f"threshold {min_agreement:.1%}")
