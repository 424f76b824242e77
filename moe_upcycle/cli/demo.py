"""The bundled demo: generate a tiny dense Llama, upcycle it to 4 experts, compare logits.

Shows in seconds, on CPU, that sparse upcycling with identical experts is function-preserving:
the MoE's logits equal the dense model's.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from safetensors import SafetensorError

from moe_upcycle.terminal.markup import escape
from moe_upcycle.cli.next_steps import shell_path
from moe_upcycle.build import upcycle
from moe_upcycle.check.compare import compare_logits, load_causal_lm, run_model
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.checkpoint.ownership import DEMO_PARTS, prepare_demo_folder, record_demo_dense, remove_ours
from moe_upcycle.errors import OutputError, reraise_if_out_of_memory

DEMO_TEXT = "Once upon a time there was a little dragon who loved to add numbers."


def run_demo(folder: Path, console: Console | None = None, num_experts: int = 4, verbose: bool = False) -> dict:
    """Run the demo in `folder` (new, empty, or a previous demo's: see `ownership`). Returns the figures it printed.

    With `verbose`, the whole duplicate-tensor report (`planning.report.sharing_report`), else its one line."""
    console = console or Console()
    existed = os.path.lexists(os.path.expanduser(folder))
    folder = prepare_demo_folder(Path(folder))  # refuses a folder the demo did not make
    try:
        try:
            dense = make_dense_model(folder / "dense", family="llama", seed=0)
            record_demo_dense(folder)  # the files this transformers version wrote: a re-run removes exactly those
        except (OSError, SafetensorError) as exc:  # a full disk: safetensors says it in its own error
            reraise_if_out_of_memory(exc)
            raise OutputError(f"demo folder {folder}: writing the tiny dense model failed ({exc}); nothing the demo "
                              f"wrote is left") from None
        return _upcycle_and_compare(folder, dense, console, num_experts, verbose)
    except BaseException:  # an error, Ctrl-C: what this run wrote goes (the build's own output is staged)
        for part in DEMO_PARTS:
            remove_ours(folder / part)
        if not existed:
            remove_ours(folder)
        raise


def _upcycle_and_compare(folder: Path, dense: Path, console: Console, num_experts: int, verbose: bool) -> dict:
    console.print(f"1. generated a tiny dense Llama in {escape(shell_path(dense))}", highlight=False, soft_wrap=True)
    result = upcycle({"base_model": str(dense), "num_experts": num_experts, "experts_per_token": 2,
                      "gate_mode": "random", "seed": 0}, folder / "moe")
    console.print(f"2. upcycled to {num_experts} experts (top-2, random gates): {escape(shell_path(result.output))}, "
                  f"{len(result.plan.steps)} tensors, {result.seconds:.2f}s", highlight=False, soft_wrap=True)
    for line in result.sharing if verbose else [result.sharing_line] if result.sharing_line else []:
        console.print("   " + escape(line), highlight=False, soft_wrap=True)
    dense_run = run_model(load_causal_lm(dense), [DEMO_TEXT], continuation_prompts=0)
    moe_run = run_model(load_causal_lm(result.output), [DEMO_TEXT], continuation_prompts=0)
    c = compare_logits(dense_run.logits, moe_run.logits)
    diff, agree = c.max_abs_diff, c.top1_agreement
    ok = diff <= 1e-5
    console.print(f"3. loaded both in transformers: max |logit diff| {diff:.2e}, top-1 agreement {agree:.0%}",
                  highlight=False, soft_wrap=True)
    console.print(f"   -> {'[green]MoE reproduces the dense model' if ok else '[red]MISMATCH'}", highlight=False)
    return {"ok": ok, "max_abs_diff": diff, "top1_agreement": agree, "mean_kl": c.mean_kl,
            "output": str(result.output)}
