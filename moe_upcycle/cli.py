"""The ``moe-upcycle`` command line (Typer + rich).

Each command is a thin shell over a library function; each option is one of its keyword
arguments. Only `UpcycleError` is caught: it is printed and the exit code is 1. Any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .errors import UpcycleError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Turn dense decoder LLM checkpoints into Mixture-of-Experts checkpoints.")
console = Console(stderr=True)
out = Console()
DEBUG = {"on": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for errors.")) -> None:
    DEBUG["on"] = debug


def cli_errors(fn: Callable) -> Callable:
    """Print UpcycleError (every problem) and exit 1; Ctrl-C exits 130 after cleanup."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UpcycleError as exc:
            if DEBUG["on"]:
                raise
            kind = type(exc).__name__.replace("Error", " error").lower()
            for problem in exc.problems:
                console.print(f"[bold red]{kind}:[/] {escape(problem)}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        except KeyboardInterrupt:
            console.print("[bold red]interrupted:[/] nothing was written under the output name")
            raise typer.Exit(130)

    return wrapper


def print_plan(result) -> None:
    """Show a plan: summary, per-component table, sharing report."""
    from .plan import Plan
    from .report import human_bytes
    from .writer import TensorSpec, assign_shards

    plan: Plan = result.plan
    config = result.config
    specs = [TensorSpec(s.name, s.shape, s.dtype) for s in plan.steps]
    shards = assign_shards(specs, config.max_shard_size)
    summary = Table(title="moe-upcycle plan", show_header=False)
    summary.add_row("architecture", plan.architecture)
    summary.add_row("experts", f"{len(plan.expert_names)} ({', '.join(plan.expert_names)}), top-{plan.experts_per_token}")
    summary.add_row("gate mode", config.gate_mode)
    summary.add_row("dtype", str(plan.dtype).removeprefix("torch."))
    summary.add_row("tensors", str(len(plan.steps)))
    summary.add_row("output size", f"{human_bytes(plan.total_bytes)} in {len(shards)} shard(s)")
    summary.add_row("tensor policy", config.tensor_policy)
    out.print(summary)
    groups: dict[str, list] = {}
    from .names import split_layer

    for step in plan.steps:
        template = split_layer(step.name)[0]
        if step.expert is not None:
            template = template.replace(f".{step.expert}.", ".{expert}.")
        groups.setdefault(template, []).append(step)
    table = Table(title="output tensors")
    for col in ("name template", "count", "shape", "kind", "source", "bytes"):
        table.add_column(col)
    for template, steps in groups.items():
        s = steps[0]
        table.add_row(template, str(len(steps)), "x".join(map(str, s.shape)), s.kind,
                      s.source[1] if s.source else "gates", human_bytes(sum(x.nbytes for x in steps)))
    out.print(table)
    for line in result.sharing + list(plan.notes):
        out.print(line, highlight=False)


@app.command()
@cli_errors
def build(
    config: Path = typer.Argument(..., help="The YAML recipe (mergekit-moe configs are accepted unchanged)."),
    out_dir: Optional[Path] = typer.Argument(None, metavar="OUT", help="Output folder (else -o, else output: in the YAML)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Output folder."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty output folder (atomically)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and write nothing."),
    clone_tensors: Optional[bool] = typer.Option(None, "--clone-tensors/--share-tensors",
                                                 help="Give every expert slot its own copy, or share one storage per source tensor."),
    max_shard_size: Optional[str] = typer.Option(None, help="Bytes per output shard, e.g. 5GB."),
    device: Optional[str] = typer.Option(None, help="Where hidden-state gates run the base model: auto, cpu, cuda, cuda:N."),
    batch_size: Optional[int] = typer.Option(None, help="Prompts per forward pass for hidden-state gates."),
) -> None:
    """Build an MoE checkpoint from CONFIG."""
    from .build import upcycle

    policy = None if clone_tensors is None else ("clone" if clone_tensors else "share")
    target = out_dir or output
    if dry_run:
        print_plan(upcycle(config, target, dry_run=True, tensor_policy=policy, max_shard_size=max_shard_size))
        return
    with _progress() as progress:
        task = progress.add_task("writing", total=None)

        def on_step(step, plan) -> None:
            progress.update(task, total=plan.total_bytes, advance=step.nbytes, description=f"writing {step.name}")

        result = upcycle(config, target, force=force, tensor_policy=policy, max_shard_size=max_shard_size,
                         device=device, batch_size=batch_size, on_step=on_step)
    for line in result.sharing:
        console.print(line, highlight=False)
    for line in result.gate_warnings:
        console.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
    out.print(f"[green]Built[/] {result.output}: {len(result.shards)} shard(s), "
              f"{result.plan.total_bytes / 1e6:.1f} MB in {result.seconds:.1f}s", highlight=False)


@app.command()
@cli_errors
def plan(config: Path = typer.Argument(..., help="The YAML recipe.")) -> None:
    """Print the build plan of CONFIG and write nothing (same as build --dry-run)."""
    from .build import upcycle

    print_plan(upcycle(config, dry_run=True))


@app.command()
@cli_errors
def demo(folder: Path = typer.Argument(Path("demo_out"), help="Scratch folder for the demo models.")) -> None:
    """Generate a tiny dense Llama, upcycle it to 4 experts and show the MoE reproduces its logits."""
    from .demo import run_demo

    result = run_demo(folder, console=out)
    if not result["ok"]:
        raise typer.Exit(1)


@app.command()
@cli_errors
def route(
    model: Path = typer.Argument(..., metavar="OUT", help="A built MoE folder."),
    prompts: Path = typer.Option(..., "--prompts", help="Prompts: YAML/JSON list (or prompts: key) or text, one per line."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Save a prompts x experts heatmap (needs matplotlib)."),
    as_json: bool = typer.Option(False, "--json", help="Print the routing as JSON instead of tables."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    batch_size: int = typer.Option(8, min=1, help="Prompts per forward pass."),
) -> None:
    """Show how the MoE in OUT routes each prompt: top-1 expert shares and per-layer expert load."""
    import json as _json

    from .route import plot_routing, read_prompts
    from .route import route as route_prompts

    result = route_prompts(model, read_prompts(prompts), device=device, batch_size=batch_size)
    if plot is not None:
        plot_routing(result, plot)
    if as_json:
        print(_json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
        return
    data = result.to_dict()
    names = data["experts"]
    per_prompt = Table(title="per prompt: top-1 share across layers and tokens")
    for col in ("prompt", "tokens", "top expert", *names):
        per_prompt.add_column(col)
    for p in data["prompts"]:
        text = p["prompt"].replace("\n", " ")
        per_prompt.add_row(text if len(text) <= 50 else text[:47] + "...", str(p["tokens"]), p["top_expert"],
                           *[f"{p['top1_share'][n]:.2f}" for n in names])
    out.print(per_prompt)
    load = Table(title=f"per layer: top-{data['experts_per_token']} expert load "
                       f"(entropy in bits, balanced = {data['max_entropy_bits']:.2f})")
    for col in ("layer", *names, "entropy"):
        load.add_column(col)
    for row in data["layers"]:
        load.add_row(str(row["layer"]), *[f"{row['load'][n]:.2f}" for n in names], f"{row['entropy_bits']:.2f}")
    out.print(load)
    if plot is not None:
        out.print(f"saved {plot}", highlight=False)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, transient=True, disable=not sys.stderr.isatty())


def main() -> None:  # pragma: no cover - console entry point alias
    app()
