"""Failing writes (disk full, write errors), unsafe output folders and held locks: a clear error,
bytes needed vs available where it is about space, and nothing under the target name."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import moe_upcycle.build
import moe_upcycle.checkpoint.disk_space
import moe_upcycle.checkpoint.shard_file
from failure_checks import REPO, assert_clean_failure, cli, leftovers, module_cmd, module_env, previous_build
from moe_upcycle import upcycle

GOOD = "base_model: {base}\nnum_experts: 2\ngate_mode: random\n"


@pytest.fixture
def config(tiny_llama, tmp_path) -> Path:
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(GOOD.replace("{base}", str(tiny_llama)))
    return cfg


@pytest.fixture(scope="module")
def output_bytes(tiny_llama) -> int:
    """Tensor bytes of the 2-expert build of the tiny Llama."""
    return upcycle({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"}, dry_run=True).plan.total_bytes


def _disk_fills_after(monkeypatch, room: int) -> None:
    """Shard writes accept `room` bytes in all, then fail like a full disk."""
    budget = [room]
    write_all = moe_upcycle.checkpoint.shard_file._write_all

    def filling(fd, view):
        if len(view) > budget[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget[0] -= len(view)
        write_all(fd, view)

    monkeypatch.setattr(moe_upcycle.checkpoint.shard_file, "_write_all", filling)


@pytest.mark.parametrize("force", [False, True], ids=["new", "force-over-previous"])
def test_disk_full_mid_write(force, config, output_bytes, tmp_path, monkeypatch):
    target = tmp_path / "moe"
    if force:
        previous_build(target, {"keep.txt": "previous build"})
    _disk_fills_after(monkeypatch, room=output_bytes // 2)
    code, output = cli("build", config, target, "--max-shard-size", "60KB", *(["--force"] if force else []))
    flat = " ".join(output.split())
    m = re.search(r"output error: writing (\S+) failed: No space left on device \(the output needs (\d+) bytes in "
                  r"all; (\d+) were written, (\d+) bytes available\)", flat)
    assert m, output
    assert Path(m.group(1)).parent.name.startswith(".moe.partial-")  # it failed in the staging folder
    assert int(m.group(2)) == output_bytes and 0 < int(m.group(3)) <= output_bytes // 2
    if force:
        assert code == 1 and "Traceback" not in output
        assert sorted(p.name for p in target.iterdir()) == ["keep.txt", "moe_upcycle.json"]
        assert leftovers(target) == ["moe"]
    else:
        assert_clean_failure(code, output, target, ["No space left on device"])


def test_not_enough_space_refused_before_writing(config, output_bytes, tmp_path, monkeypatch):
    monkeypatch.setattr(moe_upcycle.checkpoint.disk_space, "free_bytes", lambda folder: 1234)
    target = tmp_path / "moe"
    code, output = cli("build", config, target)
    assert_clean_failure(code, output, target, [f"not enough disk space for the output in {tmp_path}",
                                                "1234 bytes (1.2 KB) available"])
    needed = int(re.search(r"needs (\d+) bytes", " ".join(output.split())).group(1))
    assert needed >= output_bytes  # tensors plus config, tokenizer and card


def test_error_writing_other_files_is_reported(config, tmp_path, monkeypatch):
    """An OSError outside the shard writer (here: the model card) is an OutputError too."""
    def fail(folder, *args):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "README.md"))

    monkeypatch.setattr(moe_upcycle.build, "write_model_card", fail)
    target = tmp_path / "moe"
    code, output = cli("build", config, target)
    assert_clean_failure(code, output, target, ["README.md: No space left on device", f"nothing was written under {target}",
                                                "bytes available in"])


def _in_tmpfs(size: int, script: str) -> subprocess.CompletedProcess:
    """Run `script` (sh) with $FS a fresh tmpfs of `size` bytes, in a private mount namespace."""
    if not shutil.which("unshare"):
        pytest.skip("unshare not available: the fake-file tests above cover disk-full")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces not available here: {probe.stderr.decode().strip()}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", f'FS=$(mktemp -d) && mount -t tmpfs -o size={size} tmpfs "$FS" '
                           f'&& cd "$FS" && {script}'], cwd=REPO, env=module_env(), capture_output=True, text=True,
                          timeout=300)


def test_real_tiny_filesystem(config, output_bytes):
    """A real tmpfs too small for the output: refused up front, nothing left on it. (A mid-write
    ENOSPC cannot happen on a quiet filesystem because the up-front check over-counts; the failing
    file-object tests above cover it.)"""
    build = " ".join(f"'{a}'" for a in module_cmd("build", config, "moe", "--max-shard-size", "100KB"))
    small = _in_tmpfs(64 * 1024, f'{build}; echo "rc=$?"; echo "files:$(ls -A)"')
    assert "rc=1" in small.stdout, small.stdout + small.stderr
    flat = " ".join(small.stderr.split())
    assert "not enough disk space for the output" in flat
    needed = int(re.search(r"needs (\d+) bytes", flat).group(1))
    assert needed >= output_bytes
    assert re.search(r"\b\d{5} bytes \([\d.]+ KB\) available", flat), flat
    assert "files:\n" in small.stdout and "Traceback" not in small.stderr  # nothing on the filesystem


# ---------------------------------------------------------------------------------------------
# Output folder overlapping a source


@pytest.mark.parametrize("where", ["equal", "inside", "parent"])
@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_output_overlapping_source_refused(where, force, tiny_llama, tmp_path):
    model = tmp_path / "models" / "base"
    shutil.copytree(tiny_llama, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    target = {"equal": model, "inside": model / "moe", "parent": tmp_path / "models"}[where]
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(GOOD.replace("{base}", str(model)))
    code, output = cli("build", cfg, target, *(["--force"] if force else []))
    assert code == 1 and "Traceback" not in output
    assert f"output {target} overlaps the source model folder {model}" in " ".join(output.split())
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before  # source untouched, nothing added
    assert not any(p.name.startswith((".moe", ".base", ".models")) for p in (tmp_path, tmp_path / "models", model)
                   for p in p.iterdir())


def test_output_through_symlink_to_source_refused(tiny_llama, tmp_path):
    model = tmp_path / "base"
    shutil.copytree(tiny_llama, model)
    (tmp_path / "link").symlink_to(model)
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(GOOD.replace("{base}", str(model)))
    code, output = cli("build", cfg, tmp_path / "link" / "moe")
    assert code == 1 and "overlaps the source model folder" in output and not (model / "moe").exists()


# ---------------------------------------------------------------------------------------------
# Locks


def test_second_build_refused_while_lock_held(config, tmp_path):
    target = tmp_path / "moe"
    lock = tmp_path / ".moe.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    os.write(fd, b"4242")
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a running build holds
    try:
        code, output = cli("build", config, target)
        assert code == 1 and "Traceback" not in output
        assert f"another build (pid 4242) is writing {target} (it holds {lock})" in " ".join(output.split())
        assert not target.exists() and lock.read_text() == "4242"  # the holder's lock is left alone
        assert not list(tmp_path.glob(".moe.partial-*"))
    finally:
        os.close(fd)
    code, output = cli("build", config, target)  # the lock file is still there but no longer held
    assert code == 0, output
    assert leftovers(target) == ["moe"]
    assert json.loads((target / "config.json").read_text())["num_local_experts"] == 2


def test_output_is_a_file_refused(config, tmp_path):
    target = tmp_path / "moe"
    target.write_text("not a folder")
    code, output = cli("build", config, target, "--force")
    assert code == 1 and f"output {target} exists and is a file" in " ".join(output.split())
    assert target.read_text() == "not a folder" and leftovers(target) == ["moe"]


def test_existing_output_refused_without_force(config, tmp_path):
    target = tmp_path / "moe"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    code, output = cli("build", config, target)
    assert code == 1 and "already exists and is not empty" in output and "--force" in output
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and leftovers(target) == ["moe"]


def test_signal_during_force_swap_is_held_until_swap_done(tmp_path, monkeypatch, request):
    """A Ctrl-C that lands during the final --force swap is delivered only after it: the target is
    then wholly the new build, and no swap folder is left."""
    import signal

    import moe_upcycle.checkpoint.output_dir as output_dir

    target = tmp_path / "moe"
    previous_build(target, {"old.txt": "old"})
    real_rename = os.rename
    # a test runner started in the background has SIGINT ignored (as the shell leaves it): Ctrl-C's usual handler
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, before))

    def rename_with_interrupt(src, dst):
        os.kill(os.getpid(), signal.SIGINT)  # arrives between the two renames
        return real_rename(src, dst)

    with pytest.raises(KeyboardInterrupt):
        with output_dir.staged_output(target, force=True) as stage:
            (stage / "new.txt").write_text("new")
            monkeypatch.setattr(output_dir.os, "rename", rename_with_interrupt)
    monkeypatch.setattr(output_dir.os, "rename", real_rename)
    assert [p.name for p in target.iterdir()] == ["new.txt"] and leftovers(target) == ["moe"]


def test_leftover_swap_folder_is_restored(tmp_path):
    """A build SIGKILLed between the two renames of a --force swap leaves the previous output as
    .<name>.old-<pid> and no target: the next build on that target puts it back first."""
    from moe_upcycle.checkpoint.output_dir import staged_output

    target = tmp_path / "moe"
    old = tmp_path / ".moe.old-99999"
    old.mkdir()
    (old / "weights.txt").write_text("previous")
    (old / "moe_upcycle.json").write_text('{"tool": "moe-upcycle"}')  # a build: what --force swaps out
    with pytest.raises(RuntimeError):
        with staged_output(target):
            assert sorted(p.name for p in target.iterdir()) == ["moe_upcycle.json", "weights.txt"]  # restored first
            raise RuntimeError("build failed")
    assert (target / "weights.txt").read_text() == "previous" and leftovers(target) == ["moe"]


@pytest.mark.parametrize("target_there", [False, True], ids=["no-target", "target-there"])
def test_a_users_folders_named_like_leftovers_are_never_touched(target_there, stories, tmp_path):
    """Only a killed build's own leftovers are cleared: ``.<name>.partial-<pid>`` and ``.<name>.old-<pid>`` holding
    a build (or nothing). Before, any ``.moe.old-*`` / ``.moe.partial-*`` was deleted, even by a build then
    refused, or moved into the target's place."""
    mine = {".moe.old-backup": "backup", ".moe.partial-jan": "notes", ".moe.old-123": "not a build",
            ".moe.partial-7.bak": "copy"}
    for name, text in mine.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.txt").write_text(text)
    if target_there:
        (tmp_path / "moe").mkdir()
        (tmp_path / "moe" / "a.txt").write_text("user file")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\nnum_experts: 2\ngate_mode: random\n")
    code, output = cli("build", cfg, tmp_path / "moe")
    if target_there:
        assert code == 1 and "already exists and is not empty" in output
        assert (tmp_path / "moe" / "a.txt").read_text() == "user file"
    else:
        assert code == 0, output
        assert (tmp_path / "moe" / "moe_upcycle.json").is_file()
    for name, text in mine.items():
        assert (tmp_path / name / "data.txt").read_text() == text, name


