"""Signals (SIGINT, SIGTERM, SIGHUP) to a real ``python -m moe_upcycle build`` process midway through writing a multi-shard
model: the target is absent afterwards (or keeps its previous contents with --force), temporary
files are gone, and a second build succeeds."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from failure_checks import (REPO, cli, default_signals, leftovers, module_cmd, module_env, previous_build,
                            signal_defaults, write_big_llama)

SHARD = "4MB"  # 104 MB of output in 33 shards
N_SHARDS = 33


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    return write_big_llama(tmp_path_factory.mktemp("big") / "llama")


@pytest.fixture
def big_config(big_model, tmp_path) -> Path:
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(f"base_model: {big_model}\nnum_experts: 8\ngate_mode: random\nmax_shard_size: {SHARD}\n")
    return cfg


@pytest.fixture(autouse=True)
def _signals_as_in_a_fresh_shell():
    """Every test here sends signals (to a child, or to this process through the CLI run in it): each starts from the
    dispositions a fresh shell gives, whatever this test run inherited (``nohup`` ignores SIGHUP, a background job
    SIGINT, some CI runners more); children get them from `default_signals`."""
    with signal_defaults():
        yield


def _start_build(cfg: Path, target: Path, *extra: str) -> subprocess.Popen:
    # Python only turns SIGINT into KeyboardInterrupt when it is not ignored at start-up
    return subprocess.Popen(module_cmd("build", cfg, target, *extra), cwd=REPO, env=module_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)


def _wait_for_shards(proc: subprocess.Popen, target: Path, timeout: float = 180) -> list[str]:
    """Poll until the staging folder holds a shard file; return the shard names then present."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for stage in target.parent.glob(f".{target.name}.partial-*"):
            shards = sorted(p.name for p in stage.glob("model-*.safetensors"))
            if shards:
                return shards
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"build ended (rc {proc.returncode}) before any shard appeared:\n{out}\n{err}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail("no shard appeared in the staging folder")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("sig,force", [(signal.SIGINT, False), (signal.SIGTERM, True), (signal.SIGTERM, False),
                                       (signal.SIGHUP, False), (signal.SIGHUP, True), (signal.SIGQUIT, False)],
                         ids=["SIGINT", "SIGTERM-force", "SIGTERM", "SIGHUP", "SIGHUP-force", "SIGQUIT"])
def test_signal_midway_leaves_nothing_and_rebuild_succeeds(sig, force, big_config, tmp_path):
    target = tmp_path / "moe"
    previous = None
    if force:  # a previous build's folder: --force must keep it intact until the new one is complete
        previous_build(target, {"config.json": '{"previous": true}', "model.safetensors": "old weights"})
        previous = _snapshot(target)
    proc = _start_build(big_config, target, *(["--force"] if force else []))
    shards = _wait_for_shards(proc, target)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, f"rc {proc.returncode}\n{out}\n{err}"  # 130, 143, 129 as shells report
    assert f"interrupted ({signal.Signals(sig).name})" in err and "Traceback" not in out + err
    assert not any(line.startswith("write: done") for line in err.splitlines())  # a stopped stage is not "done"
    assert len(shards) < N_SHARDS  # it really was stopped mid-write
    if force:
        assert _snapshot(target) == previous
        assert leftovers(target) == ["moe"]
        assert f"nothing was written under the output name; the previous {target} is untouched" in err, err
    else:
        assert "previous" not in err
        assert leftovers(target) == []  # no target, no lock, no staging folder

    code, output = cli("build", big_config, target, *(["--force"] if force else []))
    assert code == 0, output
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == N_SHARDS and sorted(p.name for p in target.glob("*.safetensors")) == \
        sorted(set(index["weight_map"].values()))
    assert leftovers(target) == ["moe"]


def test_killed_build_leftovers_are_cleared_by_next_build(big_config, tmp_path):
    """SIGKILL cannot be caught: the staging folder stays (never under the target name), and the
    lock file stays but is not held; the next build takes the lock, clears them and succeeds."""
    target = tmp_path / "moe"
    proc = _start_build(big_config, target)
    _wait_for_shards(proc, target)
    proc.kill()
    proc.communicate(timeout=60)
    left = leftovers(target)
    assert "moe" not in left and ".moe.lock" in left and any(n.startswith(".moe.partial-") for n in left)

    code, output = cli("build", big_config, target)
    assert code == 0, output
    assert leftovers(target) == ["moe"]


