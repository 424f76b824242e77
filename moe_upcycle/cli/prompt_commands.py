"""Commands about prompt sets: ``lint`` and ``prompts grow``, and the tables they print.

Registered on the main Typer app when `moe_upcycle.cli` is imported. Each command is a
thin shell over `lint`, `grow` and `embed`; rich tables go to stdout, warnings to stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from moe_upcycle.terminal.markup import escape
from moe_upcycle.cli.app import app, cli_errors, console, out
from moe_upcycle.cli.tables import lint_tables
from moe_upcycle.terminal.json_text import json_text
from moe_upcycle.terminal.progress import stage
from moe_upcycle.terminal.tables import fit

prompts_app = typer.Typer(no_args_is_help=True, help="Work on expert prompt sets.")
app.add_typer(prompts_app, name="prompts")

# gate modes whose routers need no prompts, and what they use instead
PROMPTLESS_GATE_MODES = {"kmeans": "k-means of the calibration text", "random": "random rows",
                         "uniform_random": "random rows", "uniform": "zeros"}
EMBEDDER_HELP = "sentence-transformers model: folder or Hub id in the local cache."
EMBEDDER_DEFAULT = "the packaged all-MiniLM-L6-v2"


@app.command()
@cli_errors
def lint(
    config: Path = typer.Argument(..., readable=False, metavar="CONFIG",
                                  help="The YAML recipe whose expert prompts are checked."),
    embedder: Optional[str] = typer.Option(None, "--embedder", help=EMBEDDER_HELP, show_default=EMBEDDER_DEFAULT),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a pair of experts is above the threshold."),
    threshold: Optional[float] = typer.Option(None, "--threshold", min=-1.0, max=1.0,
                                              help="Centroid cosine above which a pair of experts is flagged.",
                                              show_default="0.70"),
    duplicate_threshold: Optional[float] = typer.Option(None, "--duplicate-threshold", min=-1.0, max=1.0,
                                                        help="Prompt cosine from which two prompts are near-duplicates.",
                                                        show_default="0.90"),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Prompts per embedding forward pass."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
    allow_unknown_keys: bool = typer.Option(False, "--allow-unknown-keys", help="Ignore unknown config keys with a "
                                            "warning, as mergekit-moe does (misspelt keys stay errors)."),
) -> None:
    """Check that the experts' prompt sets are distinct enough for their routers to tell apart."""
    from moe_upcycle.recipe.schema import load_config
    from moe_upcycle.prompts.embed import load_embedder
    from moe_upcycle.errors import ConfigError
    from moe_upcycle.prompts.lint import (DUPLICATE_THRESHOLD, MAX_BUILD_OFFENDERS, PAIR_THRESHOLD, LintReport,
                                          lint_config)
    from moe_upcycle.recipe.resolve import expert_prompts

    cfg = load_config(config, allow_unknown_keys=allow_unknown_keys)
    pair_threshold = PAIR_THRESHOLD if threshold is None else threshold
    duplicate_threshold = DUPLICATE_THRESHOLD if duplicate_threshold is None else duplicate_threshold
    if cfg.gate_mode in PROMPTLESS_GATE_MODES and not any(e.positive_prompts for e in cfg.expert_list()):
        why = f"gate_mode {cfg.gate_mode_said} makes routers without prompts ({PROMPTLESS_GATE_MODES[cfg.gate_mode]})"
        if as_json:  # one JSON document on stdout, as every --json promises: an empty report, the same keys
            empty = LintReport([], [], [], pair_threshold, duplicate_threshold, embedder="")
            out.out(json_text({**empty.to_dict(), "nothing_to_lint": why}), highlight=False)
        else:
            out.print(f"Nothing to lint: {why}.", highlight=False)
        return
    if not any(e.positive_prompts for e in cfg.expert_list()):  # *_prompts_from resolved
        raise ConfigError(f"{config}: no expert has positive_prompts, so there is nothing to lint; list experts "
                          f"with positive_prompts")
    with stage("load embedder", note=embedder or "all-MiniLM-L6-v2"):
        loaded = load_embedder(embedder, batch_size=batch_size)
    n_prompts = sum(len(e.positive_prompts) + len(e.negative_prompts) for e in cfg.expert_list())
    with stage("embed prompts", note=f"{n_prompts} prompts"):
        report = lint_config(expert_prompts(cfg.expert_list()), loaded, pair_threshold=pair_threshold,
                             duplicate_threshold=duplicate_threshold)
    if as_json:
        out.out(json_text({**report.to_dict(), "nothing_to_lint": None}), highlight=False)
    else:
        for table in lint_tables(report):
            out.print(fit(table, out, optional=("negatives", "cosine")))
        problems = report.problems(max_offenders=MAX_BUILD_OFFENDERS)  # the table lists more
        for line in problems:
            console.print(f"[yellow]lint:[/] {escape(line)}", highlight=False, soft_wrap=True)
        if not problems:
            out.print(f"[green]Prompt sets look separable[/] ({len(report.experts)} experts, {report.seconds:.1f}s).")
    flagged = report.flagged_pairs()
    if strict and flagged:
        names = "; ".join(f"{p.first} / {p.second} ({p.centroid_cosine:.2f})" for p in flagged)
        console.print(f"[bold red]lint failed:[/] {len(flagged)} pair(s) above {report.pair_threshold:.2f}: {escape(names)}",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@prompts_app.command("grow")
@cli_errors
def grow(
    config: Path = typer.Argument(..., readable=False, metavar="CONFIG",
                                  help="The YAML recipe whose experts get more prompts."),
    pool: Path = typer.Option(..., "--pool", readable=False, help="Candidate prompts: text (paragraphs separated by blank lines, "
                                                  "or one per line when there is no blank line), or records: "
                                                  "JSONL, a JSON list, CSV or TSV with a \"text\"/\"prompt\" "
                                                  "field (or instruction, question; chat messages)."),
    pool_format: str = typer.Option("auto", "--pool-format", help="How to read the pool: auto (by suffix, then "
                                                                   "content), paragraphs, lines, jsonl, json, csv "
                                                                   "or tsv."),
    per_expert: int = typer.Option(10, "--per-expert", min=1, help="Most prompts added to each expert."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", readable=False, help="Where to write the new YAML.",
                                          show_default="CONFIG.grown.yaml"),
    in_place: bool = typer.Option(False, "--in-place", help="Replace CONFIG itself."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file (never CONFIG without --in-place)."),
    margin: Optional[float] = typer.Option(None, "--margin", help="Least lead over the next most similar expert.",
                                          show_default="0.05"),
    min_similarity: Optional[float] = typer.Option(None, "--min-similarity", help="Least similarity to the expert's prompts.",
                                                  show_default="0.20"),
    embedder: Optional[str] = typer.Option(None, "--embedder", help=EMBEDDER_HELP, show_default=EMBEDDER_DEFAULT),
    allow_unknown_keys: bool = typer.Option(False, "--allow-unknown-keys", help="Ignore unknown config keys with a "
                                            "warning, as mergekit-moe does (misspelt keys stay errors)."),
) -> None:
    """Add to each expert the pool prompts most like its own and clearly unlike the other experts'."""
    from moe_upcycle.errors import ConfigError
    from moe_upcycle.prompts.embed import load_embedder
    from moe_upcycle.prompts.grow import MARGIN, MIN_SIMILARITY, check_growable, check_limits, grow
    from moe_upcycle.prompts.pool import FORMATS, read_pool_file
    from moe_upcycle.recipe.resolve import expert_prompts
    from moe_upcycle.recipe.rewrite import grown_target, write_grown_config
    from moe_upcycle.recipe.schema import load_config

    if pool_format not in FORMATS:
        raise ConfigError(f"--pool-format: {pool_format!r} is not a format; use {', '.join(FORMATS[:-1])} or "
                          f"{FORMATS[-1]}")
    read_first = config.read_bytes() if config.is_file() else None  # what the picks are chosen for
    cfg = load_config(config, allow_unknown_keys=allow_unknown_keys)
    check_limits(per_expert, MIN_SIMILARITY if min_similarity is None else min_similarity,
                 MARGIN if margin is None else margin)
    check_growable(expert_prompts(cfg.expert_list()))
    grown_target(config, output, in_place, force, inputs=[pool])  # a wrong -o fails before the embedder loads
    read = read_pool_file(pool, pool_format)  # type: ignore[arg-type]
    candidates = read.prompts
    out.print(f"Pool: {escape(read.describe(pool))}.", highlight=False)
    with stage("load embedder", note=embedder or "all-MiniLM-L6-v2"):
        loaded = load_embedder(embedder)
    with stage("embed prompts", note=f"{len(candidates)} candidates"):
        growth = grow(expert_prompts(cfg.expert_list()), candidates, loaded, per_expert=per_expert,
                      margin=MARGIN if margin is None else margin,
                      min_similarity=MIN_SIMILARITY if min_similarity is None else min_similarity)
    picks = growth.picks
    written = write_grown_config(config, {name: [p.text for p in chosen] for name, chosen in picks.items()},
                                 output=output, in_place=in_place, force=force, allow_unknown_keys=allow_unknown_keys,
                                 inputs=[pool], expected=read_first)
    table = Table(title=f"prompts added from {escape(pool.name)} ({len(candidates)} candidates)")
    for col in ("expert", "prompt", "similarity", "margin"):
        table.add_column(col)
    for name, chosen in picks.items():
        for p in chosen:
            table.add_row(escape(name), escape(p.text), f"{p.similarity:.2f}", f"{p.margin:.2f}")
    out.print(fit(table, out, optional=("margin",)))
    total = sum(len(v) for v in picks.values())
    out.print(f"[green]Wrote[/] {escape(str(written))}: {total} prompt(s) added "
              f"({escape(', '.join(f'{k} +{len(v)}' for k, v in picks.items()))}).", highlight=False)
    for name, why in growth.why_none.items():
        out.print(f"{escape(name)}: no new prompts: {escape(why)}", highlight=False, soft_wrap=True)
