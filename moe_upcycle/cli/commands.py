"""The main ``moe-upcycle`` commands: build, plan, verify, demo, route.

Each command is a thin shell over a library function; each option is one of its keyword
arguments.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from moe_upcycle.terminal.markup import escape
from moe_upcycle.cli import help as cli_help  # noqa: F401  (boolean flags are shown as flags in --help)
from moe_upcycle.cli.next_steps import after_build, after_demo
from moe_upcycle.cli.app import (DEBUG, DEVICE_HELP, QUIET, VERBOSE, app, cli_errors, command_line, console,  # noqa: F401
                                 note, out)
from moe_upcycle.distributed.world import current_world
from moe_upcycle.errors import ConfigError, UpcycleError, UpcycleWarning
from moe_upcycle.terminal.json_text import json_text
from moe_upcycle.terminal.progress import stage
from moe_upcycle.terminal.tables import fit


def print_plan(result) -> None:
    """Show a plan: summary, per-component table, sharing report, disk check (see `plan_report`)."""
    from moe_upcycle.planning.plan_report import print_summary

    print_summary(result.summary, out)


@app.command()
@cli_errors
def build(
    config: Path = typer.Argument(..., readable=False, metavar="CONFIG",
                                  help="The YAML recipe (mergekit-moe configs are accepted unchanged)."),
    out_dir: Optional[Path] = typer.Argument(None, readable=False, metavar="OUT", help="Output folder (else -o, else output: in the YAML)."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", readable=False, help="Output folder."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty output folder (atomically)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and write nothing."),
    clone_tensors: Optional[bool] = typer.Option(None, "--clone-tensors/--share-tensors",
                                                 help="Give every expert slot its own copy, or share one storage per source tensor."),
    max_shard_size: Optional[str] = typer.Option(None, help="Bytes per output shard, e.g. 5GB."),
    verify: bool = typer.Option(False, "--verify", help="Verify the output right after building; results go in "
                                                         "the model card. Exit 1 if verification fails."),
    no_lint: bool = typer.Option(False, "--no-lint", help="Skip the semantic check of the experts' prompts."),
    checksums: Optional[bool] = typer.Option(None, "--checksums/--no-checksums",
                                             show_default="on",
                                             help="Record the sha256 of every shard (costs more CPU than writing)."),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP + " Used by hidden-state gates.",
                                         show_default="the recipe's device:, auto"),
    batch_size: Optional[int] = typer.Option(None, help="Prompts per forward pass for hidden-state gates."),
    mergekit: bool = typer.Option(False, "--mergekit", help="Compute routers exactly as mergekit-moe 0.1.5 does "
                                                            "(same as gate_source: mergekit)."),
    allow_unknown_keys: bool = typer.Option(False, "--allow-unknown-keys", help="Ignore unknown config keys with a "
                                            "warning, as mergekit-moe does (misspelt keys stay errors)."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Build with N processes on this machine, "
                                          "each writing its share of the shards (as torchrun --nproc-per-node N "
                                          "runs it; for several nodes, run torchrun on each)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result (output, shards, bytes, gates, routing "
                                                       "self-check) as one JSON object on stdout."),
) -> None:
    """Build an MoE checkpoint from CONFIG."""
    from moe_upcycle.build import upcycle

    if out_dir is not None and output is not None and out_dir != output:
        raise ConfigError(f"OUT is {out_dir} and -o/--output is {output}; give the output folder once")
    if dry_run and verify:
        raise ConfigError("--dry-run writes nothing, so there is nothing for --verify to check; drop one of them")
    world = current_world()  # the ranks of a torchrun job (or of --workers), or this process alone
    if workers is not None and workers != world.size and not dry_run:
        if world.size > 1:
            raise ConfigError(f"--workers {workers}: this build runs as {world.size} processes of a torchrun job "
                              f"already; drop --workers (torchrun's --nproc-per-node sets how many)")
        from moe_upcycle.distributed.local_launch import run_workers

        raise typer.Exit(run_workers(workers, command_line()))
    if device is not None:  # named as the option, as verify and route do; a GPU asked for must exist to build
        from moe_upcycle.gates.device import resolve_device
        from moe_upcycle.recipe.values import device_problem

        if not dry_run:
            resolve_device(device, "--device")
        elif device_problem(device):  # a plan: the name only
            raise ConfigError(f"--device {device_problem(device)}")
    policy = None if clone_tensors is None else ("clone" if clone_tensors else "share")
    target = out_dir or output
    gate_source = "mergekit" if mergekit else None
    if not no_lint and world.lead:  # advice, printed once: the other ranks of a distributed build skip it
        options = {} if dry_run else dict(tensor_policy=policy, max_shard_size=max_shard_size, device=device,
                                          batch_size=batch_size, checksums=checksums, gate_source=gate_source)
        _warn_prompt_lint(config, allow_unknown_keys, options, device_needed=not dry_run and verify,
                          output=target, force=force)
    if dry_run:
        planned = upcycle(config, target, dry_run=True, tensor_policy=policy, max_shard_size=max_shard_size,
                          allow_unknown_keys=allow_unknown_keys, gate_source=gate_source)
        if as_json:
            from moe_upcycle.planning.plan_report import summary_dict

            out.out(json_text(summary_dict(planned.summary)), highlight=False)
        else:
            print_plan(planned)
        return
    if verify:
        note("verify: the output will be loaded with transformers and compared with the base after writing")
    result = upcycle(config, target, force=force, tensor_policy=policy, max_shard_size=max_shard_size,
                     device=device, batch_size=batch_size, checksums=checksums, verify=verify,
                     allow_unknown_keys=allow_unknown_keys, gate_source=gate_source)
    for line in result.notes:
        note(f"[bold cyan]note:[/] {escape(line)}")
    for line in (result.sharing if VERBOSE["on"] else [result.sharing_line] if result.sharing_line else []):
        note(escape(line))
    for line in result.gate_warnings:
        console.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if as_json:  # one object on stdout; notes stay on stderr
        from moe_upcycle.cli.build_json import build_dict

        if world.lead:
            out.out(json_text(build_dict(result)), highlight=False)
        if result.verify is not None and not result.verify.ok:
            raise typer.Exit(1)
        return
    out.print(f"[green]Built[/] {escape(str(result.output))}: {len(result.shards)} shard(s), "
              f"{result.plan.total_bytes / 1e6:.1f} MB in {result.seconds:.1f}s", highlight=False)
    if result.self_check is not None:
        how = "" if result.self_check.per_token else " (on each prompt's mean router input)"
        out.print(f"routing self-check{how}, as route --labeled counts:", highlight=False)
        for line in result.self_check.lines():
            out.print(f"  {escape(line)}", highlight=False)
    if result.drift is not None:
        out.print(result.drift.summary(), highlight=False)
    if result.verify is not None:
        from moe_upcycle.check.verify_report import print_verify

        print_verify(result.verify, out, console, notes=not QUIET["on"])
        if not result.verify.ok:
            raise typer.Exit(1)
    for line in after_build(result.output, verified=result.verify is not None):
        note(escape(line))


@app.command()
@cli_errors
def plan(
    config: Path = typer.Argument(..., readable=False, metavar="CONFIG",
                                  help="The YAML recipe."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", readable=False, help="Output folder, for the free-disk check "
                                                                       "(else output: in the YAML)."),
    from_config: bool = typer.Option(False, "--from-config", help="Describe the models from their config.json "
                                                                  "alone: plan before downloading any weights."),
    allow_unknown_keys: bool = typer.Option(False, "--allow-unknown-keys", help="Ignore unknown config keys with a "
                                            "warning, as mergekit-moe does (misspelt keys stay errors)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan's figures as JSON on stdout."),
) -> None:
    """Print the build plan of CONFIG and write nothing (same as build --dry-run)."""
    from moe_upcycle.build import upcycle

    result = upcycle(config, output, dry_run=True, from_config=from_config, allow_unknown_keys=allow_unknown_keys)
    if as_json:

        from moe_upcycle.planning.plan_report import summary_dict

        out.out(json_text(summary_dict(result.summary)), highlight=False)
        return
    print_plan(result)


@app.command("verify")
@cli_errors
def verify_cmd(
    folder: Path = typer.Argument(..., readable=False, metavar="OUT", help="The built MoE folder."),
    base: Optional[str] = typer.Option(None, "--base", help="Dense model to compare with.",
                                       show_default="the recipe's base_model"),
    text: Optional[Path] = typer.Option(None, "--text", readable=False, help="Text file for perplexity.",
                                        show_default="a short text shipped with moe-upcycle"),
    prompts: Optional[Path] = typer.Option(None, "--prompts", readable=False, help="Prompts file, one per line, or records as "
                                                                    "route --prompts reads them.",
                                           show_default="shipped prompts plus each expert's first prompt"),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", min=0, help="Fail when mean KL(dense||moe) is above this."),
    min_agreement: Optional[float] = typer.Option(None, "--min-agreement", min=0, max=1,
                                                  help="Fail when top-1 agreement (0..1) is below this."),
    hashes: bool = typer.Option(True, "--hashes/--skip-hashes", help="Check every file's sha256 against "
                                                                      "moe_upcycle.json."),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", min=1, help="Length of the greedy continuations "
                                       "(each new token is a forward pass of each model)."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
) -> None:
    """Check that OUT loads with transformers and how far it is from the dense base. Exit 1 on failure."""

    from moe_upcycle.check.verify import verify
    from moe_upcycle.check.verify_report import print_verify
    from moe_upcycle.gates.device import resolve_device

    result = verify(folder, base, text=text, prompts=prompts, max_kl=max_kl, min_agreement=min_agreement,
                    hashes=hashes, max_new_tokens=max_new_tokens, device=resolve_device(device, "--device"))
    if as_json:
        out.out(json_text(result.to_dict()), highlight=False)
    else:
        print_verify(result, out, console, notes=not QUIET["on"])
    if not result.ok:
        raise typer.Exit(1)


@app.command()
@cli_errors
def demo(folder: Path = typer.Argument(Path("demo_out"), readable=False, metavar="FOLDER",
                                       help="Scratch folder for the demo models.")) -> None:
    """Generate a tiny dense Llama, upcycle it to 4 experts and show the MoE reproduces its logits."""
    from moe_upcycle.cli.demo import run_demo

    result = run_demo(folder, console=out, verbose=VERBOSE["on"])
    if not result["ok"]:
        raise typer.Exit(1)
    for line in after_demo(Path(result["output"])):
        note(escape(line))


def _warn_prompt_lint(config: Path, allow_unknown_keys: bool = False, options: Optional[dict] = None,
                      device_needed: bool = False, output: Optional[Path] = None, force: bool = False) -> None:
    """Print `lint.quick_lint` warnings, one line each, for gate modes that route on the prompts.

    A config that does not load, that the build refuses for want of prompts, or whose models or plan
    (from their config.json files) the build refuses, is left to the build: it reports that before any lint runs.

    A missing GPU (`build.check_device`) is reported before the lint, not after it, and so is an output
    folder the build refuses (`build.early_output_problem`: a real build only, `options` given).
    """
    from moe_upcycle.build import check_device, early_output_problem, prepare
    from moe_upcycle.recipe.params import PROMPT_MODES
    from moe_upcycle.recipe.resolve import expert_prompts
    from moe_upcycle.recipe.schema import load_config

    try:
        with warnings.catch_warnings():  # the build prints the config's warnings, once
            warnings.simplefilter("ignore", UpcycleWarning)
            cfg = load_config(config, overrides=options, allow_unknown_keys=allow_unknown_keys)
    except UpcycleError:
        return  # the build reports it, with every problem
    if options:  # a real build (not --dry-run)
        check_device(cfg, device_needed)
    if cfg.gate_mode not in PROMPT_MODES:
        return  # random, uniform and kmeans routers do not read the prompts: nothing to warn about
    if not all(e.positive_prompts for e in cfg.expert_list()) or cfg.same_prompts_problem():
        return  # *_prompts_from sets included; the build refuses these at once, naming each expert
    try:  # a missing model or a plan problem is reported at once, not after seconds of lint advice;
        # planned from config.json files alone: the build reads the weights' headers (a .bin: its tensors) once
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UpcycleWarning)
            prepare(cfg, from_config=True)
    except UpcycleError:
        return  # the build reports it, with every problem
    if options and early_output_problem(config, cfg, output, force):
        return  # the build refuses the output folder, at once
    from moe_upcycle.prompts.lint import quick_lint  # (the embedder's code) only for gates that read prompts

    with stage("prompt lint", note="--no-lint skips it"):
        lines = quick_lint(expert_prompts(cfg.expert_list()))
    for line in lines:
        console.print(f"[yellow]lint:[/] {escape(line)}", highlight=False, soft_wrap=True)


@app.command()
@cli_errors
def route(
    model: Path = typer.Argument(..., readable=False, metavar="OUT", help="A built MoE folder."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", readable=False, help="Prompts: text, one per line; a YAML/JSON list (or prompts: key); or JSONL/CSV/TSV records with a \"text\" or \"prompt\" field."),
    labeled: Optional[Path] = typer.Option(None, "--labeled", readable=False, help="Prompts with the expert each should go to "
                                           "(JSONL with text/expert, or expert<TAB>prompt lines): routing accuracy."),
    label_by: Optional[str] = typer.Option(None, "--label-by", help="Label prompts that have none: 'embedding' "
                                           "(nearest expert centroid of the recorded prompts)."),
    plot: Optional[Path] = typer.Option(None, "--plot", readable=False, help="Save a prompts x experts heatmap (needs matplotlib)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --plot file."),
    as_json: bool = typer.Option(False, "--json", help="Print the routing as JSON instead of tables."),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    batch_size: int = typer.Option(8, min=1, help="Prompts per forward pass."),
) -> None:
    """Show how the MoE in OUT routes each prompt: top-1 expert shares and per-layer expert load."""

    from moe_upcycle.check.route import check_plot_path, plot_routing, read_prompts
    from moe_upcycle.check.route import route as route_prompts
    from moe_upcycle.gates.device import resolve_device

    if (prompts is None) == (labeled is None):
        raise ConfigError("route: give exactly one of --prompts FILE or --labeled FILE")
    if plot is not None:  # before the routing work, not after it
        check_plot_path(plot, [p for p in (prompts, labeled) if p is not None], force=force)
    if label_by not in (None, "embedding"):
        raise ConfigError(f"--label-by: {label_by!r} is not supported; use --label-by embedding")
    resolve_device(device, "--device")  # a wrong or missing device, before any file is read
    if labeled is not None:
        from moe_upcycle.check.route_eval import read_labeled

        texts, labels = read_labeled(labeled)
        labels = _labels(texts, labels, model, label_by)  # before the routing work: missing labels fail first
        from moe_upcycle.check.moe_folder import require_moe
        from moe_upcycle.check.route import expert_names
        from moe_upcycle.check.route_eval import label_indices

        # a label that names no expert, before the model loads (minutes for a large one); scored by index after it
        labels = label_indices(labels, expert_names(model, require_moe(model, command="route")), texts,
                               f"--labeled {labeled}")
    else:
        texts, labels = read_prompts(prompts), None
    result = route_prompts(model, texts, device=device, batch_size=batch_size)
    if plot is not None:
        plot_routing(result, plot, force=force)
    score = None
    if labels is not None:
        from moe_upcycle.check.route_eval import routing_accuracy

        score = routing_accuracy(result.shares(), labels, result.expert_names, result.layers)
    if as_json:
        data = result.to_dict()
        if score is not None:
            data["accuracy"] = score.to_dict()
        print(json_text(data))
        return
    data = result.to_dict()
    names = data["experts"]
    per_prompt = Table(title="per prompt: top-1 share across layers and tokens")
    for col in ("prompt", "tokens", "top expert", *names):
        per_prompt.add_column(escape(col))
    for p in data["prompts"]:
        text = p["prompt"].replace("\n", " ")
        per_prompt.add_row(escape(text if len(text) <= 50 else text[:47] + "..."), str(p["tokens"]), escape(p["top_expert"]),
                           *[f"{p['top1_share'][n]:.2f}" for n in names])
    out.print(fit(per_prompt, out, optional=("tokens",)))
    load = Table(title=f"per layer: top-{data['experts_per_token']} expert load "
                       f"(entropy in bits, balanced = {data['max_entropy_bits']:.2f})")
    for col in ("layer", *names, "entropy"):
        load.add_column(escape(col))
    for row in data["layers"]:
        load.add_row(str(row["layer"]), *[f"{row['load'][n]:.2f}" for n in names], f"{row['entropy_bits']:.2f}")
    out.print(fit(load, out))
    if score is not None:
        from moe_upcycle.cli.tables import routing_tables

        for table in routing_tables(score):
            out.print(fit(table, out))
    if plot is not None:
        out.print(f"saved {escape(str(plot))}", highlight=False)


def _labels(texts: list[str], labels: list, model_dir: Path, label_by: Optional[str]) -> list[str]:
    """Labels for `route --labeled`, missing ones filled by embedding from the build's recorded config."""
    from moe_upcycle.check.route_eval import labels_for
    from moe_upcycle.checkpoint.manifest_file import load_manifest
    from moe_upcycle.planning.replan import recorded_config

    needed = label_by and None in labels  # the recorded recipe only when a prompt has no label
    recipe = load_manifest(Path(model_dir)) if needed else None
    config = recorded_config(recipe, Path(model_dir)) if recipe else None
    experts = None
    if config is not None:
        from moe_upcycle.recipe.resolve import expert_prompts
        from moe_upcycle.recipe.schema import load_config

        try:
            experts = expert_prompts(load_config(config).expert_list())
        except ConfigError as exc:
            raise ConfigError(*[f"--label-by embedding: the recipe {model_dir}/moe_upcycle.json records no longer "
                                f"loads ({problem.removeprefix('config: ')}); restore what it names, or give every "
                                f"prompt in --labeled its expert" for problem in exc.problems]) from None
    return labels_for(texts, labels, experts, label_by or "")