def _unprivileged(work) -> None:
    """Run `work()` with an ordinary user's permissions: directly, or as root in a forked child that drops to
    nobody first (root ignores read-only folders; the users this is for do not). Only file operations run."""
    if os.getuid() != 0:
        work()
        return
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            work()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@pytest.mark.parametrize("shape", ["read_only_folder", "read_only_files"])
def test_force_over_a_read_only_previous_build_leaves_no_swap_folder(shape, tmp_path):
    """--force over a previous build the user made read-only (chmod -R a-w): the swap replaces it, and the
    previous build's files are deleted as rm -rf would (write permission given back first): no hidden
    .<name>.old-<pid> folder is left behind (before: left silently, holding the whole old checkpoint)."""
    import stat

    import tempfile

    from moe_upcycle.checkpoint.output_dir import staged_output

    if os.getuid() == 0:  # a folder nobody can reach (pytest's own are root's, mode 700)
        tmp_path = Path(tempfile.mkdtemp(prefix="moe-upcycle-test-"))
    target = tmp_path / "moe"
    previous_build(target, {"model.safetensors": "old weights", "config.json": "{}"})
    for path in [*target.iterdir()]:
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    if shape == "read_only_folder":
        target.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)
    if os.getuid() == 0:
        for path in [tmp_path, target, *target.iterdir()]:
            os.chown(path, 65534, 65534)

    def swap() -> None:
        with staged_output(target, force=True) as stage:
            (stage / "model.safetensors").write_text("new weights")

    try:
        _unprivileged(swap)
        assert (target / "model.safetensors").read_text() == "new weights"
        assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
        assert leftovers(target) == ["moe"], leftovers(target)
    finally:
        if os.getuid() == 0:
            shutil.rmtree(tmp_path)


