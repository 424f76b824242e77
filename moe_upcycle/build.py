"""The build pipeline, top to bottom: load config → open sources → plan → gates → write → publish.

`upcycle()` is the library form of ``moe-upcycle build``; each CLI option is one of its keyword
arguments. The output folder is staged beside the target and renamed into place only when every
file is complete (see `output_dir`).

Under torchrun every process runs the same `upcycle` as one rank of one build (`distributed`): each
plans, the lead (rank 0) checks the output and computes the gates for all, each writes its share of
the shards into the lead's staging folder, and the lead writes the rest and publishes. One process is
the world-size-1 case of the same code, and any number of ranks writes the same bytes.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from moe_upcycle.check.compare import LogitComparison
from moe_upcycle.check.drift import InitDrift, build_drift
from moe_upcycle.check.verify_report import VerifyResult
from moe_upcycle.checkpoint.output_dir import (  # noqa: F401 (RECIPE_NAME: public)
    RECIPE_NAME, check_target, made_parent, name_too_long, target_problem)
from moe_upcycle.checkpoint.source import Checkpoint, open_sources
from moe_upcycle.checkpoint.writer import ShardedWriter
from moe_upcycle.distributed.agreement import build_facts, check_agreement
from moe_upcycle.distributed.ranked_build import shared_stage, write_rank_shards
from moe_upcycle.distributed.world import joined_world
from moe_upcycle.errors import ConfigError, OutputError, UpcycleError, UpcycleWarning
from moe_upcycle.gates.checks import parallel_experts
from moe_upcycle.gates.grow_rows import grown_gates
from moe_upcycle.gates.router import check_prompts, compute_gate_rows
from moe_upcycle.gates.self_check import SelfCheck
from moe_upcycle.checkpoint.disk_space import check_free_space
from moe_upcycle.planning.guards import check_source_dtypes, check_tied_head
from moe_upcycle.planning.grow import BASE_ROUTERS, left_out
from moe_upcycle.planning.plan import Plan, Step, make_plan
from moe_upcycle.planning.plan_report import PlanSummary, summarize
from moe_upcycle.planning.report import sharing_report, sharing_summary
from moe_upcycle.publish.card import write_model_card
from moe_upcycle.publish.self_check_card import self_check_lines
from moe_upcycle.publish.manifest import write_recipe
from moe_upcycle.planning.model_config import moe_config
from moe_upcycle.publish.model_files import copy_tokenizer_files, missing_tokenizer_warning, write_config
from moe_upcycle.recipe.mergekit_names import semantics_note
from moe_upcycle.recipe.calibration import read_documents
from moe_upcycle.recipe.params import HIDDEN_MODES, PROMPT_MODES, CheckParams, GateParams
from moe_upcycle.recipe.resolve import source_refs
from moe_upcycle.recipe.resolved import resolved
from moe_upcycle.recipe.schema import UpcycleConfig, load_config
from moe_upcycle.checkpoint.ownership import input_paths
from moe_upcycle.inputs.paths import resolve_or_raise
from moe_upcycle.terminal.progress import stage as progress_stage  # `stage` names the staging folder in `upcycle`


@dataclass
class BuildResult:
    """What a build (or dry run) produced."""

    config: UpcycleConfig
    plan: Plan
    output: Optional[Path]
    sharing: list[str]
    shards: list[str] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    summary: Optional[PlanSummary] = None
    verify: Optional[VerifyResult] = None  # with `verify=True`
    drift: Optional[InitDrift] = None  # how far the init moved the model from the dense base
    gate_warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the plan's cautions; a mergekit config built with our router semantics
    sharing_line: str = ""  # `sharing` in one line, without paths (what `build` prints; -v prints `sharing`)
    self_check: Optional[SelfCheck] = None  # how many of its own prompts each expert wins (prompt-routed hidden gates)


def source_folders(sources: dict) -> list[Path]:
    """Every folder the build reads models from: model folders and LoRA adapter folders (never replaced)."""
    folders = [s.path for s in sources.values() if s.path]
    return folders + [s.adapter.path for s in sources.values() if s.adapter is not None]


def resolve_output(config: UpcycleConfig, output: Union[str, Path, None]) -> Path:
    """The output folder: the argument, else the config's `output:`."""
    chosen = output if output is not None else config.output
    if not chosen:
        raise ConfigError("output: no output folder given; pass OUT (or -o/--output) or set output: in the YAML")
    if str(chosen) == "-":
        raise OutputError("output -: a model is a folder of files, not a stream for standard output; give a folder "
                          "name (./- for a folder named '-')")
    target = resolve_or_raise(Path(os.path.expanduser(chosen)), OutputError, "output")
    too_long = name_too_long(target)
    if too_long:  # every later look at the path would raise "File name too long"
        raise OutputError(too_long)
    return target


