"""The build pipeline, top to bottom: load config → open sources → plan → gates → write.

`upcycle()` is the library form of ``moe-upcycle build``; each CLI option is one of its keyword
arguments. The output folder is staged beside the target and renamed into place only when every
file is complete (see `output_dir`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union


from . import __version__
from .card import write_model_card
from .config import UpcycleConfig, load_config
from .drift import InitDrift, build_drift
from .errors import ConfigError, SourceError
from .execute import iter_tensors
from .gate_checks import parallel_experts
from .gates import compute_gates
from .guards import check_free_space, check_source_dtypes
from .model_files import copy_tokenizer_files, moe_config, write_config
from .output_dir import check_target, make_parent, staged_output
from .plan import Plan, Step, make_plan
from .plan_report import PlanSummary, summarize
from .report import sharing_report
from .shared_experts import shared_gate_rows
from .source import Checkpoint, open_checkpoint
from .writer import ShardedWriter, TensorSpec

RECIPE_NAME = "moe_upcycle.json"


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
    verify: Optional[object] = None  # a verify.VerifyResult with `verify=True`
    drift: Optional[InitDrift] = None  # how far the init moved the model from the dense base
    gate_warnings: list[str] = field(default_factory=list)


def open_sources(config: UpcycleConfig,
                 opener: Callable[[str, str], Checkpoint] = open_checkpoint) -> dict[str, Checkpoint]:
    """Open every model the config names (each once), reporting all missing ones together.

    Args:
        config: the recipe.
        opener: (reference, YAML field) -> Checkpoint; `meta_model.meta_source` plans from config.json alone.

    Raises:
        SourceError: every model that could not be opened.
    """
    refs = {config.base_model: "base_model"}
    for i, expert in enumerate(config.experts):
        refs.setdefault(expert.source_model, f"experts[{i}].source_model")
    for i, expert in enumerate(config.shared_experts):
        refs.setdefault(expert.source_model, f"shared_experts[{i}].source_model")
    sources, problems = {}, []
    for ref, field_name in refs.items():
        try:
            sources[ref] = opener(ref, field_name)
        except SourceError as exc:
            problems += exc.problems
    if problems:
        raise SourceError(*problems)
    return sources


def resolve_output(config: UpcycleConfig, output: Union[str, Path, None]) -> Path:
    """The output folder: the argument, else the config's `output:`."""
    chosen = output if output is not None else config.output
    if not chosen:
        raise ConfigError("output: no output folder given; pass OUT (or -o/--output) or set output: in the YAML")
    return Path(chosen).expanduser().resolve()


def prepare(config: Union[UpcycleConfig, str, Path, dict], from_config: bool = False,
            **overrides) -> tuple[UpcycleConfig, dict, Plan]:
    """Validate the config, open the sources and plan; nothing is written.

    With `from_config`, sources are described from their config.json alone (`meta_model`).
    """
    if not isinstance(config, UpcycleConfig):
        config = load_config(config, overrides=overrides)
    elif any(v is not None for v in overrides.values()):
        config = load_config(config.model_dump(), overrides=overrides)
    if from_config:
        from .meta_model import meta_sources

        sources = meta_sources(config)
    else:
        sources = open_sources(config)
    plan = make_plan(config, sources)
    check_source_dtypes(plan, sources)
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
            than writing, so turning it off roughly halves build time on CPUs without SHA instructions).
        on_step: called with (step, plan) after each output tensor is written (progress).
        verify: run `verify.verify` on the finished files before they are moved into place and
            put its results in the model card and ``moe_upcycle.json``. A failed verification
            does not stop the build: check ``result.verify.ok`` (the CLI exits 1).
        from_config: plan from the sources' config.json alone, no weights needed (`dry_run` only).

    Returns:
        The plan, its summary, the sharing report and, unless `dry_run`, the written files with
        their sha256 (and the verification result with `verify`).

    Raises:
        UpcycleError: any problem with the config, the sources or the output folder.

    Example:
        >>> upcycle({"base_model": "tiny-llama", "num_experts": 4, "gate_mode": "random"}, "tiny-moe")  # doctest: +SKIP
    """
    start = time.perf_counter()
    if from_config and not dry_run:
        raise ConfigError("from_config plans from config.json alone and can only be used with a dry run (plan)")
    config, sources, plan = prepare(config, from_config, tensor_policy=tensor_policy, max_shard_size=max_shard_size,
                                    device=device, batch_size=batch_size, checksums=checksums)
    sharing = sharing_report(plan, sources, config.tensor_policy)
    target = resolve_output(config, output) if (not dry_run or output is not None or config.output) else None
    summary = summarize(config, plan, sources, sharing, target)
    if dry_run:
        return BuildResult(config, plan, None, sharing, summary=summary)
    make_parent(target)
    check_target(target, force, [s.path for s in sources.values() if s.path])
    check_free_space(target, summary.disk_needed_bytes)
    base = sources[config.base_model]
    gates = compute_gates(config, plan, base)
    shared_gates = shared_gate_rows(config, plan, base)
    gate_warnings = parallel_experts(gates, plan.expert_names)
    specs = [TensorSpec(s.name, s.shape, s.dtype) for s in plan.steps]
    with staged_output(target, force) as stage:
        writer = ShardedWriter(stage, specs, config.max_shard_size, config.checksums)
        try:
            for step, tensor in iter_tensors(plan, sources, gates, config.tensor_policy, config.seed, shared_gates):
                writer.write(step.name, tensor)
                on_step(step, plan)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        write_config(stage, moe_config(plan, config.router_aux_loss_coef, config.router_jitter_noise,
                                       config.output_router_logits))
        copy_tokenizer_files(base.path, stage)
        hashes = dict(writer.sha256)
        checked = None
        if verify:
            from .verify import verify as verify_folder

            checked = verify_folder(stage, config.base_model, hashes=False, config=config, plan=plan)
        drift = build_drift(config, plan, base.path, stage)
        card_lines = (checked.lines() if checked else []) + ([drift.summary()] if drift else [])
        write_model_card(stage, config, plan, card_lines or None, [s.path for s in sources.values() if s.path])
        # the recipe must not depend on the (temporary) folder name: same config and seed, same bytes
        verification = {k: v for k, v in checked.to_dict().items() if k != "folder"} if checked else None
        write_recipe(stage, config, hashes, skip=() if config.checksums else writer.files, verification=verification)
    if checked:
        checked.folder = str(target)
    for ckpt in sources.values():
        ckpt.close()
    return BuildResult(config, plan, target, sharing, writer.files, hashes, time.perf_counter() - start,
                       summary, checked, drift, gate_warnings)


def write_recipe(folder: Path, config: UpcycleConfig, shard_hashes: dict[str, str],
                 skip: Sequence[str] = (), verification: Optional[dict] = None) -> None:
    """Record tool version, resolved config, seed, verification and the sha256 of every output file.

    Args:
        shard_hashes: digests computed while writing (not computed again here).
        skip: files left unhashed (the shards with ``checksums: false``).
    """
    hashes = dict(shard_hashes)
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name not in hashes and path.name not in skip:
            hashes[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    recipe = {
        "tool": "moe-upcycle",
        "version": __version__,
        "config": config.model_dump(mode="json"),
        "seed": config.seed,
        "sha256": dict(sorted(hashes.items())),
    }
    if verification is not None:
        recipe["verify"] = verification
    (folder / RECIPE_NAME).write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")
