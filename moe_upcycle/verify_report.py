"""Show a `verify.VerifyResult` on the console with rich: checks, continuations, notes, problems.

Presentation only; the checks and the markdown for the model card live in `verify`.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .verify import VerifyResult


def print_verify(result: VerifyResult, out: Console, err: Console) -> None:
    """Print the result table and continuations to `out`, notes and problems to `err`."""
    table = Table(title=f"moe-upcycle verify {result.folder}", show_header=False)
    for check, value in result.rows():
        style = "" if check != "result" else ("bold green" if result.ok else "bold red")
        table.add_row(check, f"[{style}]{value}[/]" if style else value)
    out.print(table)
    if result.continuations:
        cont = Table(title="greedy continuations")
        for col in ("prompt", "dense", "MoE"):
            cont.add_column(col, overflow="fold")
        for c in result.continuations:
            cont.add_row(c["prompt"], c["dense"] if c["dense"] is not None else "-", c["moe"])
        out.print(cont)
    for note in result.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    for problem in result.problems:
        err.print(f"[bold red]verify failed:[/] {problem}", highlight=False, soft_wrap=True)