def early_output_problem(recipe: Union[str, Path], config: UpcycleConfig, output: Union[str, Path, None],
                         force: bool) -> Optional[str]:
    """What the build will refuse about its output folder, found before any model is opened, so `build`
    can say it at once instead of after seconds of prompt lint.

    It may miss a problem (an output inside a source folder: the sources are not resolved here) but
    never reports one the build would not: the build itself then says it, with the same words. (With
    `force`, only files changed since the previous build are hashed, as the build does.)
    """
    try:
        target = resolve_output(config, output)
    except UpcycleError:
        return None  # the build says what is wrong with it
    full = target.parent.is_dir()  # a missing parent is made by the build
    return target_problem(target, force, (), input_paths(recipe, config, ()), full=full)


def check_call(output, on_step, **flags) -> None:
    """Refuse arguments of `upcycle` whose type would fail deep inside, or mean the opposite
    (``dry_run="no"`` is truthy: it would be a dry run).

    Raises:
        ConfigError: every wrong argument, named.
    """
    problems = [f"{name}: expected True or False, got {value!r}"
                for name, value in flags.items() if not isinstance(value, bool)]
    if output is not None and not isinstance(output, (str, os.PathLike)):
        problems.append(f"output: expected a folder path, not {type(output).__name__}")
    if flags.get("dry_run") is True and flags.get("verify") is True:
        problems.append("verify: a dry run writes nothing to verify; pass one of dry_run and verify")
    if not callable(on_step):
        problems.append(f"on_step: expected a function (step, plan) -> None, not {type(on_step).__name__}")
    if problems:
        raise ConfigError(*problems)


def check_device(config: UpcycleConfig, verify: bool = False) -> None:
    """Check that the recipe's device exists when the build will run a model on it.

    Hidden-state gate modes and ``verify`` run the base model; other modes never use the device,
    so a recipe written on a GPU machine still builds on a CPU one.

    Raises:
        DependencyError: ``cuda`` asked for and no GPU is visible (or too few).
    """
    if verify or config.gate_mode in HIDDEN_MODES:
        from moe_upcycle.gates.device import resolve_device

        resolve_device(config.device)


def prepare(config: Union[UpcycleConfig, str, Path, dict], from_config: bool = False,
            allow_unknown_keys: bool = False, **overrides) -> tuple[UpcycleConfig, dict, Plan]:
    """Validate the config, open the sources and plan; nothing is written.

    With `from_config`, sources are described from their config.json alone (`meta_model`).
    """
    where = f"{config}: " if isinstance(config, (str, Path)) else ""  # as load_config names the file
    if not isinstance(config, UpcycleConfig):
        config = load_config(config, overrides=overrides, allow_unknown_keys=allow_unknown_keys)
    elif any(v is not None for v in overrides.values()):
        config = load_config(config.model_dump(), overrides=overrides)
    # prompt-based gate modes without usable prompts: refused by plan too, before any model is opened
    try:
        same = config.same_prompts_problem()
        if same:
            raise ConfigError(same)
        check_prompts(resolved(config).gates)
    except ConfigError as exc:
        raise ConfigError(*[f"{where}{p}" for p in exc.problems]) from None
    if config.gate_mode == "kmeans" and config.calibration_text is not None:
        read_documents(config.calibration_text)  # a missing or unreadable text fails now, not after loading the base
    if from_config:
        from moe_upcycle.checkpoint.meta_model import meta_sources

        sources = meta_sources(source_refs(config))
    else:
        sources = open_sources(source_refs(config))
    with progress_stage("plan", total=1) as st:
        plan = make_plan(config, sources)
        check_source_dtypes(plan, sources)
        check_tied_head(plan, sources[config.base_model], config.base_model)
        st.advance(note=f"{len(plan.steps)} tensors")
    return config, sources, plan


