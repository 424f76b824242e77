"""Train an upcycled MoE for a few steps on CPU and print the loss before and after, per precision recipe.

The training recipe of docs/python_api.md, measured. stories260K (vendored under tests/data) is loaded in
bf16, upcycled in memory (`upcycle_model`, 4 experts, top-2, drop-upcycling or ``--init copy``), and trained for
``--steps`` AdamW steps on the shipped prompt sets (even-numbered prompts; the odd-numbered ones
are held out) with each recipe, all from the same upcycled start:

- ``bf16 weights, lr 2e-5``: what the README used to show. bf16 keeps 8 bits of mantissa, so an
  update smaller than ~1/256 of a weight rounds away and the weights barely move.
- ``bf16 weights, lr 1e-3``: an lr big enough for bf16 updates to land (still lossy).
- ``fp32 master weights + bf16 autocast, lr 1e-3``: ``upcycle_model(..., dtype="float32")``
  and ``torch.autocast(dtype=torch.bfloat16)``: bf16 matmuls, fp32 weights and optimizer.
- ``fp32 master weights + bf16 autocast, lr 2e-5``: the small lr again, now that updates land.

Prints the held-out and training cross-entropy (language-model loss only, no aux loss) before and
after, and the time per step. Deterministic (seeded); numbers vary only with the CPU's summation order.

Usage: python scripts/train_moe_example.py [--model tests/data/stories260K --steps 100 --batch-size 16
       --recipes 'bf16;fp32' --json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moe_upcycle import upcycle_model
from moe_upcycle.recipe.prompt_sets import load_prompts, set_names

REPO = Path(__file__).resolve().parent.parent
SEQ_LEN = 64
RECIPES = {  # name: (MoE weight dtype, autocast to bf16, lr)
    "bf16 weights, lr 2e-5": ("bfloat16", False, 2e-5),
    "bf16 weights, lr 1e-3": ("bfloat16", False, 1e-3),
    "fp32 master + bf16 autocast, lr 1e-3": ("float32", True, 1e-3),
    "fp32 master + bf16 autocast, lr 2e-5": ("float32", True, 2e-5),
}


def token_windows(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenized (BOS + text each), concatenated and cut into (N, SEQ_LEN) windows."""
    ids = [i for text in texts for i in tokenizer(text)["input_ids"]]
    n = len(ids) // SEQ_LEN
    return torch.tensor(ids[: n * SEQ_LEN]).view(n, SEQ_LEN)


def lm_loss(model, windows: torch.Tensor, autocast: bool, batch_size: int = 64) -> float:
    """Mean next-token cross-entropy over `windows` (no aux loss)."""
    total, count = 0.0, 0
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for start in range(0, len(windows), batch_size):
            ids = windows[start:start + batch_size]
            logits = model(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     ids[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += ids[:, 1:].numel()
    return total / count


INITS = {"drop": {"method": "drop", "ratio": 0.5}, "copy": "copy"}


def train(dense, recipe: str, train_ids: torch.Tensor, heldout_ids: torch.Tensor, steps: int, batch_size: int,
          init: str = "drop") -> dict:
    dtype, autocast, lr = RECIPES[recipe]
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init],
                        seed=0, router_aux_loss_coef=0.01, output_router_logits=True, dtype=dtype)
    before = (lm_loss(moe.eval(), train_ids, autocast), lm_loss(moe, heldout_ids, autocast))
    opt = torch.optim.AdamW(moe.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    moe.train()
    start = time.perf_counter()
    for _ in range(steps):
        batch = train_ids[torch.randint(len(train_ids), (batch_size,), generator=gen)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = moe(input_ids=batch, labels=batch).loss  # LM loss + aux load-balancing loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    after = (lm_loss(moe.eval(), train_ids, autocast), lm_loss(moe, heldout_ids, autocast))
    return {"recipe": recipe, "steps": steps, "train_before": before[0], "train_after": after[0],
            "heldout_before": before[1], "heldout_after": after[1], "ms_per_step": 1000 * seconds / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "tests" / "data" / "stories260K"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--recipes", default="",
                        help="';'-separated name prefixes of the recipes to run (default: all)")
    parser.add_argument("--init", choices=sorted(INITS), default="drop", help="expert_init (drop: ratio 0.5)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dense = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    prompts = [p for name in set_names() for p in load_prompts(name, "train example")]
    train_ids, heldout_ids = token_windows(tokenizer, prompts[0::2]), token_windows(tokenizer, prompts[1::2])
    recipes = [r for r in RECIPES if not args.recipes or any(r.startswith(p) for p in args.recipes.split(";"))]
    if not args.json:
        print(f"stories260K -> 4 experts ({args.init}), {len(train_ids)} train / {len(heldout_ids)} held-out windows of "
              f"{SEQ_LEN} tokens, {args.steps} AdamW steps of {args.batch_size}, CPU")
        print(f"{'recipe':<38} {'train loss':>17} {'held-out loss':>17} {'ms/step':>8}", flush=True)
    results = []
    for recipe in recipes:  # one row as each finishes
        r = train(dense, recipe, train_ids, heldout_ids, args.steps, args.batch_size, args.init)
        results.append(r)
        if not args.json:
            print(f"{r['recipe']:<38} {r['train_before']:7.3f} -> {r['train_after']:6.3f} "
                  f"{r['heldout_before']:7.3f} -> {r['heldout_after']:6.3f} {r['ms_per_step']:8.0f}", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
