"""Ranks agree before the first byte, a dead rank is named, and one failure channel (issue 39): real processes.

- Two nodes (two torchrun agents, ``--nnodes 2``, c10d rendezvous) given recipes that differ (the seed; the number
  of experts): before, both exited 0 with a mixed build (seed 0 shards beside seed 1 shards), or raised a writer
  traceback. Now every rank refuses before anything is written, one line names the difference with each rank's
  value, and a rebuild with the same recipe writes the one-process bytes.
- A rank killed by SIGKILL while writing: before, ``build --workers 2`` stalled 20 s and said "interrupted
  (SIGTERM)"; now it names the rank and the signal at once, exit 1, nothing left. Under plain torchrun rank 0 says
  the rank left the job without a word.
- `rank_failures.all_or_none` carries its failures as JSON records through the store (no ``all_gather_object``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from failure_checks import REPO, leftovers, module_env, write_big_llama
from moe_upcycle.build import upcycle

NOISE = "expert_init: {method: noise, scale: 0.01}"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _flat(text: str) -> str:
    return " ".join(text.split())


def _two_nodes(recipes: list[Path], target: Path) -> list[tuple[int, str, str]]:
    """One torchrun agent per recipe, as two nodes start them; (exit code, stdout, stderr) of each agent."""
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nodes",
                                "-m", "moe_upcycle", "build", str(recipe), str(target)],
                               cwd=REPO, env=module_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for recipe in recipes]
    said = [agent.communicate(timeout=300) for agent in agents]
    return [(agent.returncode, out, err) for agent, (out, err) in zip(agents, said)]


@pytest.mark.parametrize("case", ["seed", "experts"])
def test_nodes_with_different_recipes_are_refused_before_the_first_byte(case, tiny_llama, tmp_path):
    """Each node's recipe differs in one field; which node becomes rank 0 is the rendezvous' choice, so the line is
    matched either way round. Nothing is written: not even the output's parent folder, which a build makes."""
    values = {"seed": ["seed: 0\nnum_experts: 4", "seed: 1\nnum_experts: 4"],
              "experts": ["num_experts: 4", "num_experts: 2"]}[case]
    recipes = []
    for k, value in enumerate(values):
        recipes.append(tmp_path / f"node{k}.yaml")
        recipes[-1].write_text(f"base_model: {tiny_llama}\ngate_mode: random\n{NOISE}\nmax_shard_size: 30KB\n{value}\n")
    target = tmp_path / "out" / "moe"
    ran = _two_nodes(recipes, target)
    assert [code for code, _, _ in ran] == [1, 1], ran
    host = re.escape(socket.gethostname())
    shown = {"seed": r"seed (\d)", "experts": r"(\d) experts"}[case]
    line = re.compile(rf"config error: ranks disagree on the recipe: rank 1 \(host {host}\) has {shown}, rank 0 "
                      rf"\(host {host}\) has {shown}(?: \(and (\d) more differences\))?; nothing was written — give "
                      rf"every node the same recipe and sources")
    found = [m for _, out, err in ran for m in line.finditer(_flat(out + err))]
    assert len(found) == 1, ran  # said once, by rank 0
    assert {found[0].group(1), found[0].group(2)} == ({"0", "1"} if case == "seed" else {"2", "4"})
    # the experts differ, and with them num_experts and the plan: the count says the other differences are there
    assert found[0].group(3) == (None if case == "seed" else "2")
    assert not any("/moe_upcycle/" in err for _, _, err in ran)  # no traceback of ours (torchrun prints its own)
    assert not (tmp_path / "out").exists()
    if case == "seed":  # the same recipe on both nodes: the one-process bytes, into the same output
        recipes[1].write_text(recipes[0].read_text())
        ran = _two_nodes(recipes, target)
        assert [code for code, _, _ in ran] == [0, 0], ran
        alone = upcycle(str(recipes[0]), tmp_path / "alone" / "moe")  # as deep: the manifest's relative paths
        assert _files(target) == _files(alone.output) and len(alone.shards) >= 3
        assert leftovers(target) == ["moe"]


@pytest.fixture(scope="module")
def big_config(tmp_path_factory) -> Path:
    """4 experts of a 13 MB model in 4 MB shards: 52 MB of output, long enough to kill a rank while it writes."""
    folder = write_big_llama(tmp_path_factory.mktemp("big") / "llama")
    cfg = folder.parent / "experts.yaml"
    cfg.write_text(f"base_model: {folder}\nnum_experts: 4\ngate_mode: random\nmax_shard_size: 4MB\n")
    return cfg


