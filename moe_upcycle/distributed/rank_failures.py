"""One rank's failure is everyone's: work that may fail on some ranks ends with every rank raising.

`all_or_none(what)` wraps a block that each rank runs on its own (filling its shards, rank 0 writing files).
After the block every rank puts its outcome in the job's c10d store — nothing, or its `failure_record.Failure` as
a JSON record, the one failure channel a distributed build uses too (`world`) — and reads every other rank's; all
raise: the failed rank its own exception, the others an error of the same kind naming that rank and its message.
Without it the healthy ranks would wait in their next collective until the process group's timeout (30 minutes by
default). The wait polls the store, so a signal acts during it.

It does not retry, and it cannot rescue a collective issued inside the block: those must still be issued by
every rank in the same order. Outside a process group (or with one rank) the block simply runs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch.distributed as dist

from moe_upcycle.distributed.failure_record import Failure


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def all_or_none(what: str) -> Iterator[None]:
    """Run the block on every rank; when it raises on any rank, raise on all of them.

    The failure travels as a `failure_record.Failure` (plain strings, the same record a distributed build keeps),
    so every rank raises it as a torchrun build does: the same error class, ``rank R of N (host H): `` before
    each message.

    Args:
        what: what the block does, for the other ranks' message ("filling layer 3").

    Raises:
        The failed rank's own exception on that rank; on the others the first failed rank's error, of the same
        `UpcycleError` class (a `RankError` for a bug), naming that rank, `what` and the message.
    """
    rank, size = world()
    if size == 1:
        yield
        return
    error: Optional[Exception] = None
    try:
        yield
    except Exception as exc:  # KeyboardInterrupt and SystemExit end the process: torchrun stops the others
        error = exc
    record = ""
    if error is not None:
        failure = Failure.of(error, 1, rank, size)
        record = dataclasses.replace(
            failure, problems=tuple(f"{what} failed, so every rank stops: {p}" for p in failure.problems)).record()
    said = _exchange(record, rank, size)
    if error is not None:
        raise error
    failed = next((s for s in said if s), None)
    if failed is not None:
        raise Failure.from_record(failed).exception()


_BLOCKS = [0]  # `all_or_none` blocks run in this process: every rank counts the same (they run the same blocks)
_POLL_S = (0.0005, 0.05)  # first and longest sleep between two looks at the store


def _exchange(record: str, rank: int, size: int) -> list[str]:
    """Every rank's `record` ("" for none), in rank order, through the job's store: one key per rank and block."""
    from torch.distributed.distributed_c10d import _get_default_store

    _BLOCKS[0] += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job counts its blocks from 1 again
    store: Any = dist.PrefixStore(f"moe-upcycle/all-or-none/{attempt}/{_BLOCKS[0]}/", _get_default_store())
    store.set(str(rank), record)
    keys = [str(r) for r in range(size)]
    pause = _POLL_S[0]
    while not store.check(keys):  # polled, not `store.wait`: SIGINT and SIGTERM act between looks
        time.sleep(pause)
        pause = min(pause * 2, _POLL_S[1])
    return [value.decode() for value in store.multi_get(keys)]
