#!/usr/bin/env python
"""Print a timeline of one ``moe-upcycle build``: where its wall time goes, phase by phase.

Runs the real command line (``python -m moe_upcycle build ARGS``) in this process, with timestamps
around its stages (wrapped from the outside: the package has no timing code) and a sampler thread
that reads, every 50 ms, the bytes the process has written (``/proc/self/io``) and the CPU time of
each of its threads (``/proc/self/task/*/stat``: the main thread, ``shard-write``, ``sha256``,
``fsync``, ``nan-check``). Times are seconds since the process started (``/proc/self/stat``), so
the interpreter's own start-up is counted.

Printed at the end (stderr): the events; the write throughput per phase (first byte to last
``write``, and its best/worst 0.5 s windows); the CPU seconds of each thread.

What it does not do: it changes nothing in the build, and it is not a test. Its wrappers cost
microseconds per call (a few hundred calls per build).

Usage:
    python scripts/build_timeline.py build experts.yaml OUT [build options]
"""

from __future__ import annotations

import os
import sys
import threading
import time

T_SCRIPT = time.time()
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _process_start() -> float:
    """Wall-clock time this process started: its start in clock ticks after boot (``/proc/self/stat``)
    against the boot clock now (10 ms resolution)."""
    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 of proc(5), counted after the "(comm)" field
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / CLK_TCK
    return time.time() - age


T0 = _process_start()
EVENTS: list[tuple[float, str]] = [(T_SCRIPT - T0, "interpreter up (site imports done)")]
SAMPLES: list[tuple[float, int]] = []  # (t, write_bytes)
THREAD_CPU: dict[str, float] = {}
FIRSTS: dict[str, float] = {}
NAMES: dict[int, str] = {}  # native thread id -> Python thread name
WAITS = {"write": 0.0, "hash": 0.0}  # seconds the main thread waited for a staging buffer, by what held it


def _main_cpu() -> str:
    """The main thread's CPU seconds so far, for events marked on it."""
    return f"  [main CPU {time.thread_time():.2f} s]" if threading.current_thread() is threading.main_thread() else ""


def mark(what: str) -> None:
    EVENTS.append((time.time() - T0, what + _main_cpu()))


def first(what: str) -> None:
    if what not in FIRSTS:
        FIRSTS[what] = time.time() - T0
        EVENTS.append((FIRSTS[what], what + _main_cpu()))


def _write_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def _thread_cpu() -> None:
    """CPU seconds of each live thread, keyed by name (pool threads of one kind summed)."""
    for thread in threading.enumerate():  # Python's names (the OS names are all "python")
        if thread.native_id is not None:
            NAMES[thread.native_id] = "main" if thread is threading.main_thread() else thread.name
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                raw = fh.read()
        except OSError:
            continue
        name = NAMES.get(int(tid)) or raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
        key = name.rstrip("_0123456789") or name
        THREAD_CPU[f"{key}:{tid}"] = cpu


def _sampler(stop: threading.Event) -> None:
    while not stop.is_set():
        SAMPLES.append((time.time() - T0, _write_bytes()))
        _thread_cpu()
        stop.wait(0.05)


def wrap(owner, name: str, label: str, once: bool = False) -> None:
    """Replace owner.name by a function that marks its start and end."""
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        (first if once else mark)(f"{label} start")
        try:
            return original(*args, **kwargs)
        finally:
            (first if once else mark)(f"{label} end")

    setattr(owner, name, wrapped)


