"""The ranks of a job: which one this process is, what they share, and one rank's failure made every rank's.

`joined_world()` joins the job torchrun started (its ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` environment; a
gloo process group) or, outside torchrun, yields the world of this one process, where every method below is
immediate and does nothing: the one-process build is the world-size-1 case of the same code.

- `share` (the lead's value, to every rank: gates, where the staging folder is) and `gather` (every rank's value,
  to every rank: shard digests) are gloo collectives. gloo moves CPU tensors and needs no GPU, so a build uses it
  on GPU machines too (its collectives carry kilobytes to megabytes); under a job whose own group is NCCL it makes
  a gloo group beside it. Values travel as `torch.save` bytes read back with ``weights_only``: plain data,
  tensors and the dataclasses the caller names, no pickled code.
- `failing_together()` wraps a rank's work. When the block raises, the rank records what failed (kind, message,
  rank, host) in the job's c10d store, the key-value store torchrun's rendezvous already runs on, and every rank
  looks there at each `sync` and, while writing, after each tensor (`check`): a failure on any rank raises on all
  within about a tensor's time, not after the healthy ranks finished hours of work. The lead (rank 0) raises the
  first failure (its own, or a peer's with the rank and host in front of each message); the others raise too,
  and the command line prints nothing on them (`cli.app`), so it is said once.
- A rank that dies without a word (SIGKILL, the out-of-memory killer, a crash) is found gone: on its own machine
  by its process id (at once), elsewhere by its heartbeat (a store key each rank bumps every `BEAT_S` from a
  thread, silent for `SILENT_S`). The rank that finds it records a ``gone`` failure for it, so every rank raises
  it (a `RankError` naming that rank), and the lead stops waiting for it at the end instead of its `STOP_WAIT_S`.
  A lead gone is said by rank 1. A store that stops answering (the torchrun agent hosting it ended) is said too.
- `gather_bytes` is the all-gather of raw bytes (JSON records: `agreement` compares every rank's facts with it).
- The end is ordered: before the lead's staging folder is removed it waits (`STOP_WAIT_S`) until every peer has
  stopped writing into it, and a failed peer leaves only after the lead has left (`LEAVE_WAIT_S`). torchrun stops
  every worker with SIGTERM as soon as one exits non-zero; so it never interrupts the lead's clean-up or message.

Why a store and not only collectives: a collective needs every rank to arrive, but ranks write for different
times, and a process blocked in a gloo call runs no Python signal handler until the call returns. So every wait
is a polled store key (SIGINT and SIGTERM act at once), and the gloo collectives run only after every rank has
arrived (`sync`), lasting as long as their transfer (`TRANSFER_TIMEOUT` bounds it); they too are awaited by
polling (``async_op``), so a rank stopped by a signal between two of them never leaves the others blocked. A
rank that hangs (not one that dies: it is found gone) keeps the others waiting, as a hung disk stalls a
one-process build (its heartbeat thread still beats).

It does not start processes (torchrun does, or ``build --workers``) and knows nothing about builds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar

from moe_upcycle.distributed.failure_record import Failure
from moe_upcycle.errors import RankError, UpcycleWarning
from moe_upcycle.terminal.signals import signals_held

T = TypeVar("T")

TRANSFER_TIMEOUT = timedelta(minutes=10)  # one gloo collective, started once every rank has arrived
CHECK_EVERY_S = 0.2  # while writing, how often a rank looks for a peer's failure (one store round trip)
STOP_WAIT_S = 20.0  # the lead's wait for its peers to stop writing into the staging folder before it is removed
LEAVE_WAIT_S = 120.0  # a failed peer's wait for the lead to finish its clean-up and say what failed
BEAT_S = 1.0  # how often each rank's heartbeat thread bumps its key in the store
SILENT_S = 15.0  # a rank on another machine whose heartbeat stood still this long is gone
GONE_CHECK_S = 0.5  # how often a rank looks for peers gone without a word (one store round trip per peer)
_POLL_S = (0.0005, 0.05)  # first and longest sleep between two looks at the store
_RUNS = [0]  # joined worlds in this process: each keeps its keys apart in the job's store
_CURRENT: list["World"] = []


def _bytes_tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _dumps(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes, types: Sequence[type]) -> Any:
    """`torch.load` with ``weights_only``: plain data, tensors and `types` are rebuilt; no other code runs."""
    import torch

    with torch.serialization.safe_globals(list(types)):
        return torch.load(io.BytesIO(data), weights_only=True)


class World:
    """This process among the ranks of a job (see the module doc); ``World()`` is a process alone.

    Every rank must make the same calls of `sync`, `share` and `gather`, in the same order.
    """

    def __init__(self, rank: int = 0, size: int = 1, store: Any = None, group: Any = None):
        self.rank, self.size = rank, size
        self._store, self._group = store, group
        self._syncs = 0
        self._checked = 0.0
        self._stopped = False  # this rank failed (or saw a failure) and stopped its work
        self._own: Optional[Failure] = None
        self.said: set[str] = set()  # the lead: warnings it showed; peers: left to the lead
        self.unsaid: list[str] = []  # a peer's warnings, sent to the lead with the next `gather`
        self._procs: dict[int, dict] = {}  # rank -> {"machine", "host", "pid"}, read once every rank has joined
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (its heartbeat count, when this rank saw it change)
        self._gone_checked = 0.0
        self._beating: Optional[threading.Event] = None  # set to stop this rank's heartbeat thread

    @property
    def lead(self) -> bool:
        """Rank 0: it holds the output's lock and staging folder, publishes and says what happened."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size})"

    # ---- what ranks share -----------------------------------------------------------------------------------

    def sync(self, last: bool = False) -> None:
        """Wait until every rank has come here; raise a peer's failure instead if one was recorded.

        Args:
            last: the job's shared work is over (the output is in place): a failure after it, on any rank, has
                nothing left to wait for.
        """
        if self.size == 1:
            return
        self._syncs += 1
        key = f"sync/{self._syncs}"
        _answered(lambda: self._store.add(key, 1))
        self._wait(lambda: self._store.add(key, 0) >= self.size, check=True)
        if last:
            _answered(lambda: self._store.set(f"stopped/{self.rank}", "1"))

    def share(self, value: T, types: Sequence[type] = ()) -> T:
        """The lead's `value`, on every rank (others pass anything, e.g. None).

        Args:
            types: the classes in `value` besides plain data and tensors (dataclasses), which may be rebuilt.
        """
        if self.size == 1:
            return value
        self.sync()
        return _loads(self._broadcast(_dumps(value) if self.lead else b""), types)

    def gather(self, value: T) -> list[T]:
        """Every rank's `value` (plain data, tensors), in rank order, on every rank. Peers' warnings travel with it
        to the lead, which shows those it has not shown itself."""
        if self.size == 1:
            return [value]
        self.sync()
        got = [_loads(data, ()) for data in self._all_gather(_dumps((value, self.unsaid)))]
        self.unsaid = []
        if self.lead:
            for _, lines in got:
                for line in lines:
                    if line not in self.said:
                        warnings.warn(line, UpcycleWarning, stacklevel=2)
        return [v for v, _ in got]

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order, on every rank: one all-gather, no pickles (e.g. JSON records)."""
        if self.size == 1:
            return [data]
        self.sync()
        return self._all_gather(data)

    def _broadcast(self, data: bytes) -> bytes:
        import torch
        import torch.distributed as dist

        length = torch.tensor([len(data)], dtype=torch.int64)
        self._finish(dist.broadcast(length, src=0, group=self._group, async_op=True))
        buffer = _bytes_tensor(data) if self.lead else torch.empty(int(length), dtype=torch.uint8)
        self._finish(dist.broadcast(buffer, src=0, group=self._group, async_op=True))
        return buffer.numpy().tobytes()

    def _all_gather(self, data: bytes) -> list[bytes]:
        import torch
        import torch.distributed as dist

        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._finish(dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=self._group,
                                     async_op=True))
        longest = max(int(n) for n in lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = _bytes_tensor(data)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._finish(dist.all_gather(parts, mine, group=self._group, async_op=True))
        return [part[:int(n)].numpy().tobytes() for part, n in zip(parts, lengths)]

    def _finish(self, work: Any) -> None:
        """Wait for a collective polling, not blocked in gloo: a signal acts, and a peer that failed instead of
        taking part (a signal between two collectives) raises its failure here."""
        self._wait(work.is_completed, check=True)
        try:
            work.wait()
        except RuntimeError as exc:  # a peer's connection closed: it died (torchrun stops this rank too)
            said = self._why_cut_off()
            if said is not None:
                raise said from None
            raise RankError(f"a transfer between the ranks failed ({exc}); another rank stopped, see its output") \
                from None

    def _why_cut_off(self) -> Optional[BaseException]:
        """After a transfer failed: a peer's recorded failure, or a peer found gone, looked for as long as a gone
        peer on another machine takes to be found (its heartbeat's `SILENT_S`); None if neither shows."""
        deadline = time.monotonic() + SILENT_S + 2 * BEAT_S
        while time.monotonic() < deadline:
            try:
                first = next((f for f in self._failures() if f.rank != self.rank), None)
                if first is None:
                    gone = next((r for r in range(self.size) if self._gone(r)), None)
                    first = self._record_gone(gone) if gone is not None else None
            except _store_errors() as lost:
                return _StoreLost.of(lost)
            if first is not None:
                return self._raised(first)
            time.sleep(0.1)
        return None

    def from_lead(self, fn: Callable[..., T], *args, types: Sequence[type] = ()) -> T:
        """Run ``fn(*args)`` on the lead alone; every rank gets its result (`share`'s `types`), or its failure."""
        return self.share(fn(*args) if self.lead else None, types)

    def lead_context(self, factory: Callable[..., contextlib.AbstractContextManager], *args):
        """``factory(*args)`` on the lead (a context manager for it alone, e.g. the parent folders it makes), a
        context that does nothing on the other ranks."""
        return factory(*args) if self.lead else contextlib.nullcontext()

    # ---- failures -------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise a peer's recorded failure, looking at most every `CHECK_EVERY_S` (for loops over tensors)."""
        if self.size == 1 or time.monotonic() - self._checked < CHECK_EVERY_S:
            return
        self._raise_peer_failure()

    @contextlib.contextmanager
    def failing_together(self, not_failures: tuple[type, ...] = ()) -> Iterator[None]:
        """On any rank, an exception leaving the block (but `not_failures`) is recorded for every rank to raise.

        The lead raises its own exception, unless it is an interrupt that came after a peer's error (torchrun's
        SIGTERM once that peer exited): then that error. Nested blocks handle an exception once.
        """
        try:
            yield
        except not_failures:
            raise
        except BaseException as exc:
            if self.size == 1 or self._stopped:
                raise
            earlier = self._stop(exc)
            if earlier is not None:
                raise earlier from None
            raise

    def _stop(self, exc: BaseException) -> Optional[BaseException]:
        self._stopped = True
        try:
            return self._stop_in_store(exc)
        except (_StoreLost, *_store_errors()) as lost:  # the store's host ended: nothing to record or wait for
            return (lost if isinstance(lost, _StoreLost) else _StoreLost.of(lost)) \
                if isinstance(exc, KeyboardInterrupt) else None

    def _stop_in_store(self, exc: BaseException) -> Optional[BaseException]:
        with signals_held(drop=True):  # a second signal (torchrun passes on the terminal's Ctrl-C) must not cut this short
            if getattr(exc, "failed_rank", self.rank) == self.rank:  # not the echo of a peer's failure
                seq = self._store.add("failures", 1)
                self._own = Failure.of(exc, seq, self.rank, self.size)
                self._store.set(f"failure/{seq}", self._own.record())
            self._store.set(f"stopped/{self.rank}", "1")
            if not self.lead:  # torchrun's SIGTERM after the lead died: say that, the lead cannot
                return self._raised(self._record_gone(0)) if self._gone(0) else None
            # a peer gone without a word writes nothing more: no need to wait for it
            self._wait(lambda: all(self._stopped_or_gone(r) for r in range(1, self.size)), limit=STOP_WAIT_S)
            if self._own is not None and self._own.kind == "interrupt":  # torchrun's SIGTERM after a peer's end?
                first = next((f for f in self._failures() if f.rank != self.rank and f.kind != "interrupt"
                              and (f.seq < self._own.seq or f.kind == "gone")), None)
                if first is None:
                    first = next((self._record_gone(r) for r in range(1, self.size) if self._gone(r)), None)
                return self._raised(first) if first is not None else None
        return None

    # ---- ranks gone without a word --------------------------------------------------------------------------

    def _register(self) -> None:
        """Say where this rank runs (machine, host, process id) and start its heartbeat; read every rank's."""
        self._store.set(f"proc/{self.rank}", json.dumps({"machine": _machine(), "host": socket.gethostname(),
                                                         "pid": os.getpid()}))
        self._beating = threading.Event()
        threading.Thread(target=_beat, args=(_own_connection(self._store), self.rank, self._beating),
                         name="moe-upcycle-heartbeat", daemon=True).start()
        keys = [f"proc/{r}" for r in range(self.size)]
        self._store.wait(keys, TRANSFER_TIMEOUT)
        self._procs = {r: json.loads(v) for r, v in enumerate(self._store.multi_get(keys))}

    def _raised(self, failure: Failure) -> BaseException:
        """`failure` as the error to raise here. A lead gone cannot say what stopped the build: rank 1 says it
        (``said_here``; the command line prints it on that rank)."""
        exc = failure.exception()
        if failure.kind == "gone" and failure.rank == 0 and self.rank == 1:
            exc.said_here = True
        return exc

    def _stop_beating(self) -> None:
        if self._beating is not None:
            self._beating.set()

    def _stopped_or_gone(self, rank: int) -> bool:
        return self._store.check([f"stopped/{rank}"]) or self._gone(rank)

    def _gone(self, rank: int) -> bool:
        """Whether `rank` ended without a word: its process is gone (on this machine), or its heartbeat stood
        still for `SILENT_S` (elsewhere). A rank that stopped or left says so first, and is never gone."""
        proc = self._procs.get(rank)
        if proc is None or rank == self.rank or self._store.check([f"stopped/{rank}"]):
            return False
        if proc["machine"] == _machine():
            return not _alive(proc["pid"])
        count, now = self._store.add(f"beat/{rank}", 0), time.monotonic()
        seen = self._beats.get(rank)
        if seen is None or seen[0] != count:
            self._beats[rank] = (count, now)
            return False
        return now - seen[1] > SILENT_S

    def _record_gone(self, rank: int) -> Failure:
        """The `Failure` of a rank found gone, recorded once for every rank (the first to find it writes it)."""
        if self._store.add(f"gone/{rank}", 1) == 1:
            proc = self._procs[rank]
            how = ("its process ended" if proc["machine"] == _machine() else
                   f"its heartbeat stopped for {SILENT_S:.0f} s")
            seq = self._store.add("failures", 1)
            self._store.set(f"failure/{seq}", Failure.gone(seq, rank, self.size, proc["host"], how).record())
        return next(f for f in self._failures() if f.kind == "gone" and f.rank == rank)

    def _raise_peer_failure(self) -> None:
        try:
            self._look_for_failures()
        except _store_errors() as lost:
            raise _StoreLost.of(lost) from None

    def _look_for_failures(self) -> None:
        self._checked = time.monotonic()
        if self._store.add("failures", 0) == 0:
            if self._checked - self._gone_checked < GONE_CHECK_S:
                return
            self._gone_checked = self._checked
            gone = next((r for r in range(self.size) if self._gone(r)), None)
            if gone is None:
                return
            self._record_gone(gone)
        first = next((f for f in self._failures() if f.rank != self.rank), None)
        if first is not None:
            raise self._raised(first)

    def _failures(self) -> list[Failure]:
        found = []
        for seq in range(1, self._store.add("failures", 0) + 1):
            key = f"failure/{seq}"
            self._store.wait([key], timedelta(seconds=30))  # counted a moment before it was written
            found.append(Failure.from_record(self._store.get(key)))
        return found

    def _wait(self, done: Callable[[], bool], check: bool = False, limit: Optional[float] = None) -> bool:
        """Poll `done` (signals act between looks); with `check`, raise a peer's failure meanwhile. Returns
        whether it came true (False after `limit` seconds)."""
        start, pause = time.monotonic(), _POLL_S[0]
        while not _answered(done):
            if check:
                self._raise_peer_failure()
            if limit is not None and time.monotonic() - start > limit:
                return False
            time.sleep(pause)
            pause = min(pause * 2, _POLL_S[1])
        return True

    def _leave(self, failed: bool) -> None:
        """The lead says it has left (its clean-up and message are done); after a failure, a peer waits for that
        (torchrun stops the others once it exits)."""
        if self.size == 1:
            return
        self._stop_beating()
        with contextlib.suppress(_StoreLost, *_store_errors()):  # leaving a job whose store has ended
            self._say_left(failed)

    def _say_left(self, failed: bool) -> None:
        if self.lead:
            self._store.set("left", "1")
        elif failed:  # (a lead gone without a word never will)
            self._wait(lambda: self._store.check(["left"]) or self._gone(0), limit=LEAVE_WAIT_S)
        self._store.set(f"stopped/{self.rank}", "1")  # it left: not gone


class _StoreLost(RankError):
    """The job's c10d store stopped answering: the torchrun agent that hosts it (on the first node) has ended."""

    @classmethod
    def of(cls, exc: BaseException) -> "_StoreLost":
        said = str(exc).splitlines()[0] if str(exc) else ""
        return cls(f"the job's store stopped answering ({type(exc).__name__}: {said}): the torchrun agent that hosts "
                   f"it ended (its node failed or was stopped); every rank stops and nothing is published — see that "
                   f"node's output")


def _store_errors() -> tuple[type[BaseException], ...]:
    import torch.distributed as dist

    return (dist.DistError,)


def _answered(call: Callable[[], T]) -> T:
    """`call()` (a store operation), a store's lost connection said as `_StoreLost`."""
    try:
        return call()
    except _store_errors() as lost:
        raise _StoreLost.of(lost) from None


def current_world() -> World:
    """The world joined by the innermost `joined_world` (a process alone outside any)."""
    return _CURRENT[-1] if _CURRENT else World()


@contextlib.contextmanager
def joined_world() -> Iterator[World]:
    """Join torchrun's job for the block (reusing a world joined around it, or the caller's process group).

    Without torchrun's environment (``WORLD_SIZE`` unset or 1) it yields a world of one process. A process
    group it initialises (gloo, on the job's ``env://`` store under a prefix of its own, so a script may build
    again) is destroyed at the end; one the caller made is left as it was.

    Raises:
        RankError: ``WORLD_SIZE`` says several processes but the job cannot be joined.
    """
    if _CURRENT:
        yield _CURRENT[-1]
        return
    world, teardown = _join()
    _CURRENT.append(world)
    failed = True
    try:
        with _warnings_to_lead(world):
            yield world
        failed = False
    finally:
        _CURRENT.pop()
        try:
            world._leave(failed)
        finally:
            teardown()


@contextlib.contextmanager
def alone() -> Iterator[World]:
    """This process by itself for the block, even under torchrun: a `joined_world` inside it joins no job (a
    command that runs once, on rank 0, builds as one process)."""
    world = World()
    _CURRENT.append(world)
    try:
        yield world
    finally:
        _CURRENT.pop()


def job_size() -> int:
    """How many processes the job has, from ``WORLD_SIZE`` as torchrun sets it (1 when it is unset or empty).

    Raises:
        RankError: it is not a whole number of 1 or more (set by hand, or by a launcher of another kind).
    """
    value = os.environ.get("WORLD_SIZE", "").strip()
    if not value:
        return 1
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise RankError(f"WORLD_SIZE is {value!r}, not a number of processes (torchrun sets a whole number, 1 or "
                        f"more); unset it to build in one process, or start the build with torchrun")
    return size


def torchrun_follower() -> bool:
    """Whether this process is a rank other than 0 of a job torchrun started (its agent sets
    ``TORCHELASTIC_RUN_ID`` and ``RANK``); a ``RANK`` that is no number counts as not."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    try:
        return int(os.environ.get("RANK", "0")) > 0
    except ValueError:
        return False


def _join() -> tuple[World, Callable[[], None]]:
    import torch.distributed as dist

    joined = dist.is_available() and dist.is_initialized()
    size = dist.get_world_size() if joined else job_size()
    if size == 1:
        return World(), lambda: None
    _RUNS[0] += 1
    prefix = f"moe-upcycle/{_RUNS[0]}/"  # each build of the job apart in its store (a script may build twice)
    if joined:  # the caller's group (its own training job): its store, and a gloo group beside an NCCL one
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=TRANSFER_TIMEOUT)
    else:
        try:  # env:// as torchrun sets it: the job's store, and a group of this build's own on it
            store, rank, size = next(dist.rendezvous("env://", timeout=TRANSFER_TIMEOUT))
            dist.init_process_group("gloo", store=dist.PrefixStore(prefix + "group", store), rank=rank,
                                    world_size=size, timeout=TRANSFER_TIMEOUT)
        except (ValueError, RuntimeError) as exc:
            raise RankError(f"WORLD_SIZE is {size}, but this process could not join the job ({exc}); start the "
                            f"build with torchrun (torchrun --nproc-per-node N -m moe_upcycle build ...)") from None
        group = None

    world = World(dist.get_rank(), dist.get_world_size(), dist.PrefixStore(prefix, store), group)

    def teardown() -> None:
        world._stop_beating()
        if not joined:
            dist.destroy_process_group()
        elif group is not None:
            dist.destroy_process_group(group)

    world._register()
    return world, teardown


def _machine() -> str:
    """This machine and process namespace: process ids of two ranks with the same one can be compared."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        with contextlib.suppress(OSError):
            parts.append(open(path).read().strip() if path.endswith("boot_id") else str(os.stat(path).st_ino))
    return "/".join(parts)


def _alive(pid: int) -> bool:
    """Whether process `pid` of this machine still runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _own_connection(store: Any) -> Any:
    """A connection of the heartbeat thread's own to the job's store (the same one where it cannot clone)."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):
        return store


def _beat(store: Any, rank: int, stop: threading.Event) -> None:
    """This rank's heartbeat: its key bumped every `BEAT_S` until `stop`, or until the store is gone."""
    while not stop.wait(BEAT_S):
        try:
            store.add(f"beat/{rank}", 1)
        except Exception:  # the store's host ended (the job is over): nothing left to tell
            return


@contextlib.contextmanager
def _warnings_to_lead(world: World) -> Iterator[None]:
    """UpcycleWarnings: the lead shows them and notes their text; a peer keeps them for the lead (`gather`)."""
    if world.size == 1:
        yield
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, UpcycleWarning):
            shown(message, category, filename, lineno, file, line)
        elif world.lead:
            world.said.add(str(message))
            shown(message, category, filename, lineno, file, line)
        else:
            world.unsaid.append(str(message))

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