def test_a_folder_of_ours_that_cannot_be_deleted_is_named(tmp_path, monkeypatch):
    """When even that fails (a file system gone read-only), the folder is named in a warning, not kept quietly."""
    import moe_upcycle.checkpoint.ownership as ownership
    from moe_upcycle import UpcycleWarning

    folder = tmp_path / ".moe.old-4242"
    folder.mkdir()
    (folder / "model.safetensors").write_text("x")
    monkeypatch.setattr(ownership.shutil, "rmtree", lambda *a, **k: None)
    with pytest.warns(UpcycleWarning, match=r"\.moe\.old-4242: could not delete this folder, which moe-upcycle "
                                            r"wrote .*; delete it yourself"):
        ownership.remove_ours(folder)


@pytest.mark.parametrize("when", ["refused_target", "gate_failure", "write_failure", "ctrl_c_while_writing"])
def test_a_failed_build_removes_the_parent_folders_it_made(when, tiny_llama, tmp_path, monkeypatch):
    """`out/run-7/moe` with neither folder there: the build makes them (mkdir -p), and a build that then fails —
    refused, an error, Ctrl-C — removes them again (no output at all), leaving folders that existed alone.
    A folder someone put a file into meanwhile is not removed."""
    import moe_upcycle.build as build
    import moe_upcycle.checkpoint.output_dir as output_dir

    keep = tmp_path / "keep"
    keep.mkdir()
    target = keep / "out" / "run-7" / "moe"
    cfg = {"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"}
    if when == "refused_target":  # e.g. another build holds the lock: found after the parents are made
        monkeypatch.setattr(build, "check_target", lambda *a, **k: (_ for _ in ()).throw(
            output_dir.OutputError("another build is writing there")))
    elif when == "gate_failure":
        monkeypatch.setattr(build, "compute_gate_rows", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("gates")))
    errors = {"refused_target": output_dir.OutputError, "gate_failure": RuntimeError,
              "write_failure": RuntimeError, "ctrl_c_while_writing": KeyboardInterrupt}
    step = {"write_failure": RuntimeError("disk on fire"), "ctrl_c_while_writing": KeyboardInterrupt()}.get(when)

    def on_step(s, p):
        if step is not None:
            raise step
    with pytest.raises(errors[when]):
        upcycle(cfg, target, on_step=on_step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"] and list(keep.iterdir()) == []
    # a parent that holds something else by then stays, with what it holds
    (keep / "out").mkdir()
    (keep / "out" / "notes.txt").write_text("mine")
    with pytest.raises(errors[when]):
        upcycle(cfg, target, on_step=on_step)
    assert [p.name for p in (keep / "out").iterdir()] == ["notes.txt"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full is Linux's always-full device")
@pytest.mark.parametrize("command", ["build", "plan --json", "verify"])
def test_results_on_a_full_disk_are_one_message(command, config, tmp_path):
    """Standard output on a full disk (`> /dev/full`) is a one-line error on stderr and exit 1, never a traceback;
    a build whose summary line cannot be printed is still complete (its folder loads)."""
    import json

    out = tmp_path / "out"
    if command == "verify":
        assert subprocess.run(module_cmd("build", config, out), env=module_env(), capture_output=True).returncode == 0
        args = ["verify", str(out)]
    else:
        args = [*command.split(), str(config), *([str(out)] if command == "build" else [])]
    with open("/dev/full", "w") as full:
        done = subprocess.run(module_cmd(*args), env=module_env(), stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    said = " ".join(done.stderr.split())
    built = f" ({out} was built and is complete)" if command == "build" else ""  # only the report is lost
    assert (f"error: writing the results to standard output failed (No space left on device){built}; send them to "
            f"a file on a disk with room, or to a terminal") in said, done.stderr
    if command != "plan --json":
        assert json.loads((out / "config.json").read_text())["num_local_experts"] == 2
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging leftovers


@pytest.mark.parametrize("mode", [0o2770, 0o700, 0o555])
def test_an_empty_output_folder_the_user_made_keeps_its_permissions(mode, stories, tmp_path):
    """A folder made for the model (group-shared with setgid, private, read-only): the build is renamed into its
    place, and before it came with the umask's mode instead."""
    target = tmp_path / "moe"
    target.mkdir()
    target.chmod(mode)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\nnum_experts: 2\ngate_mode: random\n")
    code, output = cli("build", cfg, target)
    assert code == 0, output
    assert oct(target.stat().st_mode & 0o7777) == oct(mode)
    assert (target / "moe_upcycle.json").is_file() and leftovers(target) == ["moe"]


def test_a_file_system_out_of_inodes_is_said_so(config):
    """"No space left on device" with megabytes free: the file system can hold no more files (before: only the
    bytes available, which looked like room). Everything written is removed."""
    build = " ".join(f"'{a}'" for a in module_cmd("build", config, "moe", "--max-shard-size", "100KB"))
    run = _in_tmpfs(50 * 1024 * 1024, f'mount -o remount,nr_inodes=12 "$FS" && {build}; echo "rc=$?"; '
                                      f'echo "files:$(ls -A)"')
    assert "rc=1" in run.stdout, run.stdout + run.stderr
    flat = " ".join(run.stderr.split())
    assert "No space left on device" in flat and "no free inodes: the file system can hold no more files" in flat, flat
    assert "files:\n" in run.stdout and "Traceback" not in run.stderr  # nothing left on the file system