def upcycle(
    config: Union[UpcycleConfig, str, Path, dict],
    output: Union[str, Path, None] = None,
    *,
    force: bool = False,
    dry_run: bool = False,
    tensor_policy: Optional[str] = None,
    max_shard_size: Union[int, str, None] = None,
    device: Optional[str] = None,
    batch_size: Optional[int] = None,
    checksums: Optional[bool] = None,
    on_step: Callable[[Step, Plan], None] = lambda step, plan: None,
    verify: bool = False,
    from_config: bool = False,
    allow_unknown_keys: bool = False,
    gate_source: Optional[str] = None,
) -> BuildResult:
    """Build an MoE checkpoint from dense checkpoint(s) — the library form of ``moe-upcycle build``.

    Args:
        config: a validated config, a YAML path, or a mapping.
        output: output folder (overrides the config's ``output:``).
        force: replace an existing non-empty output folder (atomically, at the end).
        dry_run: plan and check only; write nothing.
        tensor_policy: "share" or "clone" (overrides the config).
        max_shard_size: bytes per shard, e.g. "5GB" (overrides the config).
        device: where hidden-state gate modes run the base model: auto, cpu, cuda or cuda:N.
        batch_size: prompts per forward pass for hidden-state gate modes.
        checksums: record the sha256 of every shard (overrides the config; hashing costs more CPU
            than writing; it runs beside the writes, so turning it off saved 11–19 % of the wall time in
            scripts/bench_build.py on 2 cores).
        on_step: called with (step, plan) after each output tensor is written (progress); on a rank of a
            distributed build, for the tensors that rank writes.
        verify: run `verify.verify` on the finished files before they are moved into place and
            put its results in the model card and ``moe_upcycle.json``. A failed verification
            does not stop the build: check ``result.verify.ok`` (the CLI exits 1).
        from_config: plan from the sources' config.json alone, no weights needed (`dry_run` only).
        allow_unknown_keys: ignore genuinely unknown keys with a warning, as mergekit-moe does
            (misspelt keys are errors either way).
        gate_source: "native" or "mergekit" (mergekit-moe 0.1.5's router computation; overrides the config).

    Returns:
        The plan, its summary, the sharing report and, unless `dry_run`, the written files with
        their sha256 (and the verification result with `verify`). Every rank of a distributed build
        returns the same (its own `seconds`).

    Raises:
        UpcycleError: any problem with the config, the sources or the output folder; under torchrun,
            on every rank when it happened on any (`distributed.world`: the others name that rank).

    Example:
        >>> upcycle({"base_model": "tiny-llama", "num_experts": 4, "gate_mode": "random"}, "tiny-moe")  # doctest: +SKIP
    """
    start = time.perf_counter()
    check_call(output=output, on_step=on_step, force=force, dry_run=dry_run, verify=verify, from_config=from_config,
               allow_unknown_keys=allow_unknown_keys)
    recipe_source = config
    if from_config and not dry_run:
        raise ConfigError("from_config plans from config.json alone and can only be used with a dry run (plan)")
    with joined_world() as world, world.failing_together():  # torchrun's ranks, or this process alone
        config, sources, plan = prepare(config, from_config, allow_unknown_keys, tensor_policy=tensor_policy,
                                        max_shard_size=max_shard_size, device=device, batch_size=batch_size,
                                        checksums=checksums, gate_source=gate_source)
        if not dry_run:
            check_device(config, verify)  # before the output folder, the gates and any model load
        sharing = sharing_report(plan, sources, config.tensor_policy)
        target = resolve_output(config, output) if (not dry_run or output is not None or config.output) else None
        summary = summarize(config, plan, sources, sharing, target)
        if dry_run:
            problem = target and target_problem(target, force, source_folders(sources),
                                                input_paths(recipe_source, config, ()), full=False)
            if problem:  # what the build would refuse, whatever its --force
                raise OutputError(problem)
            return BuildResult(config, plan, None, sharing, summary=summary)
        # every rank has the same recipe, sources and plan, or none writes a byte (one all-gather)
        check_agreement(world, build_facts(config, sources, plan, target, resolved(config).writing.max_shard_bytes))
        with world.lead_context(made_parent, target):  # the parent folders it makes are removed again if it fails
            world.from_lead(check_output, target, force, source_folders(sources),
                            input_paths(recipe_source, config, ()), summary, sources[config.base_model])
            recipe = resolved(config)
            gating, writing, checking = recipe.gates, recipe.writing, recipe.checking
            gates, shared_gates, self_check = world.from_lead(make_gates, gating, plan, sources[config.base_model],
                                                              types=(SelfCheck,))
            gate_warnings = (self_check.warnings() if self_check else []) + ([] if plan.grow is not None else
                             parallel_experts(  # a grown MoE's copies' rows are parallel by design
                gates, plan.expert_names, group_size=gating.group_size, from_prompts=gating.mode in PROMPT_MODES,
                center=gating.center if gating.source == "native" else None))
            with shared_stage(world, target, force) as stage:  # each rank writes its shards; the lead publishes
                writer, hashes = write_rank_shards(world, stage, plan, sources, gates, shared_gates, writing, on_step)
                checked, drift, unlocated = world.from_lead(finish, stage, writer, hashes, config, plan, sources,
                                                            checking, verify, gating.device, target, self_check,
                                                            types=FINISHED)
        world.sync(last=True)  # the lead has put the output in place: every rank returns (or raises its failure)
    if checked:
        checked.folder = str(target)
    for ckpt in sources.values():
        ckpt.close()
    note = semantics_note(config)
    return BuildResult(config, plan, target, sharing, writer.files, hashes, time.perf_counter() - start,
                       summary, checked, drift, gate_warnings, [*plan.cautions, *([note] if note else []), *unlocated],
                       sharing_summary(plan, sources, config.tensor_policy), self_check)