def report() -> None:
    mark("exit")
    _thread_cpu()
    out = sys.stderr
    print("\n## timeline (s since process start)", file=out)
    for t, what in sorted(EVENTS):
        print(f"{t:7.3f}  {what}", file=out)
    writes = [(t, b) for t, b in SAMPLES]
    if writes:
        base = writes[0][1]
        writes = [(t, b - base) for t, b in writes]
        total = writes[-1][1]
        start = next((t for t, b in writes if b > 2**20), None)
        end = next((t for t, b in writes if b >= total), None)
        if start is not None and end is not None and end > start:
            print(f"\nwritten: {total / 1e9:.2f} GB, first byte by {start:.2f} s, last by {end:.2f} s: "
                  f"{total / (end - start) / 1e9:.2f} GB/s while streaming", file=out)
            rates = []
            for (t1, b1), (t2, b2) in zip(writes, writes[10:]):
                if t1 >= start and t2 <= end:
                    rates.append((b2 - b1) / (t2 - t1) / 1e9)
            if rates:
                rates.sort()
                print(f"0.5 s windows: min {rates[0]:.2f}, median {rates[len(rates) // 2]:.2f}, "
                      f"max {rates[-1]:.2f} GB/s", file=out)
    kinds: dict[str, float] = {}
    for key, cpu in THREAD_CPU.items():
        kind = key.split(":")[0]
        kinds[kind] = kinds.get(kind, 0.0) + cpu
    print(f"main thread waited for a staging buffer: {WAITS['write']:.2f} s on its write, "
          f"{WAITS['hash']:.2f} s more on its hash", file=out)
    usage = os.times()
    print("\nCPU by thread (s): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
          + f"; process user {usage.user:.2f} + system {usage.system:.2f}", file=out)
    out.flush()


def instrument() -> None:
    mark("instrumenting: importing moe_upcycle (torch, typer, pydantic...)")
    try:  # as `python -m moe_upcycle` starts (`__main__.main`), where the checkout has it
        from moe_upcycle.terminal import import_gc

        import_gc.pause()
    except ImportError:
        pass
    import moe_upcycle.build as build
    import moe_upcycle.cli.app  # noqa: F401  (the command line's own imports, timed here)
    from moe_upcycle.checkpoint import shard_file, writer
    from moe_upcycle.planning import execute, guards
    from moe_upcycle.terminal import exit as exit_module

    mark("imports done")
    wrap(build, "upcycle", "upcycle")
    wrap(build, "prepare", "config + headers + plan")
    wrap(build, "compute_gate_rows", "gates")
    wrap(build, "parallel_experts", "parallel-experts check")
    wrap(build, "write_config", "publish: config.json")
    wrap(build, "copy_tokenizer_files", "publish: tokenizer")
    wrap(build, "build_drift", "publish: init drift")
    wrap(build, "write_model_card", "publish: card")
    wrap(build, "write_recipe", "publish: manifest (hashes small files)")
    wrap(writer.ShardedWriter, "close", "writer.close (last shard's tail, fsync waits, index)")
    wrap(writer, "_sync_and_close", "fsync of a shard")
    wrap(shard_file.ShardFile, "finish", "ShardFile.finish (drain writes + hash)")
    wrap(guards.NonfiniteWatch, "close", "NaN/Inf watch close")
    original_write_buffer = shard_file.ShardFile._write_buffer

    def write_buffer(self, view, n):
        first("first O_DIRECT write")
        return original_write_buffer(self, view, n)

    shard_file.ShardFile._write_buffer = write_buffer
    original_take = shard_file.ShardFile._take

    def take(self):
        if self._free:
            return original_take(self)
        _, futures = self._busy[0]
        t = time.perf_counter()
        futures[0].result()  # the write
        t_write = time.perf_counter()
        for future in futures[1:]:  # the hash
            future.result()
        WAITS["write"] += t_write - t
        WAITS["hash"] += time.perf_counter() - t_write
        return original_take(self)

    shard_file.ShardFile._take = take
    original_iter = execute.iter_tensors

    def iter_tensors(*args, **kwargs):
        first("first tensor read")
        yield from original_iter(*args, **kwargs)
        mark("last tensor handed to the writer")

    for user in _iter_tensors_users(build):  # where the build calls it (build itself, or a distributed rank's code)
        user.iter_tensors = iter_tensors
    original_finish = exit_module.finish

    def finish(code):
        report()
        original_finish(code)

    exit_module.finish = finish


def _iter_tensors_users(build) -> list:
    """The modules whose `iter_tensors` the build calls: `build` itself in a one-process checkout, or the module
    that writes a rank's shards where the build runs as ranks (a checkout of either shape can be timed)."""
    users = [build] if hasattr(build, "iter_tensors") else []
    try:
        from moe_upcycle.distributed import ranked_build

        users.append(ranked_build)
    except ImportError:
        pass
    return users


def main() -> None:
    stop = threading.Event()
    threading.Thread(target=_sampler, args=(stop,), daemon=True, name="timeline").start()
    instrument()
    import runpy

    sys.argv = ["moe-upcycle", *sys.argv[1:]]
    runpy.run_module("moe_upcycle", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
