#!/usr/bin/env python
"""Benchmark `moe-upcycle build` on a TinyLlama-shaped model: time, memory, bytes, throughput.

What it does:
1. Writes a TinyLlama-1.1B-shaped dense Llama (hidden 2048, intermediate 5632, 22 layers, 32000
   vocab, 32 heads / 4 KV heads, bf16, about 2.2 GB) with random weights straight into one
   safetensors file under ``--work`` (reused when present; no transformers init).
2. For each expert count (default 4 and 8), with ``gate_mode: random``, ``--rounds`` times in turn:
   - ``python -m moe_upcycle build`` in a subprocess (the real CLI, checksums on: the default),
   - with ``--compare DIR``, the same command from another checkout (before/after a change, same rounds),
   - a plain copy of the same number of bytes to the same disk, as a process: the input mmap'd,
     written out, fsync'd at the end (the issue's reference; a build fsyncs its shards too),
   - ``dd oflag=direct`` writing the same number of bytes from the dense file, read again from its
     start as often as needed (one ``dd`` per pass, each writing its 2 GiB-ish piece at its offset,
     the last with ``conv=fsync``), in 16 MiB blocks: the disk's floor, run right before or after the
     build (the order turns by round, with ``--compare``'s build). Not ``/dev/zero``: this virtual disk
     wrote zeros up to 1.4× as fast as the dense file's bytes, which would flatter the floor;
   - the same copy through a page-aligned buffer with ``O_DIRECT`` from Python (as the build's writer
     does: the disk's own speed without the page cache),
   - the same build with ``--no-checksums`` (no sha256 of the shards in moe_upcycle.json),
   - ``mergekit-moe`` on the same config, if it is installed (``--mergekit PATH`` or on PATH),
   - with ``--hidden-gates``: the same build with ``gate_mode: hidden`` (shipped prompt sets, 8 prompts per
     expert, ``--no-lint``), whose gates stream the base one layer at a time on the CPU (fp32).
   Each child is sampled every 20 ms from ``/proc/<pid>/status`` (VmRSS, RssAnon, summed over its
   process tree) and via psutil; its peak RSS also comes exactly from ``wait4``'s rusage.
   Each measurement is appended to ``--work``/bench-runs.jsonl as it ends.
3. Prints a markdown table of medians (and writes it to ``--markdown FILE`` if asked) and the
   targets, as ratios within each round (the commands of a round run back to back, so a machine
   that drifts in speed moves both): default build ≤ 1.15× ``dd oflag=direct``, ≤ 1.3× the plain
   copy and ≤ 0.45× mergekit-moe; peak anonymous memory ≤ 1 GB and flat (≤ +15 %) from 4 to 8
   experts; the hidden-gate build at most 1 GB of peak anonymous memory over the random-gate build. The load
   averages before and after are printed: other jobs on the machine move every
   wall time, and the ratios only partly cancel that.

What it does not do: it is not a test (nothing here runs in CI), and it does not drop the page
cache (it syncs between runs so each starts with no dirty pages; the input stays cached for all).
Outputs are deleted after each measurement; the dense model is kept for the next run.

Usage:
    python scripts/bench_build.py --work /tmp/moe-bench [--experts 4 8] [--rounds 3] [--mergekit /venv/bin/mergekit-moe]
        [--baselines dd direct plain] [--no-diagnose-hash] [--compare /path/to/another/checkout] [--hidden-gates]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
    """Llama tensor names and shapes for `dims`, in the order HF writes them (no lm_head when tied)."""
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
    if not dims.get("tie_word_embeddings"):
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
    round: int = 0
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


def measure(cmd: list[str], run: Run, log: Path, env: Optional[dict] = None, cwd: Path = REPO) -> Run:
    """Run `cmd` (in `cwd`), sampling its memory until it exits; fills `run` in place."""
    import psutil

    stop = threading.Event()
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)

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


COPY_SCRIPT = """
import mmap, os, sys
src, dst, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
chunk = 64 * 2**20
with open(src, "rb") as fh:
    view = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
with open(dst, "wb") as out:
    left = nbytes
    while left > 0:
        for start in range(0, len(view), chunk):
            n = min(chunk, len(view) - start, left)
            out.write(view[start:start + n])
            left -= n
            if left == 0:
                break
    out.flush()
    os.fsync(out.fileno())
