#!/usr/bin/env python
"""Benchmark one build on 1 vs N processes (`build --workers N`, torch's launcher): wall time and per-rank memory.

What it does: the TinyLlama-shaped 1.1B job of `bench_build.py` (its dense model, written once under ``--work``;
``gate_mode: random``, default 4 experts, bf16, 5 GB shards as the default recipe has them, unless
``--max-shard-size``), built ``--rounds`` times by each process count in turn, the order alternating between
rounds (a machine whose speed drifts moves both). Every build is the real command line; ``--workers N`` starts N
ranks on this machine through torch.distributed.run, as ``torchrun --standalone --nproc-per-node N`` does. Each
process of the build is sampled every 20 ms from /proc (RssAnon: memory that is the process's own, not the page
cache of files it reads or writes): the peak of each rank, and of the whole tree. Outputs are checked byte for
byte against the first one-process build of the round (sha256 of every file), then deleted.

It prints a markdown table of medians and the wall-time ratio N / 1 within each round. It is not a test.

Usage:
    python scripts/bench_ranks.py --work /tmp/moe-bench [--ranks 1 2] [--experts 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from bench_build import GB, SAMPLE_SECONDS, _median, dir_bytes, ensure_dense_model, settle, write_config  # noqa: E402


@dataclass
class RankRun:
    """One measured build."""

    ranks: int
    round: int
    wall_s: float = 0.0
    rank_anon: dict[int, int] = field(default_factory=dict)  # rank -> peak RssAnon (bytes)
    tree_anon: int = 0  # peak RssAnon summed over every process of the build (launcher included)
    out_bytes: int = 0
    digest: str = ""
    rc: int = 0


def _anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
    return int(rank) if rank is not None else None


def measure(cmd: list[str], run: RankRun, env: dict, log: Path) -> RankRun:
    import psutil

    stop = threading.Event()
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)

        def sample() -> None:
            root = psutil.Process(proc.pid)
            while not stop.is_set():
                try:
                    tree = [root] + root.children(recursive=True)
                except psutil.NoSuchProcess:
                    break
                total = 0
                for p in tree:
                    anon = _anon(p.pid)
                    total += anon
                    rank = 0 if p.pid == proc.pid and run.ranks == 1 else _rank_of(p.pid)
                    if rank is not None:
                        run.rank_anon[rank] = max(run.rank_anon.get(rank, 0), anon)
                run.tree_anon = max(run.tree_anon, total)
                time.sleep(SAMPLE_SECONDS)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.wait()
        run.wall_s = time.perf_counter() - t0
        stop.set()
        sampler.join()
    run.rc = proc.returncode
    if run.rc:
        print(f"--- {run.ranks} rank(s) failed (exit {run.rc}):\n{log.read_text(errors='replace')[-2000:]}",
              file=sys.stderr)
    return run


def folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode())
        with open(p, "rb") as fh:
            while chunk := fh.read(2**24):
                h.update(chunk)
    return h.hexdigest()


def bench(work: Path, ranks: list[int], experts: int, rounds: int, max_shard_size: str | None) -> list[RankRun]:
    dense = ensure_dense_model(work / "dense-tinyllama")
    cfg = write_config(work, dense, experts)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs: list[RankRun] = []
    for round_ in range(rounds):
        order = ranks if round_ % 2 == 0 else ranks[::-1]
        for n in order:
            out = work / f"out-ranks-{n}"
            shutil.rmtree(out, ignore_errors=True)
            settle()
            cmd = [sys.executable, "-m", "moe_upcycle", "-q", "build", str(cfg), str(out),
                   *(["--max-shard-size", max_shard_size] if max_shard_size else []),
                   *(["--workers", str(n)] if n > 1 else [])]
            run = measure(cmd, RankRun(n, round_), env, work / f"ranks-{n}.log")
            if run.rc == 0:
                run.out_bytes = dir_bytes(out)
                run.digest = folder_digest(out)
            shutil.rmtree(out, ignore_errors=True)
            runs.append(run)
    return runs


def report(runs: list[RankRun], ranks: list[int]) -> str:
    ok = [r for r in runs if r.rc == 0]
    rows = ["| processes | wall (s), median | vs 1 process (per round) | peak anon per rank (GB), median | "
            "peak anon, all processes (GB) | output (GB) | same bytes as 1 process |",
            "|---:|---:|---|---|---:|---:|---|"]
    alone = {r.round: r for r in ok if r.ranks == 1}
    for n in ranks:
        mine = [r for r in ok if r.ranks == n]
        if not mine:
            rows.append(f"| {n} | failed | | | | | |")
            continue
        per_round = [r.wall_s / alone[r.round].wall_s for r in mine if r.round in alone]
        per_rank = {k: _median([r.rank_anon.get(k, 0) for r in mine]) for k in range(n)}
        same = all(r.digest == alone[r.round].digest for r in mine if r.round in alone)
        rows.append(f"| {n} | {_median([r.wall_s for r in mine]):.1f} | "
                    f"{', '.join(f'{x:.2f}x' for x in per_round)} | "
                    f"{', '.join(f'rank {k}: {v / GB:.2f}' for k, v in per_rank.items())} | "
                    f"{_median([r.tree_anon for r in mine]) / GB:.2f} | {mine[0].out_bytes / GB:.2f} | "
                    f"{'yes' if same else 'NO'} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-upcycle-bench"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-shard-size", default=None, help="e.g. 1GB (default: the recipe's, 5GB)")
    args = parser.parse_args()
    if 1 not in args.ranks:
        parser.error("--ranks must include 1 (the reference)")
    args.work.mkdir(parents=True, exist_ok=True)
    runs = bench(args.work.resolve(), args.ranks, args.experts, args.rounds, args.max_shard_size)
    import torch

    print(f"TinyLlama-shaped dense model (bf16, 2.2 GB), {args.experts} experts, `gate_mode: random`, "
          f"max_shard_size {args.max_shard_size or '5GB (default)'}; {os.cpu_count()} CPUs, load average at the end "
          f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}; {args.rounds} rounds.\n")
    print(report(runs, args.ranks))


if __name__ == "__main__":
    main()