FINISHED = (VerifyResult, LogitComparison, InitDrift)  # what `finish` returns, sent from the lead to every rank


def check_output(target: Path, force: bool, sources: list[Path], inputs: list[Path], summary: PlanSummary,
                 base: Checkpoint) -> None:
    """Refuse an output folder the build must not write (`check_target`) or that lacks the room; warn when the
    base has no tokenizer (the lead of a distributed build checks, for every rank)."""
    check_target(target, force, sources, inputs)
    check_free_space(target, summary.disk_needed_bytes)
    no_tokenizer = missing_tokenizer_warning(base.path)
    if no_tokenizer:
        warnings.warn(no_tokenizer, UpcycleWarning, stacklevel=2)


def make_gates(gating: GateParams, plan: Plan, base: Checkpoint) -> tuple[dict[int, torch.Tensor],
                                                                          dict[int, torch.Tensor],
                                                                          Optional[SelfCheck]]:
    """Router weights per layer, the shared-expert gates (empty without shared experts) and the routing self-check
    (None unless the gates come from the prompts' router inputs)."""
    with progress_stage("gates", total=len(plan.moe_layers), unit="layers") as st:
        if plan.grow is not None and plan.grow.router == BASE_ROUTERS:  # a grown MoE: the base's rows (`grow_rows`);
            routers, shared, checked = grown_gates(gating, plan, base), {}, None  # its shared gates: copied tensors
        else:  # routers and shared-expert gates, one stream of the base
            rows = compute_gate_rows(gating, plan, base)
            routers, shared, checked = rows.routers, rows.shared, rows.self_check
        st.advance(len(routers), note=f"{gating.mode}, {len(routers)} layers")
    return routers, shared, checked


def finish(stage: Path, writer: ShardedWriter, hashes: dict[str, str], config: UpcycleConfig, plan: Plan,
           sources: dict[str, Checkpoint], checking: CheckParams, verify: bool, device: str,
           target: Path, self_check: Optional[SelfCheck] = None) -> tuple[Optional[VerifyResult], Optional[InitDrift],
                                                                         list[str]]:
    """Complete the staged folder once every shard is written: index, config.json, tokenizer, (verification),
    init drift, model card and manifest; then check no source changed during the build.

    Args:
        verify: run `verify.verify` on the folder, on `device` (the recipe's).
        target: the folder the output is published as (the manifest records paths relative to it).
        self_check: the routing self-check, recorded in the card and the manifest.

    Returns:
        The verification result (or None), the init drift (or None) and the manifest's notes.
    """
    writer.write_index()
    router = resolved(config).router
    write_config(stage, moe_config(plan, router.aux_loss_coef, router.jitter_noise))
    base = sources[config.base_model]
    copy_tokenizer_files(base.path, stage)
    checked = None
    if verify:
        from moe_upcycle.check.verify import verify as verify_folder
        from moe_upcycle.gates.device import resolve_device

        checked = verify_folder(stage, config.base_model, hashes=False, check=checking, plan=plan,
                                device=resolve_device(device))  # the recipe's device (auto)
    with progress_stage("init drift"):
        drift = build_drift(checking, plan, base.path, stage, base.adapter)
    card_lines = (checked.lines() if checked else []) + (["", drift.summary()] if drift else [])
    # verify ran on the staging folder: the card and manifest call it this folder, never by its path
    card_lines = [line.replace(str(stage), ".") for line in card_lines]
    write_model_card(stage, config, plan, card_lines or None, {ref: s.path for ref, s in sources.items()},
                     self_check_lines(self_check))
    # the recipe must not depend on the (temporary) folder name: same config and seed, same bytes
    verification = {k: v for k, v in checked.to_dict().items() if k != "folder"} if checked else None
    unlocated = write_recipe(stage, config, hashes, skip=() if writer.checksums else writer.files,
                             verification=verification, target=target,
                             unset=left_out(config) if plan.grow is not None else (),
                             extra={"self_check": self_check.to_dict()} if self_check else None)
    for source in sources.values():  # last: a source re-saved during the build is never published from
        source.check_unchanged()
    return checked, drift, unlocated
