"""What a plan will cost before anything is spent: parameters, bytes, shards, memory, disk.

`summarize` turns a plan into a `PlanSummary` (numbers only, no tensors read); `print_summary`
shows it with rich (``moe-upcycle plan`` / ``build --dry-run``), `summary_dict` as JSON (``plan --json``);
`disk_space.check_free_space` stops a real build that would not fit on the output's filesystem before a
byte is written. Memory figures are estimates (`memory`: private memory and mapped input, runtime
included, with what they assume); everything else here is exact.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from moe_upcycle.terminal.markup import escape
from moe_upcycle.checkpoint import names
from moe_upcycle.recipe.schema import UpcycleConfig
from moe_upcycle.checkpoint.disk_space import free_bytes, human_bytes
from moe_upcycle.checkpoint.names import tokenizer_files
from moe_upcycle.planning.steps import Plan, Step
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.writer import TensorSpec, assign_shards
from moe_upcycle.planning.memory import MemoryEstimate, estimate_memory
from moe_upcycle.planning.runtimes import Verdict, compatibility, fused_scope
from moe_upcycle.dtypes import dtype_name
from moe_upcycle.recipe.params import mode_said
from moe_upcycle.recipe.resolved import resolved
from moe_upcycle.recipe.layer_words import moe_layers_row
from moe_upcycle.terminal.tables import fit

SMALL_FILES_BYTES = 2**20  # config.json, README.md, moe_upcycle.json: far below 1 MiB


@dataclass(frozen=True)
class Component:
    """One row of the tensor table: every output tensor matching one name template."""

    template: str
    count: int
    shape: tuple[int, ...]
    kind: str
    source: str
    params: int
    nbytes: int


@dataclass(frozen=True)
class PlanSummary:
    """The numbers ``moe-upcycle plan`` prints."""

    architecture: str
    experts: tuple[str, ...]
    experts_per_token: int
    gate_mode: str
    dtype: str
    tensor_policy: str
    num_tensors: int
    total_params: int
    active_params: int
    tied_embeddings: bool
    output_bytes: int
    num_shards: int
    max_shard_bytes: int
    memory: MemoryEstimate
    components: tuple[Component, ...]
    sharing: tuple[str, ...]
    notes: tuple[str, ...]
    output: Optional[str] = None
    disk_needed_bytes: int = 0
    disk_free_bytes: Optional[int] = None
    runtimes: tuple[Verdict, ...] = ()  # where the output runs (`runtimes.compatibility`)
    adapters: tuple[str, ...] = ()  # one line per ``model+adapter`` reference: the LoRA merged in
    tied_head_written: bool = False  # a tied lm_head.weight is written beside the embedding (`llamacpp`)
    moe_layers: tuple[int, ...] = ()  # the layers with experts (`Plan.moe_layers`); the others keep the dense MLP
    num_layers: int = 0
    moe_layers_text: str = ""  # `Plan.moe_layers_text`: "layers 1, 3 of 4" or "all 4 layers"
    gate_mode_default: str = ""  # why gate_mode is what it is when the recipe leaves it out

    @property
    def tied_note(self) -> str:
        """Where the tied head is written besides the embedding (see `plan`'s note), or ''."""
        return ", written twice (llama.cpp needs output.weight)" if self.tied_head_written else ""

    @property
    def fits_on_disk(self) -> Optional[bool]:
        return None if self.disk_free_bytes is None else self.disk_needed_bytes <= self.disk_free_bytes


def readable_count(n: int) -> str:
    """Exact count with a short form: ``591,232 (0.59M)``, ``46,702,792,704 (46.70B)``.

    Example:
        >>> readable_count(591_232), readable_count(46_702_792_704), readable_count(4_096)
        ('591,232 (0.59M)', '46,702,792,704 (46.70B)', '4,096 (4.1K)')
    """
    if n >= 10**9:
        short = f"{n / 1e9:.2f}B"
    elif n >= 10**5:
        short = f"{n / 1e6:.2f}M"
    else:
        short = f"{n / 1e3:.1f}K"
    return f"{n:,} ({short})"


def parameter_counts(plan: Plan) -> tuple[int, int]:
    """(total, active per token) parameters of the output model, exact.

    Total counts every stored tensor once (tied embeddings are one tensor, stored once). Active
    counts every non-expert tensor plus, in each layer, the `experts_per_token` largest experts.

    Example:
        >>> parameter_counts(mixtral_8x7b_plan)  # doctest: +SKIP
        (46702792704, 12879925248)
    """
    total = shared = 0
    per_expert: dict[tuple[int, int], int] = {}  # (layer, expert) -> parameters of that expert
    for step in plan.steps:
        if plan.tied_embeddings and step.name == names.LM_HEAD:
            continue  # written for llama.cpp (see llamacpp), the same parameter as the embedding
        n = math.prod(step.shape)
        total += n
        if step.kind == "expert":  # a fused tensor (`fused`) holds every expert's slots as its parts
            for slot in step.leaves():
                key = (slot.layer, slot.expert)
                per_expert[key] = per_expert.get(key, 0) + math.prod(slot.shape)
        else:
            shared += n
    active = shared
    for layer in sorted({layer for layer, _ in per_expert}):
        sizes = sorted((n for (lyr, _), n in per_expert.items() if lyr == layer), reverse=True)
        active += sum(sizes[:plan.experts_per_token])
    return total, active



def components(plan: Plan) -> list[Component]:
    """Group output tensors by name template (layer and expert indices pulled out)."""
    groups: dict[str, list] = {}
    for step in plan.steps:
        template = names.split_layer(step.name)[0]
        if step.expert is not None:
            template = template.replace(f".{step.expert}.", ".{expert}.")
        groups.setdefault(template, []).append(step)
    rows = []
    for template, steps in groups.items():
        s = steps[0]
        rows.append(Component(template, len(steps), s.shape, s.kind, source_label(s),
                              sum(math.prod(x.shape) for x in steps), sum(x.nbytes for x in steps)))
    return rows


def source_label(step: Step) -> str:
    """What a plan row is made from: a source key template, its parts (fused, averaged), zeros or gates."""
    if step.source:
        return names.split_layer(step.source[1])[0]
    if step.kind == "average":
        return f"mean of {len(step.parts)} models"
    if step.parts:
        return f"{len(step.parts)} slots"
    return "zeros" if step.kind == "zeros" else "gates"


def disk_needed(plan: Plan, base: Checkpoint) -> int:
    """Bytes the output folder will take: tensors, headers and index, tokenizer files, small files."""
    # a safetensors header entry and an index line cost about the key plus ~64 bytes each
    metadata = sum(2 * len(s.name) + 128 for s in plan.steps)
    tokenizer = sum((base.path / n).stat().st_size for n in (tokenizer_files(base.path) if base.path else [])
                    if (base.path / n).is_file())
    return plan.total_bytes + metadata + tokenizer + SMALL_FILES_BYTES


def summarize(config: UpcycleConfig, plan: Plan, sources: dict[str, Checkpoint], sharing: list[str],
              output: Optional[Path] = None) -> PlanSummary:
    """Everything ``moe-upcycle plan`` reports, computed from the plan and headers only."""
    specs = [TensorSpec(s.name, s.shape, s.dtype) for s in plan.steps]
    total, active = parameter_counts(plan)
    recipe = resolved(config)
    base = sources[config.base_model]
    needed = disk_needed(plan, base)
    free = free_bytes(output) if output is not None else None
    return PlanSummary(
        architecture=plan.architecture, experts=plan.expert_names, experts_per_token=plan.experts_per_token,
        gate_mode=config.gate_mode, dtype=dtype_name(plan.dtype),
        tensor_policy=config.tensor_policy, num_tensors=len(plan.steps), total_params=total,
        active_params=active, tied_embeddings=plan.tied_embeddings, output_bytes=plan.total_bytes,
        tied_head_written=plan.tied_head_written,
        num_shards=len(assign_shards(specs, config.max_shard_size)), max_shard_bytes=config.max_shard_size,
        memory=estimate_memory(plan, recipe.gates, recipe.writing, recipe.checking, sources,
                               config.base_model), components=tuple(components(plan)),
        sharing=tuple(sharing), notes=plan.notes, output=str(output) if output is not None else None,
        disk_needed_bytes=needed, disk_free_bytes=free, runtimes=tuple(compatibility(plan)),
        adapters=tuple(adapter_lines(sources)), moe_layers=plan.moe_layers, num_layers=plan.num_layers,
        moe_layers_text=plan.moe_layers_text(), gate_mode_default=config.gate_mode_default,
    )


def adapter_lines(sources: dict[str, Checkpoint]) -> list[str]:
    """What each ``model+adapter`` source merges: the adapter's file and the tensors it changes."""
    lines = []
    for ref, source in sources.items():
        adapter = source.adapter
        if adapter is None:
            continue
        ranks = sorted({round(p.scaling, 6) for p in adapter.pairs.values()})
        lines.append(f"{ref}: LoRA {adapter.file} merged into {len(set(adapter.pairs) | set(adapter.replaced))} tensors of {source.model_ref} "
                     f"(scaling {', '.join(f'{r:g}' for r in ranks)})")
    return lines


def summary_dict(summary: PlanSummary) -> dict:
    """The summary as plain JSON types (``moe-upcycle plan --json``); memory figures under ``"memory"``.

    Example:
        >>> summary_dict(summary)["memory"]["build_private_bytes"]  # doctest: +SKIP
        165722112
    """
    data = asdict(summary)
    data["fits_on_disk"] = summary.fits_on_disk
    data["runtimes"] = [asdict(v) for v in summary.runtimes]
    return data


def print_summary(summary: PlanSummary, console: Console) -> None:
    """Show a plan summary: overview, per-component table, sharing report, disk check."""
    s = summary
    table = Table(title="moe-upcycle plan", show_header=False)
    table.add_row("architecture", s.architecture)
    table.add_row("experts", escape(f"{len(s.experts)} ({', '.join(s.experts)}), top-{s.experts_per_token}"))
    if s.moe_layers_text:
        table.add_row("MoE layers", moe_layers_row(s.moe_layers, s.num_layers))
    table.add_row("gate mode", mode_said(s.gate_mode, s.gate_mode_default))
    table.add_row("dtype", s.dtype)
    table.add_row("parameters", f"{readable_count(s.total_params)} total, {readable_count(s.active_params)} "
                                f"active per token"
                  + (f"; tied embeddings counted once{s.tied_note}" if s.tied_embeddings else ""))
    table.add_row("tensors", str(s.num_tensors))
    table.add_row("output size", f"{human_bytes(s.output_bytes)} ({s.output_bytes:,} bytes) in {s.num_shards} "
                                 f"shard(s) of at most {human_bytes(s.max_shard_bytes)}")
    m = s.memory
    table.add_row("peak memory", f"~{human_bytes(m.build_private_bytes)} private to build ({m.build_phase} phase), "
                                 f"~{human_bytes(m.gate_private_bytes)} for gates ({s.gate_mode})"
                                 + (f", {human_bytes(m.gpu_bytes)} on the GPU" if m.gpu_bytes else "")
                                 + f"; RSS up to ~{human_bytes(m.build_rss_bytes)} with the input's "
                                 f"{human_bytes(m.mapped_input_bytes)} mapped from page cache (reclaimable)")
    table.add_row("memory assumes", "; ".join(m.assumptions))
    table.add_row("tensor policy", s.tensor_policy)
    for line in s.adapters:
        table.add_row("LoRA adapter", escape(line))
    console.print(table)
    comp = Table(title="output tensors")
    for col in ("name template", "count", "shape", "kind", "source", "params", "bytes"):
        comp.add_column(col)
    for c in s.components:
        comp.add_row(escape(c.template), str(c.count), "x".join(map(str, c.shape)), c.kind, escape(c.source), f"{c.params:,}",
                     human_bytes(c.nbytes))
    console.print(fit(comp, console, optional=("source", "params")))
    for line in s.sharing + s.notes:
        console.print(escape(line), highlight=False)
    if s.runtimes:
        rt = Table(title="runtimes" + (f" (fused layout: {fused_scope(s.architecture)})" if any(
            fused_scope(s.architecture) in v.why for v in s.runtimes) else ""))
        for col in ("runtime", "verdict", "why", "basis"):
            rt.add_column(col, overflow="fold")
        for v in s.runtimes:
            rt.add_row(v.runtime, v.status, escape(v.why), v.basis)  # "[gMASK]" is text, not markup
        console.print(rt)
    if s.disk_free_bytes is None:
        console.print("Disk: no output folder given, free space not checked.", highlight=False)
    else:
        verdict = "[green]fits[/]" if s.fits_on_disk else "[bold red]does NOT fit[/]"
        console.print(f"Disk: needs {human_bytes(s.disk_needed_bytes)}, {human_bytes(s.disk_free_bytes)} free on the "
                      f"filesystem of {escape(str(s.output))} — {verdict}", highlight=False)
