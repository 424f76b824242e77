"""A build's staging folder and shard writing, spread over the ranks of a job; with one process, the same code.

- `shared_stage(world, target, force)`: the lead makes the staging folder and holds the output's lock
  (`checkpoint.output_dir.staged_output`: removed on any failure, renamed into place at the end, one lock
  whatever the number of ranks); the other ranks are told its path and check they see that very folder (a
  build over several nodes writes into one folder, on a filesystem every node mounts at the same path).
- `write_rank_shards(...)`: each rank writes its own shards (`shard_split.deal_shards`) with the executor and
  the writer, exactly as one process writes all of them, and looks for a peer's failure after each tensor;
  then every rank has every shard's sha256, and the lead has checked that every shard is in the folder whole.

It does not write the index, config, card or manifest (the lead does, in `build`), nor compute gates.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from moe_upcycle.checkpoint.output_dir import staged_output
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.writer import ShardedWriter, TensorSpec, assign_shards
from moe_upcycle.distributed.shard_split import deal_shards, rank_plan
from moe_upcycle.distributed.world import World
from moe_upcycle.errors import OutputError
from moe_upcycle.planning.execute import iter_tensors, threads_beside_writer
from moe_upcycle.planning.fused import SAFETENSORS_METADATA
from moe_upcycle.planning.steps import Plan, Step
from moe_upcycle.recipe.params import WriteParams
from moe_upcycle.terminal.progress import stage as progress_stage

SEE_STAGE_S = 10.0  # how long a rank waits to see the staging folder the lead made (a network filesystem's caches)
SHARED_FOLDER = ("every rank writes into one staging folder, so the output must be on a filesystem that every node "
                 "mounts at the same path (NFS, Lustre, GPFS...); write the output there")


@contextlib.contextmanager
def shared_stage(world: World, target: Path, force: bool) -> Iterator[Path]:
    """The staging folder every rank writes into; the lead publishes it when the block ends without error.

    On the lead a failure on any rank is handled inside the staging block, so the lead waits for its peers to
    stop writing before the folder is removed.

    Raises:
        OutputError: as `staged_output`; on a rank that does not see the lead's folder, saying so.
    """
    if world.lead:
        with staged_output(target, force) as stage, world.failing_together():
            world.share((str(stage), os.stat(stage).st_ino))
            yield stage
    else:
        path, inode = world.share(None)
        stage = Path(path)
        _see_same_folder(world, stage, inode)
        yield stage


def _see_same_folder(world: World, stage: Path, inode: int) -> None:
    deadline = time.monotonic() + SEE_STAGE_S
    while True:
        try:
            if os.stat(stage).st_ino == inode:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise OutputError(f"this rank does not see the staging folder {stage} that rank 0 made (or sees another "
                              f"folder by that name): {SHARED_FOLDER}")
        time.sleep(0.1)


def write_rank_shards(world: World, stage: Path, plan: Plan, sources: dict[str, Checkpoint],
                      gates: dict[int, torch.Tensor], shared_gates: dict[int, torch.Tensor], writing: WriteParams,
                      on_step: Callable[[Step, Plan], None]) -> tuple[ShardedWriter, dict[str, str]]:
    """Write this rank's shards of `plan` into `stage`; every rank must call it.

    Returns:
        This rank's writer (it knows every shard's name) and the sha256 of every shard (empty without checksums).

    Raises:
        OutputError: a write failed here, or (on the lead) a shard is missing from the folder or cut short.
        UpcycleError: another rank's failure, raised here too.
    """
    specs = [TensorSpec(s.name, s.shape, s.dtype) for s in plan.steps]
    metadata = SAFETENSORS_METADATA if plan.layout == "fused" else None  # fused: transformers 4.x refuses it
    mine = _dealt(assign_shards(specs, writing.max_shard_bytes), world.size)[world.rank]
    writer = ShardedWriter(stage, specs, writing.max_shard_bytes, writing.checksums, metadata, only=mine)
    part = rank_plan(plan, writer.names)
    try:
        with progress_stage("write", total=part.total_bytes, unit="bytes") as st, threads_beside_writer():
            for step, tensor in iter_tensors(part, sources, gates, writing.tensor_policy, writing.seed, shared_gates):
                writer.write(step.name, tensor)
                on_step(step, plan)
                st.advance(step.nbytes, note=step.name)
                world.check()  # a peer's failure stops this rank within a tensor
            st.update(note="sha256 and fsync of the last shard" if writing.checksums else "fsync of the last shard")
            writer.close(index=False)  # the lead writes the index once every rank is done
    except BaseException:
        writer.abort()
        raise
    with progress_stage("other ranks", note=f"{world.size - 1} writing their shards") if world.size > 1 \
            else contextlib.nullcontext():
        digests = {name: digest for part_digests in world.gather(writer.sha256) for name, digest in part_digests.items()}
    world.from_lead(_check_shards, stage, writer, world.size)
    return writer, digests


def _dealt(shards: list[list[TensorSpec]], ranks: int) -> list[range]:
    return deal_shards([sum(s.nbytes for s in shard) for shard in shards], ranks)


def _check_shards(stage: Path, writer: ShardedWriter, ranks: int) -> None:
    """Every shard is in the folder the lead publishes, at its full length (a rank on a node that mounts another
    folder at that path wrote elsewhere)."""
    owner = {k: r for r, run in enumerate(_dealt(writer.shards, ranks)) for k in run}
    problems = []
    for k, name in enumerate(writer.files):
        try:
            size = os.stat(stage / name).st_size
        except OSError as exc:
            problems.append(f"{stage / name}, which rank {owner[k]} wrote, cannot be read here ({exc.strerror or exc})")
            continue
        if size != writer.file_size(k):
            problems.append(f"{stage / name}, which rank {owner[k]} wrote, has {size} bytes instead of "
                            f"{writer.file_size(k)}")
    if problems:
        raise OutputError(*[f"{p}: {SHARED_FOLDER}" for p in problems])
