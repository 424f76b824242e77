"""A longer, randomized fuzz of the inputs a user hands the tool: a base model's config.json and the recipe.

The suite's fuzz tests (tests/test_fuzz.py, tests/test_trust_fuzz.py) are derandomized: the same examples in
every run, so a failure there is reproducible and never luck. This script searches further, with a seed of its
choice: it writes hostile JSON (every type, nested rope dicts, huge and negative numbers, NaN) into the fields of
a tiny base's config.json, and hostile values into the recipe's keys, and runs the build, the plan from
config.json alone and (for configs that build) the output's own config.json through transformers' AutoConfig.
Every example must end in a complete output or an `UpcycleError` naming the file it is about, with nothing
written; anything else is a finding, printed with the input that made it. Findings belong in the suite as
``@example`` cases.

Usage:
    python scripts/fuzz_inputs.py --examples 400 --seed 7          # about 2-4 minutes on 2 cores
    python scripts/fuzz_inputs.py --minutes 10                      # as many as fit, seed from the clock
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_upcycle import UpcycleError, upcycle  # noqa: E402
from moe_upcycle.checkpoint.config_checks import CHECKED_FIELDS, ROPE_NUMBERS, ROPE_REQUIRED  # noqa: E402
from moe_upcycle.checkpoint.dense_config import REQUIRED_INT_FIELDS  # noqa: E402
from moe_upcycle.checkpoint.tiny import make_dense_model  # noqa: E402

FIELDS = sorted(CHECKED_FIELDS | set(REQUIRED_INT_FIELDS))
ROPE_KEYS = ["rope_type", "type", "rope_theta", *ROPE_NUMBERS, "short_factor", "long_factor"]
RECIPE_KEYS = {"num_experts": [1, 2, 3, 0, "2", 2.5], "experts_per_token": [1, 2, 5, 0, True],
               "gate_mode": ["random", "uniform", "uniform_random", "cheap_embed", "Random"],
               "dtype": ["float32", "bf16", "float16", "float64", None], "seed": [0, -1, 2**64, "0"],
               "router_init_std": [0.02, 0.0, 1e300, 0.5], "gate_scale": [1.0, None, 0, 2.0],
               "gate_center": [True, False, "yes"], "architecture": ["mixtral", "qwen2_moe", "qwen3_moe", "gpt"],
               "layout": ["per_expert", "fused", "x"], "tensor_policy": ["share", "clone", "copy"],
               "max_shard_size": ["50KB", 1, "1 GiB", -1], "output_router_logits": [False, True, "false"],
               "expert_init": [{"method": "drop", "ratio": 0.25}, {"method": "split", "granularity": 2},
                               {"method": "noise", "scale": 1e9}, "copy"]}


def hostile(rng: random.Random, depth: int = 0):
    """A JSON value of any type: the field's own type most often wrong, sometimes nested."""
    kind = rng.randrange(12 if depth < 2 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 3, 16, 64, 2**31, 2**63, -2**40, 10**30])
    if kind == 3:
        return rng.choice([0.0, -0.0, 0.5, 1e-300, 1e300, math.nan, math.inf, -math.inf, 64.0, 1e-6])
    if kind == 4:
        return rng.choice(["", "x", "64", "silu", "bfloat16", "float64", "torch.float16", "yes", "NaN", "\u0000",
                           "full_attention", "linear", "llama3", "model.safetensors", "../x.safetensors"])
    if kind in (5, 6):
        return [rng.choice([1, 2, "a", None, 1.5]) for _ in range(rng.randrange(4))]
    if kind in (7, 8):
        return {}
    if kind == 9:
        return [hostile(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == 10:  # a rope dict: plausible keys, hostile values
        return {rng.choice(ROPE_KEYS): (rng.choice(list(ROPE_REQUIRED)) if rng.random() < 0.3
                                        else hostile(rng, depth + 1)) for _ in range(rng.randrange(1, 5))}
    return {rng.choice(["a", "type", "factor", "rope_type"]): hostile(rng, depth + 1) for _ in range(rng.randrange(3))}


def config_case(rng: random.Random, valid: dict) -> dict:
    cfg = dict(valid)
    for key in rng.sample(FIELDS, rng.randrange(1, 4)):
        if rng.random() < 0.15:
            cfg.pop(key, None)
        else:
            cfg[key] = hostile(rng)
    if rng.random() < 0.2:
        cfg[rng.choice(["foo", "rope", "text_config"])] = hostile(rng)
    return cfg


def recipe_case(rng: random.Random, base: Path) -> dict:
    recipe = {"base_model": str(base), "num_experts": 2, "gate_mode": "random"}
    for key in rng.sample(sorted(RECIPE_KEYS), rng.randrange(0, 3)):
        recipe[key] = rng.choice(RECIPE_KEYS[key]) if rng.random() < 0.75 else hostile(rng)
    return recipe


def run_one(base: Path, recipe: dict, work: Path, check_autoconfig: bool) -> str:
    """'built', 'refused:<Error>', or raises AssertionError / anything unexpected (a finding)."""
    target = work / "out" / "moe"
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        upcycle(dict(recipe), dry_run=True, from_config=True)
    except UpcycleError:
        pass
    try:
        result = upcycle(dict(recipe), target)
    except UpcycleError as exc:
        assert str(exc), "an empty message"
        assert not target.exists() and not list(target.parent.iterdir()), "something was left written"
        return f"refused:{type(exc).__name__}"
    written = (target / "config.json").read_text()
    out = json.loads(written, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(f"{c} in config.json")))
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {s.name for s in result.plan.steps}
    if check_autoconfig:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(target))  # the output's config.json loads where it is published (typed in 5)
    assert out["num_hidden_layers"] > 0
    shutil.rmtree(target)
    return "built"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=400, help="examples in all (config.json and recipe cases)")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long instead")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (printed)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    warnings.simplefilter("ignore")
    outcomes: Counter = Counter()
    findings: list[tuple[str, str]] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pristine = make_dense_model(work / "pristine", family="llama", seed=0)
        valid = json.loads((pristine / "config.json").read_text())
        base = work / "base"
        shutil.copytree(pristine, base)
        n = 0
        while (n < args.examples if args.minutes is None else time.monotonic() - start < args.minutes * 60):
            n += 1
            if rng.random() < 0.7:
                case = config_case(rng, valid)
                (base / "config.json").write_text(json.dumps(case, allow_nan=True))
                recipe, what = {"base_model": str(base), "num_experts": 2, "gate_mode": "random"}, "config.json"
            else:
                (base / "config.json").write_text(json.dumps(valid))
                recipe, what, case = recipe_case(rng, base), "recipe", None
            try:
                outcome = run_one(base, recipe, work, check_autoconfig=what == "config.json")
                outcomes[f"{what} {outcome}"] += 1
            except Exception:  # noqa: BLE001 - every other ending is the finding
                outcomes[f"{what} FINDING"] += 1
                findings.append((json.dumps(case if case is not None else recipe, allow_nan=True, default=str)[:2000],
                                 traceback.format_exc(limit=4)))
                shutil.rmtree(work / "out", ignore_errors=True)
    seconds = time.monotonic() - start
    print(f"seed {seed}: {n} examples in {seconds:.0f} s ({seconds / max(n, 1):.2f} s each)")
    for key, count in sorted(outcomes.items()):
        print(f"  {key}: {count}")
    for case, trace in findings[:10]:
        print(f"\nFINDING with {case}\n{trace}")
    print(f"{len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
