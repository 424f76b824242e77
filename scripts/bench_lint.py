"""Time the lint of 8 experts x 50 prompts on CPU with the packaged all-MiniLM-L6-v2.

Prompts are built from templates (8 topics x 50 distinct prompts, 400 texts, 9-20 words each), so
every text is new to the embedder's cache and one batched `encode` call embeds them all.
Prints the model load time, the lint time (embedding + statistics) and the statistics alone.

Run: python scripts/bench_lint.py [--batch-size 64] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's moe_upcycle
from moe_upcycle.prompts.embed import load_embedder  # noqa: E402
from moe_upcycle.prompts.lint import lint_prompts  # noqa: E402

TOPICS = {
    "code": ("Write a {} function in {} that handles {} correctly", ["sorting", "parsing", "caching", "retry", "logging"],
             ["Python", "Rust", "Go", "Java", "C++", "TypeScript", "Kotlin", "Ruby", "Swift", "C#"], "errors"),
    "math": ("Solve this {} problem about {} and explain each step with {}", ["algebra", "geometry", "calculus", "probability", "number theory"],
             ["triangles", "primes", "integrals", "matrices", "sequences", "dice", "polynomials", "limits", "vectors", "graphs"], "care"),
    "poetry": ("Write a {} poem about {} in the style of {}", ["short", "rhyming", "free-verse", "sad", "joyful"],
               ["the sea", "autumn", "lost love", "a city at night", "the moon", "old friends", "rain", "winter", "a garden", "home"], "a romantic poet"),
    "chat": ("Hi! Can you give me some {} advice about {} for {}?", ["friendly", "quick", "honest", "practical", "gentle"],
             ["my weekend", "a birthday gift", "my roommate", "a first date", "moving house", "my dog", "a job interview", "cooking dinner", "saving money", "a holiday"], "today"),
    "science": ("Explain the {} of {} to a student studying {}", ["physics", "chemistry", "biology", "mechanism", "history"],
                ["photosynthesis", "black holes", "DNA replication", "plate tectonics", "vaccines", "entropy", "enzymes", "magnetism", "evolution", "climate change"], "science"),
    "legal": ("What are the {} rules for {} under {} law?", ["basic", "tax", "contract", "privacy", "liability"],
              ["renting a flat", "starting a company", "hiring staff", "selling online", "copyright", "inheritance", "divorce", "parking fines", "noise complaints", "drones"], "European"),
    "medical": ("What are the {} symptoms of {} and when should I see a doctor about {}?", ["common", "early", "serious", "rare", "typical"],
                ["migraine", "flu", "asthma", "diabetes", "anemia", "tonsillitis", "shingles", "gout", "sinusitis", "eczema"], "it"),
    "travel": ("Plan a {} trip to {} with tips about {}", ["three-day", "budget", "family", "luxury", "hiking"],
               ["Japan", "Peru", "Norway", "Morocco", "Vietnam", "Portugal", "Canada", "Kenya", "Iceland", "New Zealand"], "local food and transport"),
}


def prompt_sets() -> dict[str, tuple[list[str], list[str]]]:
    sets = {}
    for name, (template, adjs, nouns, tail) in TOPICS.items():
        sets[name] = ([template.format(a, n, tail) for a in adjs for n in nouns], [])
    return sets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    embedder = load_embedder(batch_size=args.batch_size)
    load_s = time.perf_counter() - t0
    sets = prompt_sets()
    n = sum(len(p) for p, _ in sets.values())
    t1 = time.perf_counter()
    report = lint_prompts(sets, embedder)
    lint_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    lint_prompts(sets, embedder)  # every text cached now: the statistics alone
    stats_s = time.perf_counter() - t2
    print(f"{len(sets)} experts x {n // len(sets)} prompts = {n} texts, torch threads {torch.get_num_threads()}, "
          f"batch size {args.batch_size}, model encode calls {embedder.calls}")
    print(f"load embedder {load_s:.1f}s; lint {lint_s:.1f}s ({n / lint_s:.0f} prompts/s); statistics alone {stats_s * 1000:.0f} ms")
    print(f"flagged pairs {[(p.first, p.second) for p in report.flagged_pairs()]}, problems {len(report.problems())}")


if __name__ == "__main__":
    main()