"""


DIRECT_COPY_SCRIPT = """
import mmap, os, sys
src, dst, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
chunk = 16 * 2**20
with open(src, "rb") as fh:
    view = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
buf = memoryview(mmap.mmap(-1, chunk))  # page-aligned, as O_DIRECT needs
fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
done, pos = 0, 0
while done < nbytes:
    n = min(chunk, nbytes - done, len(view) - pos)
    buf[:n] = view[pos:pos + n]
    length = n + (-n % 4096)
    os.write(fd, buf[:length])
    done += n
    pos = 0 if pos + n == len(view) else pos + n
os.ftruncate(fd, nbytes)
os.fsync(fd)
os.close(fd)
"""


DD_BLOCK = "16M"


def dd_cmd(src: Path, dst: Path, nbytes: int, block: str = DD_BLOCK) -> list[str]:
    """``dd oflag=direct`` writing `nbytes` of `src`, read again from its start as often as needed.

    One ``dd`` per pass over the source, each writing its piece at its own offset of `dst`
    (``seek_bytes``). A piece is the source's length rounded down to whole MiB, so every piece
    but the last starts and ends on a block boundary (direct I/O writes whole blocks; GNU dd
    writes a last partial block without ``O_DIRECT``). The last ``dd`` fsyncs the file, as a build
    fsyncs its shards. All of them run in one shell, measured as one process tree.
    """
    piece = src.stat().st_size // 2**20 * 2**20
    steps, offset = [], 0
    while offset < nbytes:
        count = min(piece, nbytes - offset)
        last = offset + count == nbytes
        steps.append(f"dd if={shlex.quote(str(src))} of={shlex.quote(str(dst))} bs={block} iflag=count_bytes "
                     f"count={count} oflag=direct,seek_bytes seek={offset} conv=notrunc{',fsync' if last else ''} "
                     f"status=none")
        offset += count
    return ["sh", "-c", " && ".join(steps)]


def direct_copy_cmd(src: Path, dst: Path, nbytes: int) -> list[str]:
    """Like `plain_copy_cmd`, but through a page-aligned buffer with O_DIRECT (what the build's writer
    does): the disk's own speed, without the page cache."""
    return [sys.executable, "-c", DIRECT_COPY_SCRIPT, str(src), str(dst), str(nbytes)]


def plain_copy_cmd(src: Path, dst: Path, nbytes: int) -> list[str]:
    """A process that copies `nbytes` from `src` (wrapping around) into `dst` through an mmap, then fsyncs.

    The least a build must do: read the input's bytes, write the output's bytes, have them on
    disk at the end (a build fsyncs its shards too). No checks, no hashing, no torch import.
    """
    return [sys.executable, "-c", COPY_SCRIPT, str(src), str(dst), str(nbytes)]


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def settle() -> None:
    """Flush dirty pages so each run starts from the same state (not timed)."""
    os.sync()
    time.sleep(1)


# ---------------------------------------------------------------------------------------------
# The benchmark


HIDDEN_PROMPT_SETS = ("code", "math", "chat", "creative", "multilingual", "reasoning", "science")


def write_config(work: Path, dense: Path, experts: int, gate_mode: str = "random") -> Path:
    """A mergekit-moe config (which moe-upcycle reads unchanged): N copies, random gates; or, with
    ``gate_mode: hidden``, the same experts with 8 prompts each from the shipped prompt sets."""
    import yaml

    from moe_upcycle.recipe.prompt_sets import load_prompts

    prompts = [{"positive_prompts": load_prompts(HIDDEN_PROMPT_SETS[e % len(HIDDEN_PROMPT_SETS)], "bench")[:8]}
               if gate_mode != "random" else {} for e in range(experts)]
    cfg = {"base_model": str(dense), "gate_mode": gate_mode, "dtype": "bfloat16", "experts_per_token": 2,
           "experts": [{"source_model": str(dense), **p} for p in prompts]}
    path = work / f"experts{experts}{'' if gate_mode == 'random' else '-' + gate_mode}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


BASELINES = ("dd", "direct", "plain")
DD = "dd oflag=direct"