def _kill_rank_while_writing(proc: subprocess.Popen, target: Path, rank: int = 1) -> float:
    """SIGKILL to the RANK=`rank` process once a shard is in the staging folder; the seconds until `proc` ended."""
    deadline = time.monotonic() + 180
    while not any(stage.glob("model-*.safetensors") for stage in target.parent.glob(f".{target.name}.partial-*")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no shard was written before the build ended: {proc.communicate()}")
        time.sleep(0.005)
    (victim,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == str(rank)]
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    proc.wait(timeout=120)
    return time.monotonic() - killed


def test_a_rank_killed_by_sigkill_is_named_by_build_workers(big_config, tmp_path):
    """The out-of-memory killer's signal on rank 1 mid-write: one line naming rank 1 and SIGKILL, within seconds
    (before: a 20 s stall, then "interrupted (SIGTERM)"); exit 1; no output, staging folder or lock; a rebuild
    writes the one-process bytes."""
    target = tmp_path / "moe"
    command = [sys.executable, "-m", "moe_upcycle", "build", str(big_config), str(target), "--workers", "2"]
    proc = subprocess.Popen(command, cwd=REPO, env=module_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    took = _kill_rank_while_writing(proc, target)
    out, err = proc.communicate()
    said = _flat(out + err)
    assert proc.returncode == 1, out + err
    assert said.count("rank error: rank 1 of 2 was killed by SIGKILL (the out-of-memory killer? see dmesg); every "
                      "rank stopped and nothing was written under the output name") == 1, out + err
    assert "interrupted" not in said and "Traceback" not in said and said.count("error") == 1, out + err
    assert took < 10, took
    assert leftovers(target) == []
    rebuilt = subprocess.run(command, cwd=REPO, env=module_env(), capture_output=True, text=True, timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    assert _files(target) == _files(upcycle(str(big_config), tmp_path / "alone").output)


@pytest.mark.parametrize("killed", [1, 0])
def test_under_torchrun_a_killed_rank_is_said_to_have_left_the_job(killed, big_config, tmp_path):
    """Plain torchrun: the ranks cannot know the signal, only that a rank's process ended without a word. Rank 0
    says it of rank 1; of rank 0 (whose staging folder stays), rank 1 says it, and the next build clears that."""
    target = tmp_path / "moe"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "moe_upcycle", "build", str(big_config), str(target)], cwd=REPO, env=module_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    took = _kill_rank_while_writing(proc, target, killed)
    out, err = proc.communicate()
    assert proc.returncode != 0
    said = _flat(out + err)
    stays = (" (rank 0's staging folder beside the output stays until the next build to that output clears it)"
             if killed == 0 else "")
    assert said.count(f"rank error: rank {killed} of 2 (host {socket.gethostname()}) left the job without a word (its "
                      "process ended): it was killed (by a signal, or the out-of-memory killer: see dmesg) or crashed, "
                      f"see its output; every rank stopped and nothing was published{stays}") == 1, out + err
    assert "interrupted" not in said and "/moe_upcycle/" not in err
    assert took < 10, took
    if killed == 0:
        assert sorted(name.split("-")[0] for name in leftovers(target)) == [".moe.lock", ".moe.partial"]
        upcycle(str(big_config), target)  # the next build clears them
        assert leftovers(target) == ["moe"]
    else:
        assert leftovers(target) == []


ONE_CHANNEL_WORKER = '''
import json, os, sys
import torch.distributed as dist
from moe_upcycle.distributed.rank_failures import all_or_none
from moe_upcycle.errors import OutputError

def pickled(*args, **kwargs):
    raise AssertionError("a pickled collective")

dist.all_gather_object = dist.broadcast_object_list = dist.gather_object = pickled
dist.init_process_group("gloo")
rank = dist.get_rank()
got = []
for step, bad in enumerate((None, 1, 0)):
    try:
        with all_or_none(f"step {step}"):
            if rank == bad:
                raise OutputError(f"disk full on rank {rank}")
        got.append(None)
    except Exception as exc:
        got.append([type(exc).__name__, str(exc)])
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(got, f)
dist.barrier()
dist.destroy_process_group()
'''


def test_all_or_none_raises_a_ranks_failure_on_every_rank_without_pickles(tmp_path):
    """Three blocks on two gloo ranks (none fails; rank 1 fails; rank 0 fails), with the pickling collectives
    replaced by a function that raises: each failure is raised on both ranks, its own on the failed one and the same
    class naming it on the other."""
    script = tmp_path / "worker.py"
    script.write_text(ONE_CHANNEL_WORKER)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], cwd=REPO, env=module_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    host = socket.gethostname()
    assert got[0] == [None, ["OutputError", f"rank 1 of 2 (host {host}): step 1 failed, so every rank stops: disk "
                                            f"full on rank 1"], ["OutputError", "disk full on rank 0"]]
    assert got[1] == [None, ["OutputError", "disk full on rank 1"],
                      ["OutputError", f"rank 0 of 2 (host {host}): step 2 failed, so every rank stops: disk full on "
                                      f"rank 0"]]


# ---- in-process: a rank found gone, a difference named --------------------------------------------------------


def test_a_rank_is_gone_when_its_process_ended_or_its_heartbeat_stood_still(monkeypatch):
    """Rank 1 on this machine: gone once its process has ended (a zombie counts as ended), not while it runs. Rank 2
    on another machine: gone after its heartbeat stood still for SILENT_S, not while it beats; a rank that said it
    stopped is never gone. The first rank to find one records it for every rank, as a RankError naming it."""
    import torch.distributed as dist

    from moe_upcycle.distributed import world as world_module
    from moe_upcycle.errors import RankError

    monkeypatch.setattr(world_module, "SILENT_S", 0.3)
    store = dist.HashStore()
    here = world_module._machine()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        world = world_module.World(rank=0, size=4, store=store)
        world._procs = {0: {"machine": here, "host": "a", "pid": 1},
                        1: {"machine": here, "host": "a", "pid": child.pid},
                        2: {"machine": "elsewhere", "host": "b", "pid": 1},
                        3: {"machine": "elsewhere", "host": "c", "pid": 1}}
        store.set("stopped/3", "1")
        assert [world._gone(r) for r in range(4)] == [False, False, False, False]
        store.add("beat/2", 1)
        time.sleep(0.2)
        assert not world._gone(2)  # it beat since the last look
        time.sleep(0.4)
        assert world._gone(2) and not world._gone(3)  # silent for 0.4 s > 0.3 s; rank 3 stopped, no heartbeat needed
        os.kill(child.pid, signal.SIGKILL)  # not reaped: a zombie, as a killed rank is until torchrun polls it
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert world._gone(1)
        child.wait()
        assert world._gone(1)
        with pytest.raises(RankError) as raised:
            world._raise_peer_failure()
        assert str(raised.value).startswith("rank 1 of 4 (host a) left the job without a word (its process ended)")
        assert raised.value.failed_rank == 1 and store.add("failures", 0) == 1
        world._record_gone(1)  # found again (by another rank): recorded once
        assert store.add("failures", 0) == 1
    finally:
        child.kill()


def test_a_store_that_stopped_answering_is_said_not_a_traceback():
    """The job's store lives in one torchrun agent (the first node's); when that agent ends, a rank's next look at
    the store raises DistNetworkError from C++: said as a RankError naming the store and what to look at."""
    from datetime import timedelta

    import torch.distributed as dist

    from moe_upcycle.distributed.world import World
    from moe_upcycle.errors import RankError

    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=5))
    world = World(rank=1, size=2, store=dist.PrefixStore("job/", client))
    world._raise_peer_failure()  # nothing failed, nobody gone (no ranks registered)
    del server
    with pytest.raises(RankError) as raised:
        world.sync()
    assert str(raised.value).startswith("the job's store stopped answering (DistNetworkError: ")
    assert str(raised.value).endswith("the torchrun agent that hosts it ended (its node failed or was stopped); every "
                                      "rank stops and nothing is published — see that node's output")


