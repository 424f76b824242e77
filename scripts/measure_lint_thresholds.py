"""Print the cosine statistics behind lint's default thresholds (all-MiniLM-L6-v2, CPU, deterministic).

- centroid cosine between the different-kind prompt sets in gate_configs/prompts (should pass lint)
- centroid cosine between two random halves of one set, and between a set and its paraphrase
  (tests/data/prompt_sets.yaml) — two experts fed like this would collapse (should be flagged)
- pairwise cosine of distinct prompts within a set vs of a prompt and its paraphrase (near-duplicates)

Run: python scripts/measure_lint_thresholds.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's moe_upcycle
from moe_upcycle.prompts.embed import load_embedder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def centroid(v: torch.Tensor) -> torch.Tensor:
    c = v.mean(0)
    return c / c.norm()


def main() -> None:
    emb = load_embedder()
    sets = {p.stem: yaml.safe_load(p.read_text())["prompts"] for p in sorted((ROOT / "gate_configs/prompts").glob("*.yaml"))}
    vecs = {k: emb.encode(v) for k, v in sets.items()}
    cross = {(a, b): float(centroid(vecs[a]) @ centroid(vecs[b])) for a, b in itertools.combinations(vecs, 2)}
    print("centroid cosine, different-kind sets (gate_configs/prompts):")
    for (a, b), c in sorted(cross.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {a:>12} vs {b:<12} {c:.3f}")
    print(f"  max {max(cross.values()):.3f}  mean {sum(cross.values()) / len(cross):.3f}")
    gen = torch.Generator().manual_seed(0)
    halves = []
    for k, v in vecs.items():
        for _ in range(5):
            perm = torch.randperm(len(v), generator=gen)
            h = len(v) // 2
            halves.append(float(centroid(v[perm[:h]]) @ centroid(v[perm[h:]])))
    print(f"centroid cosine, two random halves of one set: min {min(halves):.3f}  mean {sum(halves) / len(halves):.3f}")
    para = yaml.safe_load((ROOT / "tests/data/prompt_sets.yaml").read_text())
    pv = {k: emb.encode(v) for k, v in para.items()}
    for k in ("code", "math"):
        c = float(centroid(pv[k]) @ centroid(pv[f"{k}_paraphrased"]))
        pairs = (pv[k] * pv[f"{k}_paraphrased"]).sum(-1)
        print(f"{k} vs {k}_paraphrased: centroid cosine {c:.3f}; prompt-to-its-paraphrase cosine "
              f"min {pairs.min():.3f} median {pairs.median():.3f} max {pairs.max():.3f}")
    within = []
    for v in vecs.values():
        sim = v @ v.T
        iu = torch.triu_indices(len(v), len(v), 1)
        within.append(sim[iu[0], iu[1]])
    within = torch.cat(within)
    top = within.sort(descending=True).values
    print(f"pairwise cosine of distinct prompts within a set: max {top[0]:.3f}, 99.9th pct "
          f"{torch.quantile(within, 0.999):.3f}, mean {within.mean():.3f}")
    diversity = {k: float((v @ v.T).sum() - len(v)) / (len(v) * (len(v) - 1)) for k, v in vecs.items()}
    print("mean pairwise cosine per set: " + ", ".join(f"{k} {d:.3f}" for k, d in diversity.items()))
    # leave-one-out margin: cosine to own centroid (without the prompt) minus best other centroid
    cents = {k: centroid(v) for k, v in vecs.items()}
    margins = []
    for k, v in vecs.items():
        for i in range(len(v)):
            own = centroid(torch.cat([v[:i], v[i + 1:]])) @ v[i]
            other = max(float(cents[o] @ v[i]) for o in vecs if o != k)
            margins.append(float(own) - other)
    m = torch.tensor(margins)
    print(f"leave-one-out margin (own - best other centroid): min {m.min():.3f}, 10th pct "
          f"{torch.quantile(m, 0.1):.3f}, median {m.median():.3f}; negative for {(m < 0).sum()} of {len(m)} prompts")


if __name__ == "__main__":
    main()