def record(runs: list[Run], run: Run, work: Path) -> None:
    """Keep `run` and append it to ``work/bench-runs.jsonl`` at once (a long benchmark that stops keeps its rounds)."""
    runs.append(run)
    with open(work / "bench-runs.jsonl", "a") as fh:
        fh.write(json.dumps({**{k: getattr(run, k) for k in ("label", "experts", "round", "wall_s", "cpu_s", "peak_rss",
                                                              "peak_anon", "out_bytes", "rc")},
                             "load": os.getloadavg()[0]}) + "\n")


BASELINE_COMMANDS = {DD: dd_cmd, "plain copy": plain_copy_cmd, "direct copy": direct_copy_cmd}


def run_baseline(label: str, src_file: Path, work: Path, nbytes: int, experts: int, round_: int) -> Run:
    """One of `BASELINE_COMMANDS` writing `nbytes` from `src_file`, measured (its output deleted after)."""
    slug = label.split()[0]
    settle()
    run = measure(BASELINE_COMMANDS[label](src_file, work / f"{slug}.bin", nbytes),
                  Run(label, experts, round_, out_bytes=nbytes), work / f"{slug}.log")
    (work / f"{slug}.bin").unlink(missing_ok=True)
    return run


def run_build(label: str, cfg: Path, out: Path, work: Path, env: dict, experts: int, round_: int,
              options: tuple[str, ...] = (), checkout: Path = REPO) -> Run:
    """``python -m moe_upcycle build`` of `checkout` (this one by default), measured (its output deleted after)."""
    shutil.rmtree(out, ignore_errors=True)
    settle()
    log = work / f"{''.join(c if c.isalnum() else '-' for c in label)}-{experts}.log"
    run = measure([sys.executable, "-m", "moe_upcycle", "-q", "build", str(cfg), str(out), *options],
                  Run(label, experts, round_), log, {**env, "PYTHONPATH": str(checkout)}, cwd=checkout)
    run.out_bytes = dir_bytes(out) if out.exists() else 0
    shutil.rmtree(out, ignore_errors=True)
    return run


def bench(work: Path, experts_list: list[int], mergekit: Optional[str], rounds: int = 3,
          diagnose_hash: bool = True, baselines: tuple[str, ...] = BASELINES,
          compare: Optional[Path] = None, hidden_gates: bool = False) -> list[Run]:
    """Each round runs the build, dd and the build of `compare` (another checkout of moe-upcycle: before/after a
    change, in the same rounds), in an order that turns by one place each round, then the plain and direct
    copies, the build without checksums, the hidden-gate build and mergekit."""
    dense = ensure_dense_model(work / "dense-tinyllama")
    src_file = dense / "model.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs: list[Run] = []
    for n in experts_list:
        cfg = write_config(work, dense, n)
        nbytes = 0  # the output folder's size: the baselines write as many bytes (round 0 builds first)
        out = work / f"out-moe-upcycle-{n}"
        core = ["build"] + (["dd"] if "dd" in baselines else []) + (["compare"] if compare is not None else [])
        for round_ in range(rounds):
            # the build, dd and the other checkout's build take turns at each place in the round: whatever the
            # disk does after a big write (the host flushing its cache) falls on each of them alike. Round 0
            # builds first (it gives the output's size)
            for what in core[round_ % len(core):] + core[:round_ % len(core)]:
                if what == "dd":
                    record(runs, run_baseline(DD, src_file, work, nbytes, n, round_), work)
                    continue
                label, checkout = (("moe-upcycle", REPO) if what == "build" else
                                   (f"moe-upcycle ({compare.name})", compare))
                run = run_build(label, cfg, out, work, env, n, round_, checkout=checkout)
                nbytes = run.out_bytes or nbytes
                record(runs, run, work)
            for key, label in (("plain", "plain copy"), ("direct", "direct copy")):
                if key in baselines:
                    record(runs, run_baseline(label, src_file, work, nbytes, n, round_), work)
            if diagnose_hash:
                record(runs, run_build("moe-upcycle --no-checksums", cfg, out, work, env, n, round_,
                                       ("--no-checksums",)), work)
            if hidden_gates:
                record(runs, run_build("moe-upcycle hidden gates", write_config(work, dense, n, "hidden"), out, work,
                                       env, n, round_, ("--no-lint",)), work)
            if mergekit:
                mk_out = work / f"out-mergekit-{n}"
                shutil.rmtree(mk_out, ignore_errors=True)
                settle()
                mk = measure([mergekit, str(cfg), str(mk_out), "--i-understand-this-is-not-useful-without-training",
                              "--quiet"], Run("mergekit-moe", n, round_), work / f"mergekit-{n}.log")
                mk.out_bytes = dir_bytes(mk_out) if mk_out.exists() else 0
                shutil.rmtree(mk_out, ignore_errors=True)
                record(runs, mk, work)
        settle()
    return runs


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summary(runs: list[Run]) -> dict[tuple[str, int], Run]:
    """Per (tool, experts): the median of each figure over the rounds that succeeded."""
    out: dict[tuple[str, int], Run] = {}
    for key in dict.fromkeys((r.label, r.experts) for r in runs):
        ok = [r for r in runs if (r.label, r.experts) == key and r.rc == 0]
        if not ok:
            continue
        out[key] = Run(key[0], key[1], wall_s=_median([r.wall_s for r in ok]),
                       peak_rss=int(_median([r.peak_rss for r in ok])), peak_anon=int(_median([r.peak_anon for r in ok])),
                       out_bytes=ok[0].out_bytes, cpu_s=_median([r.cpu_s for r in ok]), notes=[f"{len(ok)} runs"])
    return out