def test_concurrent_build_to_same_target_is_refused(big_config, tmp_path):
    """While one real build process writes, a second build to the same target is refused by the lock
    (it writes nothing); the first finishes intact."""
    target = tmp_path / "moe"
    first = _start_build(big_config, target)
    _wait_for_shards(first, target)
    # Freeze the first build while it holds the lock, so the second attempt meets it however fast
    # or slow this machine is; it resumes afterwards and must finish intact.
    os.kill(first.pid, signal.SIGSTOP)
    try:
        assert first.poll() is None, "the first build ended before it could be paused"
        code, output = cli("build", big_config, target)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert code == 1 and "Traceback" not in output
    assert f"another build (pid {first.pid}) is writing {target}" in " ".join(output.split())
    out, err = first.communicate(timeout=180)
    assert first.returncode == 0, out + err
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == N_SHARDS
    recipe = json.loads((target / "moe_upcycle.json").read_text())
    for shard in set(index["weight_map"].values()):  # every shard is exactly what the first build wrote
        assert hashlib.sha256((target / shard).read_bytes()).hexdigest() == recipe["sha256"][shard]
    assert leftovers(target) == ["moe"]


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (Python has none by default: ours is installed)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc to see when start-up begins")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("delay", [0.0, 0.03, 0.1, 0.3])
def test_signal_during_startup_exits_quietly(sig, delay, big_config, tmp_path):
    """A signal once the command has started — while it is still importing typer, torch and
    transformers, or just after — exits with 128 + signal, no traceback, nothing written."""
    target = tmp_path / "moe"
    proc = _start_build(big_config, target)
    deadline = time.monotonic() + 60
    while not _catches_sigterm(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, f"rc {proc.returncode}\n{out}\n{err}"
    assert "Traceback" not in out + err, err
    assert leftovers(target) == []


def test_sighup_ignored_by_parent_stays_ignored(big_config, tmp_path):
    """Under ``nohup`` (SIGHUP ignored by the parent) a dropped terminal does not stop the build."""
    def nohup() -> None:
        default_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    target = tmp_path / "moe"
    proc = subprocess.Popen(module_cmd("build", big_config, target), cwd=REPO, env=module_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=nohup)
    _wait_for_shards(proc, target)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{out}\n{err}"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == N_SHARDS and leftovers(target) == ["moe"]


@pytest.mark.parametrize("command, said", [("build", "interrupted (SIGINT): nothing was written under the output name"),
                                           ("route", "interrupted (SIGINT)")])
def test_the_interrupt_line_speaks_of_an_output_only_for_commands_that_write_one(command, said, capsys):
    """Ctrl-C in `route` / `verify` / `plan` / `lint` (which write no output folder) says only that it was
    interrupted; before, every command said "nothing was written under the output name"."""
    import typer

    from moe_upcycle.cli.app import cli_errors

    def body():
        raise KeyboardInterrupt

    body.__name__ = command
    with pytest.raises(typer.Exit) as info:
        cli_errors(body)()
    assert info.value.exit_code == 130
    assert " ".join(capsys.readouterr().err.split()) == said


@pytest.mark.parametrize("force", [False, True])
def test_a_signal_while_publishing_is_said_to_come_after_the_output_is_in_place(force, stories, tmp_path,
                                                                                monkeypatch):
    """A signal that arrives during the final rename(s) is held off until they are done, then raised: the output
    is complete and in place, and the message says so (before: "nothing was written under the output name",
    while the new model, with --force replacing the previous one, was there)."""
    from moe_upcycle.checkpoint import output_dir

    config = tmp_path / "r.yaml"
    config.write_text(f"base_model: {stories}\nnum_experts: 2\ngate_mode: random\n")
    target = tmp_path / "moe"
    if force:
        assert cli("build", config, target)[0] == 0
    rename = os.rename

    def rename_then_signal(src, dst):  # the signal lands exactly at the publishing rename
        rename(src, dst)
        if Path(dst) == target:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(output_dir.os, "rename", rename_then_signal)
    code, output = cli("build", config, target, *(["--force"] if force else []))
    assert code == 143, output
    said = " ".join(output.split())
    assert f"interrupted (SIGTERM) after {target} was complete and in place" in said and "nothing was" not in said
    assert json.loads((target / "config.json").read_text())["num_local_experts"] == 2
    assert leftovers(target) == ["moe"]


KILL_AT_IMPORT = """
import os, signal, sys
class _Hook:  # sends the signal to this process the moment module KILL_AT starts importing
    fired = False
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["KILL_AT"] and not _Hook.fired:
            _Hook.fired = True
            os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIG"]))
        return None
sys.meta_path.insert(0, _Hook())
"""


@pytest.mark.parametrize("at", ["numpy.exceptions", "numpy._core.multiarray"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_torch_imports_stops_the_command(at, sig, stories, tmp_path):
    """torch's C-level import of numpy caught the exception a signal became inside a command: a traceback
    ("cannot load module more than once"), or the signal was lost and the build ran to the end with exit 0."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AT_IMPORT)
    config = tmp_path / "r.yaml"
    config.write_text(f"base_model: {stories}\nnum_experts: 2\ngate_mode: random\n")
    env = {**module_env(), "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "KILL_AT": at, "KILL_SIG": sig}
    run = subprocess.run(module_cmd("build", config, tmp_path / "moe"), env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, check=False, preexec_fn=default_signals)
    assert run.returncode == 128 + getattr(signal, sig), run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "Built" not in run.stdout, run.stderr
    assert leftovers(tmp_path / "moe") == []
