"""Rich tables for prompt lint reports and routing scores."""

from __future__ import annotations

from rich.table import Table

from moe_upcycle.terminal.markup import escape


def lint_tables(report) -> list[Table]:
    """Rich tables for a `lint.LintReport`: experts, pairs, and misplaced prompts."""
    experts = Table(title=f"expert prompt sets ({escape(str(report.embedder))})")
    for col in ("expert", "prompts", "negatives", "mean pairwise cosine", "near-duplicates"):
        experts.add_column(col)
    for e in report.experts:
        experts.add_row(escape(e.name), str(e.count), str(e.negatives), "-" if e.mean_cosine is None else f"{e.mean_cosine:.2f}",
                        str(len(e.near_duplicates)))
    for name in report.skipped:
        experts.add_row(escape(name), "0", "-", "-", "-")
    pairs = Table(title=f"expert pairs (flagged above {report.pair_threshold:.2f})")
    for col in ("pair", "centroid cosine", "closest cross-expert prompts", "cosine"):
        pairs.add_column(col)
    for p in sorted(report.pairs, key=lambda p: -p.centroid_cosine):
        flag = "[bold red]" if p.centroid_cosine > report.pair_threshold else ""
        near = p.nearest[0]
        pairs.add_row(escape(f"{p.first} / {p.second}"), f"{flag}{p.centroid_cosine:.2f}",
                      escape(f"{near.first!r} / {near.second!r}"), f"{near.cosine:.2f}")
    tables = [experts, pairs]
    if report.offenders:
        worst = Table(title="prompts closer to another expert than to their own (most harmful first)")
        for col in ("expert", "prompt", "closer to", "own", "other"):
            worst.add_column(col)
        for o in report.offenders[:20]:
            worst.add_row(escape(o.expert), escape(o.prompt), escape(o.closer_to), f"{o.own_cosine:.2f}", f"{o.other_cosine:.2f}")
        tables.append(worst)
    return tables


def routing_tables(score) -> list[Table]:
    """Rich tables for a `route_eval.RoutingScore`: accuracy per layer and the confusion matrix."""
    acc = Table(title=f"routing accuracy (overall {score.overall:.1%})")
    acc.add_column("layer")
    acc.add_column("accuracy")
    for layer, a in zip(score.layer_indices, score.layer_accuracy):
        acc.add_row(str(layer), f"{a:.1%}")
    conf = Table(title="confusion (rows: label, columns: expert chosen, majority over layers)")
    conf.add_column("label \\ routed")
    for name in score.expert_names:
        conf.add_column(escape(name))
    conf.add_column("prompts")
    for name, row in zip(score.expert_names, score.confusion.tolist()):
        conf.add_row(escape(name), *map(str, row), str(sum(row)))
    return [acc, conf]
