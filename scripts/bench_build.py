#!/usr/bin/env python
"""Benchmark `moe-upcycle build` on a TinyLlama-shaped model: time, memory, bytes, throughput.

What it does:
1. Writes a TinyLlama-1.1B-shaped dense Llama (hidden 2048, intermediate 5632, 22 layers, 32000
   vocab, 32 heads / 4 KV heads, bf16, about 2.2 GB) with random weights straight into one
   safetensors file under ``--work`` (reused when present; no transformers init).
2. For each expert count (default 4 and 8), with ``gate_mode: random``:
   - a plain copy of the same number of bytes to the same disk (the I/O floor),
   - ``python -m moe_upcycle build`` in a subprocess (the real CLI),
   - the same build with ``--no-checksums`` (no sha256 of the shards in moe_upcycle.json),
   - ``mergekit-moe`` on the same config, if it is installed (``--mergekit PATH`` or on PATH).
   Each child is sampled every 20 ms from ``/proc/<pid>/status`` (VmRSS, RssAnon, summed over its
   process tree) and via psutil; its peak RSS also comes exactly from ``wait4``'s rusage.
3. Prints a markdown table (and writes it to ``--markdown FILE`` if asked), with the targets:
   peak anonymous memory ≤ 1 GB for 4 experts and ≤ 15 % more for 8; wall ≤ 1.5× the plain copy.

What it does not do: it is not a test (nothing here runs in CI), and it does not drop the page
cache (it syncs between runs so each starts with no dirty pages; the input stays cached for all).
Outputs are deleted after each measurement; the dense model is kept for the next run.

Usage:
    python scripts/bench_build.py --work /tmp/moe-bench [--experts 4 8] [--mergekit /venv/bin/mergekit-moe]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINYLLAMA = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
    rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    initializer_range=0.02,
)
SAMPLE_SECONDS = 0.02
GB = 1e9


# ---------------------------------------------------------------------------------------------
# The dense model


def dense_tensor_shapes(dims: dict) -> dict[str, tuple[int, ...]]:
    """Llama tensor names and shapes for `dims`, in the order HF writes them."""
    h, i, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    kv = dims["num_key_value_heads"] * (h // dims["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(dims["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def ensure_dense_model(folder: Path) -> Path:
    """Write the random TinyLlama-shaped checkpoint once (a `.complete` marker says it is whole)."""
    if (folder / ".complete").is_file():
        return folder
    import torch
    from safetensors.torch import save_file

    from moe_upcycle.checkpoint.tiny import make_tokenizer

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in dense_tensor_shapes(TINYLLAMA).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "attention_bias": False, "mlp_bias": False, **TINYLLAMA}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    make_tokenizer(folder)  # a small BPE: both tools copy it; random gates never read it
    (folder / ".complete").write_text("")
    print(f"wrote dense model {folder} ({dir_bytes(folder) / GB:.2f} GB) in {time.perf_counter() - t0:.0f}s",
          file=sys.stderr)
    return folder


# ---------------------------------------------------------------------------------------------
# Measuring a child process


@dataclass
class Run:
    """One measured command."""

    label: str
    experts: int
    wall_s: float = 0.0
    peak_rss: int = 0  # bytes, from wait4 (exact)
    peak_anon: int = 0  # bytes, max sampled RssAnon over the process tree
    peak_psutil_rss: int = 0  # bytes, max sampled psutil rss over the process tree
    out_bytes: int = 0
    cpu_s: float = 0.0  # user + system seconds (far less sensitive than wall time to a busy machine)
    rc: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.out_bytes / self.wall_s if self.wall_s else 0.0


def _status_kb(pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in fields:
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def measure(cmd: list[str], run: Run, log: Path, env: Optional[dict] = None) -> Run:
    """Run `cmd`, sampling its memory until it exits; fills `run` in place."""
    import psutil

    stop = threading.Event()
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)

        def sample() -> None:
            try:
                root = psutil.Process(proc.pid)
            except psutil.NoSuchProcess:
                return
            while not stop.is_set():
                try:
                    tree = [root] + root.children(recursive=True)
                except psutil.NoSuchProcess:
                    break
                anon = sum(_status_kb(p.pid, ("RssAnon",)).get("RssAnon", 0) for p in tree)
                rss = 0
                for p in tree:
                    try:
                        rss += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
                run.peak_anon = max(run.peak_anon, anon)
                run.peak_psutil_rss = max(run.peak_psutil_rss, rss)
                time.sleep(SAMPLE_SECONDS)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        run.wall_s = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: keep Popen consistent
        stop.set()
        sampler.join()
    run.rc = proc.returncode
    run.peak_rss = usage.ru_maxrss * 1024  # Linux: kilobytes
    run.cpu_s = usage.ru_utime + usage.ru_stime
    if run.rc != 0:
        tail = log.read_text(errors="replace")[-2000:]
        run.notes.append(f"exit {run.rc}")
        print(f"--- {run.label} failed (exit {run.rc}); log tail:\n{tail}", file=sys.stderr)
    return run


def plain_copy(src: Path, dst: Path, nbytes: int, sha256: bool = False, chunk: int = 16 * 2**20) -> tuple[float, float]:
    """Copy `nbytes` from `src` (wrapping around) into a new file `dst`; returns (wall, CPU) seconds.

    The same work a build must at least do: read input bytes, write output bytes, no fsync. With
    `sha256`, it also hashes what it writes (in the same thread), as a build does for its recipe.
    """
    import hashlib

    digest = hashlib.sha256() if sha256 else None
    t0, c0 = time.perf_counter(), os.times()
    left = nbytes
    with open(dst, "wb") as out:
        while left > 0:
            with open(src, "rb") as fh:
                while left > 0:
                    data = fh.read(min(chunk, left))
                    if not data:
                        break
                    out.write(data)
                    if digest is not None:
                        digest.update(data)
                    left -= len(data)
    c1 = os.times()
    return time.perf_counter() - t0, (c1.user - c0.user) + (c1.system - c0.system)


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def settle() -> None:
    """Flush dirty pages so each run starts from the same state (not timed)."""
    os.sync()
    time.sleep(1)


# ---------------------------------------------------------------------------------------------
# The benchmark


def write_config(work: Path, dense: Path, experts: int) -> Path:
    """A mergekit-moe config (which moe-upcycle reads unchanged): N copies, random gates."""
    import yaml

    cfg = {"base_model": str(dense), "gate_mode": "random", "dtype": "bfloat16", "experts_per_token": 2,
           "experts": [{"source_model": str(dense)} for _ in range(experts)]}
    path = work / f"experts{experts}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def bench(work: Path, experts_list: list[int], mergekit: Optional[str], repeat_copy: int = 1,
          diagnose_hash: bool = True) -> list[Run]:
    dense = ensure_dense_model(work / "dense-tinyllama")
    src_file = dense / "model.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs: list[Run] = []
    for n in experts_list:
        cfg = write_config(work, dense, n)
        out = work / f"out-moe-upcycle-{n}"
        shutil.rmtree(out, ignore_errors=True)
        settle()
        run = measure([sys.executable, "-m", "moe_upcycle", "build", str(cfg), str(out)],
                      Run("moe-upcycle", n), work / f"moe-upcycle-{n}.log", env)
        run.out_bytes = dir_bytes(out) if out.exists() else 0
        shutil.rmtree(out, ignore_errors=True)
        runs.append(run)
        if diagnose_hash:
            settle()
            nohash = measure([sys.executable, "-m", "moe_upcycle", "build", str(cfg), str(out), "--no-checksums"],
                             Run("moe-upcycle --no-checksums", n), work / f"nohash-{n}.log", env)
            nohash.out_bytes = dir_bytes(out) if out.exists() else 0
            shutil.rmtree(out, ignore_errors=True)
            runs.append(nohash)

        for label, hashing in (("plain copy", False), ("plain copy + sha256", True)):
            copy = Run(label, n, out_bytes=run.out_bytes)
            times = []
            for _ in range(repeat_copy):
                settle()
                times.append(plain_copy(src_file, work / "plain-copy.bin", run.out_bytes, sha256=hashing))
                (work / "plain-copy.bin").unlink()
            copy.wall_s, copy.cpu_s = min(times)
            runs.append(copy)

        if mergekit:
            out = work / f"out-mergekit-{n}"
            shutil.rmtree(out, ignore_errors=True)
            settle()
            mk = measure([mergekit, str(cfg), str(out), "--i-understand-this-is-not-useful-without-training",
                          "--quiet"], Run("mergekit-moe", n), work / f"mergekit-{n}.log")
            mk.out_bytes = dir_bytes(out) if out.exists() else 0
            shutil.rmtree(out, ignore_errors=True)
            runs.append(mk)
        settle()
    return runs


def table(runs: list[Run]) -> str:
    def gb(x: int) -> str:
        return f"{x / GB:.2f}" if x else "–"

    rows = ["| experts | tool | wall (s) | CPU (s) | peak RSS (GB) | peak anon (GB) | output (GB) | write (GB/s) | "
            "wall vs copy | notes |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    copies = {r.experts: r for r in runs if r.label == "plain copy"}
    for r in runs:
        ratio = r.wall_s / copies[r.experts].wall_s if r.experts in copies and copies[r.experts].wall_s else 0
        rss = r.peak_rss if not r.label.startswith("plain copy") else 0
        rows.append(f"| {r.experts} | {r.label} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {gb(rss)} | {gb(r.peak_anon)} | "
                    f"{gb(r.out_bytes)} | {r.throughput / GB:.2f} | {ratio:.2f}× | {'; '.join(r.notes)} |")
    return "\n".join(rows)


def verdicts(runs: list[Run]) -> list[str]:
    """The targets, checked."""
    ours = {r.experts: r for r in runs if r.label == "moe-upcycle"}
    fast = {r.experts: r for r in runs if r.label == "moe-upcycle --no-checksums" and r.rc == 0}
    copies = {r.experts: r for r in runs if r.label == "plain copy"}
    mk = {r.experts: r for r in runs if r.label == "mergekit-moe" and r.rc == 0}
    lines = []
    if 4 in ours:
        a = ours[4].peak_anon
        lines.append(f"- peak anonymous memory, 4 experts: {a / GB:.2f} GB (target ≤ 1 GB): "
                     f"{'met' if a <= GB else 'MISSED'}")
        if 8 in ours:
            growth = ours[8].peak_anon / a - 1
            lines.append(f"- peak anonymous memory, 8 vs 4 experts: {growth:+.1%} (target ≤ +15%): "
                         f"{'met' if growth <= 0.15 else 'MISSED'}")
    hashed = {r.experts: r for r in runs if r.label == "plain copy + sha256"}
    for n, r in ours.items():
        ratio = r.wall_s / copies[n].wall_s
        lines.append(f"- wall time, {n} experts: {ratio:.2f}× the plain copy (target ≤ 1.5×): "
                     f"{'met' if ratio <= 1.5 else 'MISSED'}; {r.wall_s / hashed[n].wall_s:.2f}× a copy that "
                     f"also computes the recipe's sha256; CPU {r.cpu_s / copies[n].cpu_s:.2f}× the plain copy's")
        if n in fast:
            f = fast[n]
            lines.append(f"- wall time with --no-checksums, {n} experts: {f.wall_s / copies[n].wall_s:.2f}× the plain "
                         f"copy (target ≤ 1.5×): {'met' if f.wall_s / copies[n].wall_s <= 1.5 else 'MISSED'}"
                         + (f"; {f.wall_s / mk[n].wall_s:.2f}× mergekit-moe (target ≤ 0.5×)" if n in mk else ""))
        if n in mk:
            lines.append(f"- vs mergekit-moe, {n} experts: wall {r.wall_s / mk[n].wall_s:.2f}× (target ≤ 0.5×), "
                         f"peak RSS {r.peak_rss / mk[n].peak_rss:.2f}×, "
                         f"peak anon {r.peak_anon / max(mk[n].peak_anon, 1):.2f}×")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-upcycle-bench"),
                        help="work folder (needs ~2.2 GB + the largest output, ~13 GB for 8 experts)")
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--mergekit", default=shutil.which("mergekit-moe"),
                        help="path to mergekit-moe (default: found on PATH); pass '' to skip")
    parser.add_argument("--repeat-copy", type=int, default=1, help="plain-copy repeats (best is kept)")
    parser.add_argument("--no-diagnose-hash", action="store_true",
                        help="skip the build with --no-checksums")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    runs = bench(args.work.resolve(), args.experts, args.mergekit or None, args.repeat_copy,
                 not args.no_diagnose_hash)
    import torch

    text = "\n".join([
        f"TinyLlama-shaped dense model (22 layers, hidden 2048, intermediate 5632, vocab 32000, bf16), "
        f"`gate_mode: random`; {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"work folder {args.work} ({shutil.disk_usage(args.work).total / GB:.0f} GB disk).",
        "",
        table(runs),
        "",
        *verdicts(runs),
    ])
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
