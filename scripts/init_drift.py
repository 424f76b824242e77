"""Print how far each expert init moves stories260K from the dense model (reference numbers for the docs).

Usage: python scripts/init_drift.py [path/to/stories260K]
Builds each init into a temporary folder with moe-upcycle and prints mean KL / top-1 agreement
on the drift text (recipe.params.DRIFT_TEXT). Deterministic (seed 0).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from moe_upcycle import upcycle

CASES = [
    ("copy", 8, 2, "copy"),
    ("noise 0.01 (relative)", 8, 2, {"method": "noise", "scale": 0.01}),
    ("noise 0.1 (relative)", 8, 2, {"method": "noise", "scale": 0.1}),
    ("drop 0.1", 8, 2, {"method": "drop", "ratio": 0.1}),
    ("drop 0.5", 8, 2, {"method": "drop", "ratio": 0.5}),
    ("split G=2, E=8, k=2", 8, 2, {"method": "split", "granularity": 2}),
    ("split G=2, E=8, k=2, shuffle", 8, 2, {"method": "split", "granularity": 2, "shuffle": True}),
    ("split G=4, E=8, k=4", 8, 4, {"method": "split", "granularity": 4}),
    ("split G=2, E=8, k=1 (not exact)", 8, 1, {"method": "split", "granularity": 2}),
    ("split G=2, E=8, k=3 (not exact)", 8, 3, {"method": "split", "granularity": 2}),
]


def main(base: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print("| init | mean KL (nats/token) | top-1 agreement |\n|---|---|---|")
        for i, (label, e, k, init) in enumerate(CASES):
            result = upcycle({"base_model": base, "num_experts": e, "experts_per_token": k, "gate_mode": "random",
                              "expert_init": init, "report_init_drift": True}, Path(tmp) / str(i))
            d = result.drift
            print(f"| {label} | {d.mean_kl:.3g} | {100 * d.top1_agreement:.1f}% of {d.tokens} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "tests/data/stories260K"))