def ratios(runs: list[Run], label: str, other: str, experts: int) -> list[float]:
    """Wall-time ratio `label` / `other` within each round (pairs run back to back, so drift cancels)."""
    by_round = {}
    for r in runs:
        if r.experts == experts and r.rc == 0:
            by_round.setdefault(r.round, {})[r.label] = r.wall_s
    return [v[label] / v[other] for v in by_round.values() if label in v and other in v]


def table(runs: list[Run]) -> str:
    def gb(x: int) -> str:
        return f"{x / GB:.2f}" if x else "–"

    def per_round(label: str, other: str, n: int) -> str:
        pair = ratios(runs, label, other, n)
        return "1" if label == other else ", ".join(f"{x:.2f}×" for x in pair) or "–"

    rows = ["| experts | tool | wall (s), median | CPU (s) | peak RSS (GB) | peak anon (GB) | output (GB) | "
            "write (GB/s) | wall vs dd (per round) | wall vs plain copy (per round) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for (label, n), r in summary(runs).items():
        rows.append(f"| {n} | {label} | {r.wall_s:.1f} | {r.cpu_s:.1f} | {gb(r.peak_rss)} | {gb(r.peak_anon)} | "
                    f"{gb(r.out_bytes)} | {r.throughput / GB:.2f} | {per_round(label, DD, n)} | "
                    f"{per_round(label, 'plain copy', n)} |")
    return "\n".join(rows)


def verdicts(runs: list[Run]) -> list[str]:
    """The targets (issues 2, 33: default build ≤ 1.15× dd, ≤ 1.3× the plain copy and ≤ 0.45× mergekit-moe;
    anon ≤ 1 GB, flat), each from the rows that were run."""
    med = summary(runs)
    lines = []
    for n in sorted({r.experts for r in runs}):
        ours = med.get(("moe-upcycle", n))
        if ours is None:
            lines.append(f"- {n} experts: the build failed")
            continue
        vs_dd = ratios(runs, "moe-upcycle", DD, n)
        if vs_dd:
            lines.append(f"- {n} experts, default build (checksums on): {min(vs_dd):.2f}× / {_median(vs_dd):.2f}× "
                         f"(min / median of the rounds) `dd oflag=direct` writing the same bytes (target ≤ 1.15×): "
                         f"{'met' if _median(vs_dd) <= 1.15 else 'MISSED'} by the median")
        if ("plain copy", n) in med:
            vs_copy = _median(ratios(runs, "moe-upcycle", "plain copy", n))
            lines.append(f"- {n} experts, default build: median {vs_copy:.2f}× the plain copy "
                         f"(target ≤ 1.3×): {'met' if vs_copy <= 1.3 else 'MISSED'}")
        if ("direct copy", n) in med:
            lines.append(f"- {n} experts, default build: median "
                         f"{_median(ratios(runs, 'moe-upcycle', 'direct copy', n)):.2f}× the direct-I/O copy from "
                         f"Python (pipelined: the next block is copied while the last is written)")
        for label in sorted({r.label for r in runs if r.experts == n and r.label.startswith("moe-upcycle (")}):
            other = ratios(runs, label, DD, n)
            if other:
                lines.append(f"- {n} experts, {label}: {min(other):.2f}× / {_median(other):.2f}× (min / median) the "
                             f"dd floor; this build / it, per round: "
                             + ", ".join(f"{x:.2f}×" for x in ratios(runs, "moe-upcycle", label, n)))
        if ("moe-upcycle --no-checksums", n) in med:
            base = DD if (DD, n) in med else "plain copy"
            lines.append(f"- {n} experts, --no-checksums: median "
                         f"{_median(ratios(runs, 'moe-upcycle --no-checksums', base, n)):.2f}× the {base}")
        if ("mergekit-moe", n) in med:
            vs_mk = _median(ratios(runs, "moe-upcycle", "mergekit-moe", n))
            mk = med[("mergekit-moe", n)]
            lines.append(f"- {n} experts vs mergekit-moe: median {vs_mk:.2f}× its wall time (target ≤ 0.45×): "
                         f"{'met' if vs_mk <= 0.45 else 'MISSED'}; peak anon {ours.peak_anon / GB:.2f} GB vs "
                         f"{mk.peak_anon / GB:.2f} GB")
        lines.append(f"- {n} experts, peak anonymous memory {ours.peak_anon / GB:.2f} GB (target ≤ 1 GB): "
                     f"{'met' if ours.peak_anon <= GB else 'MISSED'}")
        if ("moe-upcycle hidden gates", n) in med:
            extra = [r.peak_anon for r in runs if (r.label, r.experts) == ("moe-upcycle hidden gates", n) and not r.rc]
            base = [r.peak_anon for r in runs if (r.label, r.experts) == ("moe-upcycle", n) and not r.rc]
            added = _median([h - b for h, b in zip(extra, base)])
            slower = _median(ratios(runs, "moe-upcycle hidden gates", "moe-upcycle", n))
            lines.append(f"- {n} experts, hidden-state gates (streamed): median +{added / GB:.2f} GB of peak anonymous "
                         f"memory over the random-gate build (target ≤ +1 GB): {'met' if added <= GB else 'MISSED'}; "
                         f"wall time {slower:.2f}× the random-gate build's")
    anon = {n: med[("moe-upcycle", n)].peak_anon for n in {r.experts for r in runs} if ("moe-upcycle", n) in med}
    if len(anon) > 1 and min(anon.values()) > 0:
        lo, hi = min(anon), max(anon)
        growth = anon[hi] / anon[lo] - 1
        lines.append(f"- peak anonymous memory, {hi} vs {lo} experts: {growth:+.1%} (flat: ≤ +15%): "
                     f"{'met' if growth <= 0.15 else 'MISSED'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/moe-upcycle-bench"),
                        help="work folder (needs ~2.2 GB + the largest output, ~13 GB for 8 experts)")
    parser.add_argument("--experts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--mergekit", default=shutil.which("mergekit-moe"),
                        help="path to mergekit-moe (default: found on PATH); pass '' to skip")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every command (medians are reported)")
    parser.add_argument("--no-diagnose-hash", action="store_true",
                        help="skip the build with --no-checksums")
    parser.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(BASELINES),
                        help="the reference commands to run beside the build (default: all)")
    parser.add_argument("--compare", type=Path, help="another checkout of moe-upcycle (e.g. main): its build "
                        "runs in the same rounds, as a row of its own")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--hidden-gates", action="store_true",
                        help="also build with gate_mode: hidden (streamed gates) and compare its peak memory")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    runs = bench(args.work.resolve(), args.experts, args.mergekit or None, args.rounds, not args.no_diagnose_hash,
                 tuple(args.baselines), args.compare.resolve() if args.compare else None, args.hidden_gates)
    load_after = os.getloadavg()
    import torch

    text = "\n".join([
        f"TinyLlama-shaped dense model (22 layers, hidden 2048, intermediate 5632, vocab 32000, bf16), "
        f"`gate_mode: random`; {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"work folder {args.work} ({shutil.disk_usage(args.work).total / GB:.0f} GB disk); load average "
        f"(1, 5, 15 min) {', '.join(f'{x:.1f}' for x in load_before)} before, "
        f"{', '.join(f'{x:.1f}' for x in load_after)} after.",
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
