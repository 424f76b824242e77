"""One build on several processes (torchrun, gloo on CPU): the same bytes as one process, and every guarantee of
docs/guarantees.md across ranks — a refusal or a failure said once by rank 0, one rank's failure or signal stops
every rank, nothing published, no staging folder, no lock.

Each torchrun job costs seconds to start (two Python processes importing torch), so the byte-identity cases share
one job (`ranked_build_worker.py` builds them in turn) and the failure cases use the smallest models that show
them. The deal of shards and the writer's part, and how a peer's failure is raised, are checked in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from failure_checks import REPO, leftovers, module_env, write_big_llama
from moe_upcycle.build import upcycle
from moe_upcycle.checkpoint.writer import INDEX_NAME, ShardedWriter, TensorSpec
from moe_upcycle.distributed.shard_split import deal_shards
from moe_upcycle.distributed.failure_record import Failure
from moe_upcycle.distributed.world import World
from moe_upcycle.errors import OutputError, RankError
from moe_upcycle.terminal.signals import Terminated

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
WORKER = Path(__file__).resolve().parent / "ranked_build_worker.py"
STORY_PROMPTS = ["Once upon a time there was a little girl.", "The dog ran to the park and played."]
CODE_PROMPTS = ["def add(a, b): return a + b", "for i in range(10): print(i)"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _assert_same_folder(ranked: Path, alone: Path) -> None:
    a, b = _files(ranked), _files(alone)
    assert sorted(a) == sorted(b)
    assert [name for name in a if a[name] != b[name]] == []  # every shard, the index, config, card and manifest


def _torchrun(*args: str, log_dir: Path | None = None, **popen) -> subprocess.Popen:
    """torchrun with 2 ranks; with `log_dir`, each rank's stdout and stderr go to its own files there."""
    logs = ["--log-dir", str(log_dir), "--redirects", "3"] if log_dir else []
    return subprocess.Popen([*TORCHRUN, *logs, *args], cwd=popen.pop("cwd", REPO), env=popen.pop("env", module_env()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _rank_output(log_dir: Path, rank: int) -> str:
    (err,) = log_dir.glob(f"**/attempt_0/{rank}/stderr.log")
    (out,) = log_dir.glob(f"**/attempt_0/{rank}/stdout.log")
    return out.read_text() + err.read_text()


# ---- the same bytes as one process -------------------------------------------------------------------------


def test_two_ranks_write_the_bytes_one_process_writes(tiny_mistral, tiny_llama, tiny_qwen2, stories, tmp_path):
    """Random gates from a sharded source (clone policy), hidden-state gates (computed by rank 0 alone, sent to
    rank 1) with ``verify`` (rank 0 runs it; every rank gets its result), Drop-Upcycling's per-(layer, expert) random rows, and the fused layout with noisy experts and a
    shared expert: each built by two ranks, every file equal byte for byte to the one-process build's, and each
    rank wrote a part of the tensors (none both)."""
    recipes = {
        "random": {"base_model": str(tiny_mistral), "num_experts": 4, "gate_mode": "random", "seed": 3,
                   "tensor_policy": "clone", "max_shard_size": "30KB"},
        "hidden": {"base_model": str(stories), "gate_mode": "hidden", "device": "cpu", "max_shard_size": "100KB",
                   "experts": [{"source_model": str(stories), "name": "story", "positive_prompts": STORY_PROMPTS},
                               {"source_model": str(stories), "name": "code", "positive_prompts": CODE_PROMPTS}]},
        "drop": {"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random", "seed": 7,
                 "expert_init": {"method": "drop", "ratio": 0.5}, "max_shard_size": "40KB"},
        "fused": {"base_model": str(tiny_qwen2), "architecture": "qwen2_moe", "gate_mode": "random", "layout": "fused",
                  "experts_per_token": 2, "max_shard_size": "60KB",
                  "experts": [{"source_model": str(tiny_qwen2), "noise_scale": 0.01} for _ in range(3)],
                  "shared_experts": [{"source_model": str(tiny_qwen2)}]},
    }
    verified = {"hidden"}  # rank 0 verifies the folder; the figures go into the card and manifest
    jobs = [{"recipe": r, "output": str(tmp_path / f"{name}-ranked"), "written": str(tmp_path / name),
             "verify": name in verified} for name, r in recipes.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    # hidden-state gates are a forward pass in fp32, whose sums depend on the number of intra-op threads (a
    # one-process build with OMP_NUM_THREADS=1 differs from one with 2 too): rank 0 computes them with the threads
    # of the one-process builds below (torchrun would set OMP_NUM_THREADS=1)
    proc = _torchrun(str(WORKER), str(tmp_path / "jobs.json"), env={**module_env(),
                                                                   "OMP_NUM_THREADS": str(torch.get_num_threads())})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    for name, recipe in recipes.items():
        alone = upcycle(recipe, tmp_path / f"{name}-alone", verify=name in verified)
        _assert_same_folder(tmp_path / f"{name}-ranked", alone.output)
        by_rank = [json.loads(Path(f"{tmp_path / name}.rank{r}.json").read_text()) for r in (0, 1)]
        assert [rank["verified"] for rank in by_rank] == ([True, True] if name in verified else [None, None])
        assert all(len(rank["shards"]) >= 3 and rank["shards"] == alone.shards for rank in by_rank)
        written = [set(rank["written"]) for rank in by_rank]
        index = json.loads((alone.output / INDEX_NAME).read_text())["weight_map"]
        assert written[0] and written[1] and not written[0] & written[1] and written[0] | written[1] == set(index)
        assert leftovers(tmp_path / f"{name}-ranked") == [f"{name}-ranked"]  # no staging folder, no lock


def test_build_workers_starts_the_ranks_itself(tiny_llama, tmp_path):
    """``build --workers 2``: torch's launcher in the command itself; one "Built" line, the one-process bytes, and
    nothing left in the temporary folder (left to itself the launcher leaves a ``torchelastic_*`` folder per run)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\nmax_shard_size: 30KB\n")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**module_env(), "TMPDIR": str(temporary)}
    env.pop("PET_LOG_DIR", None)  # the suite's own log folder for torchrun (conftest), not a user's
    proc = subprocess.run([sys.executable, "-m", "moe_upcycle", "build", str(recipe), str(tmp_path / "ranked"),
                           "--workers", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert list(temporary.iterdir()) == []
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("Built") == 1 and "Traceback" not in proc.stderr and "torch.distributed" not in proc.stderr
    _assert_same_folder(tmp_path / "ranked", upcycle(str(recipe), tmp_path / "alone").output)


def test_two_nodes_write_the_bytes_one_process_writes(tiny_llama, tmp_path):
    """Several nodes as users start them: one torchrun agent per node (``--nnodes 2``, c10d rendezvous, each node
    its own LOCAL_RANK 0), here two agents on this machine sharing its filesystem. One "Built" line (node 0's rank
    0), every file the one-process build's bytes."""
    import socket

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\nseed: 5\nmax_shard_size: 30KB\n")
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
            "-m", "moe_upcycle", "build", str(recipe), str(tmp_path / "ranked")]
    agents = [subprocess.Popen(node, cwd=REPO, env=module_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    said = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], said
    assert sum(out.count("Built") for out, _ in said) == 1 and not any("Traceback" in err for _, err in said)
    _assert_same_folder(tmp_path / "ranked", upcycle(str(recipe), tmp_path / "alone").output)
    assert len(list((tmp_path / "ranked").glob("model-*.safetensors"))) >= 3
    assert leftovers(tmp_path / "ranked") == ["ranked"]


# ---- said once, by rank 0 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["bad recipe", "output exists"])
def test_a_refusal_is_said_once_by_rank_0(case, tiny_llama, tmp_path):
    recipe, target = tmp_path / "r.yaml", tmp_path / "moe"
    mode = "randm" if case == "bad recipe" else "random"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: {mode}\n")
    if case == "output exists":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    proc = _torchrun("-m", "moe_upcycle", "build", str(recipe), str(target), log_dir=tmp_path / "logs")
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    said = {r: _rank_output(tmp_path / "logs", r) for r in (0, 1)}
    words = ("gate_mode: 'randm' is not allowed; did you mean random?" if case == "bad recipe" else
             f"output folder {target} already exists and is not empty")
    assert " ".join(said[0].split()).count(words) == 1 and "Traceback" not in said[0], said[0]
    assert said[1] == ""  # rank 1 exits non-zero, quietly
    if case == "output exists":
        assert _files(target) == {"notes.txt": b"mine"} and leftovers(target) == ["moe"]
    else:
        assert leftovers(target) == []


# ---- one rank's failure is everyone's ----------------------------------------------------------------------


def test_a_write_failure_on_rank_1_stops_both_and_publishes_nothing(tiny_llama, tmp_path):
    """A real failure on one rank only: rank 1 runs under a file-size limit (RLIMIT_FSIZE, set for it alone by a
    sitecustomize), so writing its first shard fails with EFBIG. Rank 0 says it once, naming rank 1; nothing is
    published, the staging folder (made by rank 0) and the lock are gone; the rebuild writes the one-process bytes."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, resource, signal\n"
        "if os.environ.get('RANK') == '1':\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (8000, resource.RLIM_INFINITY))\n")
    recipe, target = tmp_path / "r.yaml", tmp_path / "moe"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\nmax_shard_size: 20KB\n")
    env = {**module_env(), "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    proc = subprocess.Popen([*TORCHRUN, "--log-dir", str(tmp_path / "logs"), "--redirects", "3", "-m", "moe_upcycle",
                             "build", str(recipe), str(target)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    said = {r: _rank_output(tmp_path / "logs", r) for r in (0, 1)}
    flat = " ".join(said[0].split())
    assert flat.count("output error: rank 1 of 2 (host ") == 1 and "File too large" in flat, said[0]
    assert "Traceback" not in said[0] and said[1] == ""
    assert leftovers(target) == []
    rebuilt = _torchrun("-m", "moe_upcycle", "build", str(recipe), str(target))  # no limit now: the one-process bytes
    out, err = rebuilt.communicate(timeout=300)
    assert rebuilt.returncode == 0, out + err
    _assert_same_folder(target, upcycle(str(recipe), tmp_path / "alone").output)


def _start_big_build(cfg: Path, target: Path) -> subprocess.Popen:
    # its own session, so a Ctrl-C can be sent to torchrun and both ranks at once, as a terminal does
    return _torchrun("-m", "moe_upcycle", "build", str(cfg), str(target), start_new_session=True)


def _wait_for_shards(proc: subprocess.Popen, target: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(stage.glob("model-*.safetensors") for stage in target.parent.glob(f".{target.name}.partial-*")):
            return
        if proc.poll() is not None:
            pytest.fail(f"the build ended (rc {proc.returncode}) before any shard was written:\n{proc.communicate()}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail("no shard appeared in the staging folder")


@pytest.fixture(scope="module")
def big_config(tmp_path_factory) -> Path:
    """8 experts of a 13 MB model: 104 MB of output in 33 shards, long enough to stop midway."""
    folder = write_big_llama(tmp_path_factory.mktemp("big") / "llama")
    cfg = folder.parent / "experts.yaml"
    cfg.write_text(f"base_model: {folder}\nnum_experts: 8\ngate_mode: random\nmax_shard_size: 4MB\n")
    return cfg


@pytest.mark.parametrize("how", ["SIGTERM to rank 1", "Ctrl-C"])
def test_a_signal_stops_every_rank_and_leaves_nothing(how, big_config, tmp_path):
    """SIGTERM to rank 1 alone (`kill` of one worker): rank 0 stops too and says which rank was interrupted. Ctrl-C: SIGINT to torchrun and both ranks at once, which torchrun sends each rank again; rank 0's
    clean-up is not cut short by the second one. Either way no output, staging folder or lock is left."""
    target = tmp_path / "moe"
    proc = _start_big_build(big_config, target)
    _wait_for_shards(proc, target)
    if how == "Ctrl-C":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        (rank1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
        rank1.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    said = " ".join((out + err).split())
    expected = "interrupted (SIGINT)" if how == "Ctrl-C" else "interrupted (SIGTERM on rank 1 of 2, host "
    assert said.count(expected) == 1 and "nothing was written under the output name" in said, out + err
    assert "/moe_upcycle/" not in err  # no traceback of ours (torchrun prints one of its own launcher)
    assert leftovers(target) == []


# ---- in-process: the deal, the writer's part, a peer's failure raised here --------------------------------


def test_shards_are_dealt_in_runs_balanced_by_bytes():
    sizes = [5, 1, 1, 1, 1, 1, 1, 1, 1, 5, 3, 3]
    for ranks in (1, 2, 3, 5, 16):
        runs = deal_shards(sizes, ranks)
        assert len(runs) == ranks and [k for run in runs for k in run] == list(range(len(sizes)))
        shares = [sum(sizes[k] for k in run) for run in runs]
        assert max(shares) <= sum(sizes) / ranks + max(sizes)  # an even share, plus at most one shard
    assert deal_shards([4, 4, 4, 4], 2) == [range(0, 2), range(2, 4)]
    assert deal_shards([], 3) == [range(0, 0)] * 3


def test_writers_of_parts_write_the_files_of_the_whole(tmp_path):
    """Two writers, each given some of the shards (as two ranks are), write the same files as one writer of all."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(10 + i, 7, generator=g) for i in range(9)}
    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    whole = ShardedWriter(tmp_path / "whole", specs, max_shard_bytes=900)
    (tmp_path / "whole").mkdir()
    for name, t in tensors.items():
        whole.write(name, t)
    whole.close()
    (tmp_path / "parts").mkdir()
    parts = [ShardedWriter(tmp_path / "parts", specs, 900, only=only) for only in ({0, 2, 5}, {1, 3, 4})]
    assert len(whole.shards) == 6 and sorted(parts[0].names + parts[1].names) == sorted(tensors)
    for part in parts:
        for name in part.names:
            part.write(name, tensors[name])
        part.close(index=False)
    assert not (tmp_path / "parts" / INDEX_NAME).exists()  # the lead writes it, once every rank is done
    parts[0].write_index()
    assert _files(tmp_path / "parts") == _files(tmp_path / "whole")
    assert {**parts[0].sha256, **parts[1].sha256} == whole.sha256
    assert [parts[0].file_size(k) for k in range(6)] == [(tmp_path / "whole" / f).stat().st_size for f in whole.files]


def test_a_peers_failure_is_raised_as_its_own_kind_naming_the_rank():
    error = Failure.of(OutputError("writing x failed: No space left on device"), 1, 1, 4)
    raised = error.exception()
    assert type(raised) is OutputError and raised.failed_rank == 1
    assert raised.problems == [f"rank 1 of 4 (host {error.host}): writing x failed: No space left on device"]
    stop = Failure.of(Terminated(signal.SIGTERM), 2, 3, 4).exception()
    assert isinstance(stop, KeyboardInterrupt) and stop.signum == signal.SIGTERM and stop.where.startswith(" on rank 3")
    bug = Failure.of(ValueError("boom"), 3, 2, 4).exception()
    assert isinstance(bug, RankError) and "failed with ValueError: boom" in str(bug)
    world = World()  # one process: nothing to wait for, nothing to send
    assert world.lead and world.gather(5) == [5] and world.share("x") == "x" and world.from_lead(len, "ab") == 2
    with pytest.raises(OutputError), world.failing_together():
        raise OutputError("alone")


def test_workers_under_a_torchrun_job_of_another_size_is_refused(tiny_llama, tmp_path, monkeypatch):
    """``--workers 2`` in a job torchrun started with 3 processes: refused, naming both counts; nothing written."""
    from failure_checks import assert_clean_failure, cli
    from moe_upcycle.cli import commands

    monkeypatch.setattr(commands, "current_world", lambda: World(rank=0, size=3))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\n")
    code, output = cli("build", recipe, tmp_path / "moe", "--workers", "2")
    assert_clean_failure(code, output, tmp_path / "moe", ["--workers 2: this build runs as 3 processes of a torchrun "
                                                          "job already; drop --workers"])


def test_world_size_without_torchrun_is_refused_before_any_work(tiny_llama, tmp_path, monkeypatch):
    """WORLD_SIZE=2 set by hand, without the rest of torchrun's environment: a clear error, nothing written."""
    from failure_checks import assert_clean_failure, cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\n")
    code, output = cli("build", recipe, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", ["rank error: WORLD_SIZE is 2, but this process could not "
                                                          "join the job", "MASTER_ADDR", "start the build with torchrun"])


@pytest.mark.parametrize("cpus, workers", [(2, 100_000), (2, 5), (1, 3)])
def test_more_workers_than_twice_the_cpus_is_refused_before_any_process_starts(cpus, workers, tiny_llama, tmp_path,
                                                                                  monkeypatch):
    """Before: ``--workers 100000`` started processes until the machine stalled (load 200 on 2 cores). Now refused
    in the command's own process, naming the count, the CPUs and what to give; no worker starts, nothing written."""
    from failure_checks import assert_clean_failure, cli
    from moe_upcycle.distributed import local_launch

    started = []
    monkeypatch.setattr(local_launch, "usable_cpus", lambda: cpus)
    monkeypatch.setattr("torch.distributed.run.run", lambda args: started.append(args))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\n")
    code, output = cli("build", recipe, tmp_path / "moe", "--workers", str(workers))
    assert_clean_failure(code, output, tmp_path / "moe", [
        f"--workers {workers}: this machine has {cpus} CPU{'s' if cpus > 1 else ''} for this process; more than "
        f"{2 * cpus} workers (two to a CPU) only share them", f"give --workers {cpus} (one to a CPU) or at most "
        f"{2 * cpus}", "run torchrun on several machines"])
    assert started == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a process allowed on 2 CPUs or more, to pin a child to fewer")
def test_usable_cpus_is_this_process_affinity():
    """A child pinned to one CPU (as ``taskset -c N`` does) counts 1, on a machine with more: the affinity, not
    ``os.cpu_count()`` (a container's or a job's CPU set is the affinity)."""
    cpu = min(os.sched_getaffinity(0))
    child = ("import os; os.sched_setaffinity(0, {%d}); from moe_upcycle.terminal.cpus import usable_cpus; "
             "print(usable_cpus(), os.cpu_count())" % cpu)
    done = subprocess.run([sys.executable, "-c", child], cwd=REPO, env=module_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    counted, machine = map(int, done.stdout.split())
    assert counted == 1 and machine >= 2


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5"])
def test_a_world_size_that_is_no_number_of_processes_is_named(value, tiny_llama, tmp_path, monkeypatch):
    """Before: ``WORLD_SIZE=abc`` ended in ``ValueError: invalid literal for int()`` (a traceback)."""
    from failure_checks import assert_clean_failure, cli

    monkeypatch.setenv("WORLD_SIZE", value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\n")
    code, output = cli("build", recipe, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [f"rank error: WORLD_SIZE is {value!r}, not a number of "
                                                          "processes", "unset it to build in one process"])


def test_other_commands_under_torchrun_run_once_on_rank_0(tiny_llama, tmp_path):
    """``plan``, ``lint`` and ``demo`` are not distributed: under torchrun rank 0 runs them alone (its builds, the
    demo's and plan's dry run, as one process) and the other ranks end at once. Before: every rank printed its own
    report, and `demo` on two ranks wrote one folder twice over."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\n")
    said = {}
    for name, args in {"plan": ["plan", str(recipe)], "lint": ["lint", str(recipe)], "demo": ["demo"]}.items():
        proc = _torchrun("-m", "moe_upcycle", *args, cwd=tmp_path)  # the demo writes ./demo_out
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
        said[name] = out + err
    assert said["plan"].count("moe-upcycle plan") == 1 and said["plan"].count("expert_0, expert_1") == 1
    assert said["lint"].count("Nothing to lint") == 1
    assert said["demo"].count("MoE reproduces the dense model") == 1 and "Traceback" not in said["demo"]
    assert sorted(p.name for p in (tmp_path / "demo_out").iterdir()) == ["dense", "moe", "moe_upcycle.json"]


def test_workers_repeat_the_global_options_and_start_after_the_usage_checks(tiny_llama, tmp_path, monkeypatch):
    """The workers run the command as it was given, `-v` included (before: `-q` and `--debug` only, so `-v build
    --workers 2` printed the short sharing line); a usage error is said before any worker starts."""
    import importlib

    from failure_checks import assert_clean_failure, cli

    app = importlib.import_module("moe_upcycle.cli.app")  # the module (the package's `app` is the Typer app)
    monkeypatch.setitem(app.VERBOSE, "on", True)
    monkeypatch.setitem(app.ARGS, "command", ["build", "r.yaml", "--workers", "2"])
    assert app.command_line()[:2] == ["-v", "build"]
    started = []
    monkeypatch.setattr("torch.distributed.run.run", lambda args: started.append(args))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\n")
    code, output = cli("build", recipe, tmp_path / "moe", "-o", tmp_path / "other", "--workers", "2")
    assert_clean_failure(code, output, tmp_path / "moe", ["give the output folder once"])
    assert started == []
