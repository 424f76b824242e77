"""What `verify` found, and how it is shown: a console table (rich), markdown for the model card, JSON.

Presentation only: the checks themselves live in `verify`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from rich.console import Console
from rich.table import Table

from moe_upcycle.terminal.markup import escape
from moe_upcycle import __version__
from moe_upcycle.check.compare import LogitComparison
from moe_upcycle.recipe.layer_words import moe_layers_row


@dataclass
class VerifyResult:
    """What `verify` found. ``ok`` is True when there is no problem."""

    folder: str
    base: Optional[str] = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loaded_class: Optional[str] = None
    loaded_dtype: Optional[str] = None  # as a user loads it: the folder's own dtype
    experts_implementation: Optional[str] = None  # what transformers picked for the experts
    num_tensors: int = 0
    planned_tensors: Optional[int] = None
    num_experts: Optional[int] = None
    experts_per_token: Optional[int] = None
    comparison: Optional[LogitComparison] = None
    perplexity_dense: Optional[float] = None
    perplexity_moe: Optional[float] = None
    text_tokens: int = 0
    continuations: list[dict] = field(default_factory=list)  # {"prompt", "dense", "moe"}
    max_kl: Optional[float] = None
    min_agreement: Optional[float] = None
    # the layers transformers built as MoE blocks, and the model's depth (a dense MLP in the others: moe_layers)
    moe_layers: Optional[list[int]] = None
    num_layers: Optional[int] = None
    version: str = __version__

    @property
    def ok(self) -> bool:
        return not self.problems

    def rows(self) -> list[tuple[str, str]]:
        """(check, result) pairs, for the console table and the model card."""
        how = ", ".join(x for x in (self.loaded_class, self.loaded_dtype, self.experts_implementation and
                                    f"experts: {self.experts_implementation}") if x)
        rows = [("loads with transformers", f"yes ({how})" if self.loaded_class else "NO")]
        plan_note = (f"all {self.planned_tensors} planned tensors, nothing else" if self.planned_tensors is not None
                     else "not compared with a plan")
        rows.append(("tensors", f"{self.num_tensors} on disk; {plan_note}"))
        rows.append(("experts / top-k", f"{self.num_experts} / {self.experts_per_token}"))
        if self.moe_layers is not None and self.num_layers is not None and len(self.moe_layers) < self.num_layers:
            rows.append(("MoE layers", moe_layers_row(self.moe_layers, self.num_layers)))
        rows.append(("dense base", self.base or "not compared"))
        c = self.comparison
        if c is not None:
            rows.append(("max abs Δlogit", f"{c.max_abs_diff:.3g}"))
            agree = f"{c.top1_agreement:.1%} of {c.positions} positions"
            rows.append(("top-1 agreement", agree + (f" (min {self.min_agreement:.0%})" if self.min_agreement else "")))
            kl = f"{c.mean_kl:.3g} (max over positions {c.max_kl:.3g})"
            rows.append(("mean KL(dense‖moe)", kl + (f", threshold {self.max_kl:g}" if self.max_kl is not None else "")))
        if self.perplexity_moe is not None:
            dense = f"dense {self.perplexity_dense:.3f}, " if self.perplexity_dense is not None else ""
            rows.append(("perplexity", f"{dense}MoE {self.perplexity_moe:.3f} on {self.text_tokens} tokens"))
        passed = "PASSED" if self.comparison is not None else "PASSED (not compared with a dense base)"
        rows.append(("result", passed if self.ok else f"FAILED ({len(self.problems)} problem(s))"))
        return rows

    def lines(self) -> list[str]:
        """Markdown for the model card."""
        out = [f"Checked with `moe-upcycle verify` (moe-upcycle {self.version}): "
               f"**{'passed' if self.ok else 'FAILED'}**.", "", "| check | result |", "|---|---|"]
        out += [f"| {_cell(k)} | {_cell(v)} |" for k, v in self.rows()]
        if self.continuations:
            out += ["", "Greedy continuations:", "", "| prompt | dense | MoE |", "|---|---|---|"]
            out += [f"| {_cell(c['prompt'])} | {_cell(c['dense'] or '')} | {_cell(c['moe'])} |" for c in self.continuations]
        if self.problems:
            out += ["", "Problems:", ""] + [f"- {p}" for p in self.problems]
        return out

    def to_dict(self) -> dict:
        data = asdict(self)
        data["ok"] = self.ok
        data["compared_with_base"] = self.comparison is not None  # ok without it checks files and loading only
        return data


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "\\n")




def print_verify(result: VerifyResult, out: Console, err: Console, notes: bool = True) -> None:
    """Print the result table and continuations to `out`, notes (unless `notes` is False: ``-q``) and problems
    to `err`."""
    table = Table(title=f"moe-upcycle verify {escape(str(result.folder))}", show_header=False)
    for check, value in result.rows():
        style = "" if check != "result" else ("bold green" if result.ok else "bold red")
        table.add_row(check, f"[{style}]{escape(str(value))}[/]" if style else escape(str(value)))
    out.print(table)
    if result.continuations:
        cont = Table(title="greedy continuations")
        for col in ("prompt", "dense", "MoE"):
            cont.add_column(col, overflow="fold")
        for c in result.continuations:
            cont.add_row(escape(c["prompt"]), escape(c["dense"]) if c["dense"] is not None else "-", escape(c["moe"]))
        out.print(cont)
    for note in result.notes if notes else ():
        err.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    for problem in result.problems:
        err.print(f"[bold red]verify failed:[/] {escape(problem)}", highlight=False, soft_wrap=True)