def test_the_first_difference_is_named_with_every_disagreeing_rank(stories, tmp_path):
    """Three ranks: one shares rank 0's facts, one has another seed and max_shard_size: the seed comes first in the
    order facts are compared. Two ranks reading one path whose file differs (the same tensors, a longer header):
    the sources differ, and nothing else."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moe_upcycle.build import prepare
    from moe_upcycle.distributed.agreement import build_facts, disagreement

    base = {"base_model": str(stories), "num_experts": 2, "gate_mode": "random"}
    target = tmp_path / "moe"
    ranks = []
    for recipe in (base, base, {**base, "seed": 5, "max_shard_size": "1MB"}):
        config, sources, plan = prepare(recipe)
        ranks.append({"host": f"h{len(ranks)}", "facts": build_facts(config, sources, plan, target, 10**6)})
    message = disagreement(ranks).problems
    assert message == ["ranks disagree on the recipe: rank 2 (host h2) has seed 5, rank 0 (host h0) has seed 0 (and "
                       "1 more difference); nothing was written — give every node the same recipe and sources"]
    copy = tmp_path / "copy"  # one path, as every node names it; rank 1's node holds other bytes there
    shutil.copytree(stories, copy)
    config, sources, plan = prepare({**base, "base_model": str(copy)})
    first = {"host": "h0", "facts": build_facts(config, sources, plan, target, 10**6)}
    (weights,) = copy.glob("*.safetensors")
    tensors = load_file(str(weights))
    save_file(tensors, str(weights), metadata={"format": "pt", "saved_by": "another node"})  # same values, longer
    config, sources, plan = prepare({**base, "base_model": str(copy)})
    facts = build_facts(config, sources, plan, target, 10**6)
    error = disagreement([first, {"host": "h1", "facts": facts}])
    assert type(error).__name__ == "SourceError", error
    (said,) = error.problems
    assert said.startswith(f"ranks disagree on the sources: rank 1 (host h1) has {copy}: ")
    assert "(and" not in said  # the same plan from the same shapes: only the headers differ
    assert said.endswith("give every node the same copy of each model (same files, same sizes)")
