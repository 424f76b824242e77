"""Paths the user may not read, enter or change: a clear message naming the path and the user, exit 1, no
traceback, nothing written. Run with an ordinary user's permissions: as root (which ignores them) each command
runs in a forked child that drops to nobody after the same command has run once as root, so every module it
needs is already imported (the repository and Python may live in folders nobody cannot enter).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import pytest

from failure_checks import cli, leftovers
from moe_upcycle.inputs.paths import user_name
from routing_prompts import CODE, STORY

NOBODY = 65534
USER = "user nobody" if os.getuid() == 0 else user_name(os.geteuid())  # who runs the commands, as messages name them


def as_user(*args) -> tuple[int, str]:
    """`cli(*args)` with an ordinary user's permissions (nobody's, when the tests run as root)."""
    code, _, output = unprivileged(lambda: "{}\n{}".format(*_cli_and_exception(args))).partition("\n")
    return int(code), output


def _cli_and_exception(args) -> tuple[int, str]:
    """`cli`, with an exception the command let through (a traceback in a terminal) shown in the output."""
    from typer.testing import CliRunner

    from moe_upcycle.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    shown = "" if result.exception is None or isinstance(result.exception, SystemExit) else (
        f"\nTraceback: {type(result.exception).__name__}: {result.exception}")
    return result.exit_code, result.output + shown


def unprivileged(work) -> str:
    """`work()`'s text, computed with an ordinary user's permissions: directly, or as root in a forked child that
    drops to nobody first."""
    if os.getuid() != 0:
        try:
            return work()
        except Exception as exc:  # reported as the child reports it
            return f"{type(exc).__name__}: {exc}"
    import importlib
    import pkgutil

    import moe_upcycle

    for module in pkgutil.walk_packages(moe_upcycle.__path__, "moe_upcycle."):  # the clone may be root's alone
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        signal.alarm(120)  # a child that hangs ends, and the test fails, instead of the suite waiting forever
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                text = work()
            except Exception as exc:  # reported as the parent would see it raised
                text = f"{type(exc).__name__}: {exc}"
            os.write(write, text.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


# A forked child must not run torch's thread pools (they may deadlock after fork): every case here is refused, or
# read, before any model runs.


@pytest.fixture
def world(stories):
    """A folder anyone may enter, holding stories260K (pytest's own folders are root's, mode 700)."""
    folder = Path(tempfile.mkdtemp(prefix="moe-upcycle-perm-"))
    folder.chmod(0o777)
    shutil.copytree(stories, folder / "base")
    for path in [folder / "base", *(folder / "base").iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield folder
    for root, dirs, _ in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    shutil.rmtree(folder)


def recipe(folder: Path, base: Path, hidden: bool = False) -> Path:
    cfg = folder / "cfg.yaml"
    if hidden:
        cfg.write_text(f"base_model: {base}\ngate_mode: hidden\ndevice: cpu\nexperts:\n"
                       f"  - source_model: {base}\n    positive_prompts: {CODE[:2]!r}\n"
                       f"  - source_model: {base}\n    positive_prompts: {STORY[:2]!r}\n")
    else:
        cfg.write_text(f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n")
    cfg.chmod(0o644)
    return cfg


def user_said(output: str, words: list[str]) -> None:
    flat = " ".join(output.split())
    for word in words:
        assert word in flat, f"{word!r} not in:\n{output}"
    assert "Traceback" not in output, output


@pytest.mark.parametrize("command", ["build", "plan"])
def test_an_output_inside_a_folder_the_user_may_not_enter(command, world):
    """Python's Path.exists()/is_dir() raise for a path inside such a folder: before, a PermissionError traceback
    from the disk-space check, in build, plan -o and the API."""
    cfg = recipe(world, world / "base")
    closed = world / "closed"
    closed.mkdir(mode=0o666)
    closed.chmod(0o666)  # readable and writable, not searchable
    args = ["build", cfg, closed / "moe"] if command == "build" else ["plan", cfg, "-o", closed / "moe"]
    code, output = cli(*args[:1], cfg, "--dry-run") if command == "build" else cli("plan", cfg)  # imports, as root
    assert code == 0, output
    code, output = as_user(*args)
    assert code == 1, output
    if command == "plan":
        user_said(output, [f"{closed / 'moe'}: Permission denied for {USER}", f"ls -ld {closed / 'moe'} {closed}",
                           "or choose another path"])
    else:  # the disk-space check looks at the folder holding OUT; the lock file is the first write
        user_said(output, [f"cannot create the lock file {closed / '.moe.lock'} (Permission denied); the folder "
                           f"{closed} must be writable and searchable by you (ls -ld {closed})"])
    assert leftovers(world / "base") == ["base"] and sorted(p.name for p in world.iterdir()) == ["base", "cfg.yaml",
                                                                                                 "closed"]


def test_an_experts_config_the_user_may_not_read_is_named_with_its_field(world):
    """Before: a traceback from the prompt lint's plan (read from config.json alone); plan named it already."""
    expert = world / "expert"
    shutil.copytree(world / "base", expert)
    expert.chmod(0o755)
    cfg = recipe(world, world / "base", hidden=True)
    cfg.write_text(cfg.read_text().replace(f"source_model: {world / 'base'}", f"source_model: {expert}", 1))
    assert cli("build", cfg, world / "warm", "--no-lint")[0] == 0  # imports, as root
    shutil.rmtree(world / "warm")
    (expert / "config.json").chmod(0)
    code, output = as_user("build", cfg, world / "moe")
    assert code == 1, output
    user_said(output, [f"experts[0].source_model: cannot read {expert / 'config.json'} (Permission denied); "
                       f"check that the model folder and its files are readable by you"])
    assert not (world / "moe").exists() and stat.S_IMODE((expert / "config.json").stat().st_mode) == 0


def test_a_calibration_folder_the_user_may_not_list_is_named(world):
    """Path.rglob skipped it: a folder at mode 000 was said to hold no .txt, .md or .jsonl files."""
    from moe_upcycle.recipe.calibration import read_documents

    texts = world / "texts"
    (texts / "inner").mkdir(parents=True)
    (texts / "a.txt").write_text("Once upon a time.")
    (texts / "inner" / "b.txt").write_text("The cat sat.")
    texts.chmod(0o755)
    assert len(read_documents(texts)) == 2
    (texts / "inner").chmod(0)
    said = unprivileged(lambda: repr(read_documents(texts)))
    assert said == (f"ConfigError: calibration_text: cannot list the folder {texts / 'inner'} (Permission "
                    f"denied); check that it is readable by you"), said


@pytest.mark.parametrize("parent_mode", [0o777, 0o1777], ids=["writable", "sticky"])
def test_force_over_another_users_build_is_refused_before_any_work(parent_mode, world):
    """Before: in a writable folder, --force hid root's build as .moe.old-<pid>, which nobody could then delete
    (exit 0, a warning on every later build); in a sticky one (/tmp), it failed after the whole build with
    "Operation not permitted" and no reason."""
    if os.getuid() != 0:
        pytest.skip("another user's files are made as root (the suite's CI runs as root)")
    cfg = recipe(world, world / "base")
    shared = world / "shared"
    shared.mkdir()
    shared.chmod(parent_mode)
    assert cli("build", cfg, shared / "moe")[0] == 0  # root's build, root's folders (mode 755)
    before = sorted(p.name for p in shared.iterdir())
    code, output = as_user("build", cfg, shared / "moe", "--force")
    assert code == 1, output
    why = ("it belongs to user root, and " if parent_mode & stat.S_ISVTX else f"{shared / 'moe'} belongs to user root")
    user_said(output, [f"output folder {shared / 'moe'} is replaced by the finished build, but {why}",
                       "choose another output folder, or ask its owner to remove it"])
    assert "router" not in output and "Built" not in output  # refused before the work
    assert sorted(p.name for p in shared.iterdir()) == before
    assert (shared / "moe" / "moe_upcycle.json").is_file()


def test_a_previous_demo_the_user_cannot_remove_is_refused_whole(world):
    """Before: a traceback half way through removing it — dense/ gone, moe/ still there."""
    if os.getuid() != 0:
        pytest.skip("another user's files are made as root (the suite's CI runs as root)")
    assert cli("demo", world / "warm")[0] == 0  # imports, as root
    demo = world / "demo"
    assert cli("demo", demo)[0] == 0  # root's previous demo
    demo.chmod(0o777)  # the user may write into the demo folder itself, not into root's dense/ and moe/
    before = sorted(str(p.relative_to(demo)) for p in demo.rglob("*"))
    code, output = as_user("demo", demo)
    assert code == 1, output
    user_said(output, [f"demo folder {demo} is a previous demo's, but the demo cannot remove its dense/: "
                       f"{demo / 'dense'} belongs to user root and is not writable by you",
                       "delete it as its owner, or give a new folder"])
    assert sorted(str(p.relative_to(demo)) for p in demo.rglob("*")) == before


def test_an_output_that_is_a_mount_point_is_refused_before_any_work(world, monkeypatch):
    """A build is put in place by a rename from beside the target: over a mount point it was written whole on the
    parent's disk, then failed with "Device or resource busy" (and its free space was measured on the mount)."""
    import os.path

    cfg = recipe(world, world / "base")
    mount = world / "mnt"
    mount.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real(p))
    code, output = cli("build", cfg, mount)
    assert code == 1, output
    user_said(output, [f"output folder {mount} is a mount point", "write into a folder inside it, e.g. "
                       f"{mount / 'moe-model'}"])
    assert list(mount.iterdir()) == [] and sorted(p.name for p in world.iterdir()) == ["base", "cfg.yaml", "mnt"]


def test_a_previous_builds_file_the_user_cannot_read_is_not_called_changed(world):
    """--force checks that a previous build's files are its own, unchanged: one the user may not read cannot be
    checked, and is said so (before: "changed since the build")."""
    cfg = recipe(world, world / "base")
    out = world / "moe"
    assert cli("build", cfg, out)[0] == 0
    out.chmod(0o777)  # nobody may replace it...
    (out / "config.json").chmod(0)  # ...but not read this file
    code, output = as_user("build", cfg, out, "--force")
    assert code == 1, output
    user_said(output, ["config.json (unreadable: cannot be checked)"])
    assert "changed since the build" not in output
    assert (out / "moe_upcycle.json").is_file()


def test_a_prompt_file_the_user_cannot_read_gets_no_advice_on_its_format(world):
    """*_prompts_from, --prompts, --labeled: the file is fine, its permissions are not (before: "give a YAML/JSON
    list of prompts, JSONL/CSV records or a text file")."""
    from moe_upcycle.recipe.prompt_sets import read_prompt_file

    prompts = world / "code.txt"
    prompts.write_text("def f(x):\n    return x\n")
    assert read_prompt_file(prompts) == ["def f(x):", "return x"]
    prompts.chmod(0)
    said = unprivileged(lambda: repr(read_prompt_file(prompts)))
    assert said == (f"ConfigError: prompt file {prompts}: cannot read it (Permission denied); make it readable "
                    f"by you, or give a copy you may read"), said


def test_verify_says_a_weight_file_it_cannot_read_once(world):
    """Before: the file, then all its tensors "missing from the output", then transformers' "FileNotFoundError: No
    such file or directory" for a file that is there."""
    cfg = recipe(world, world / "base")
    out = world / "moe"
    assert cli("build", cfg, out)[0] == 0
    # the text and prompts in the world's folder: the package's own may sit where nobody cannot read (CI's clone)
    (world / "text.txt").write_text("Once upon a time there was a cat. It sat in the sun all day long.\n")
    (world / "prompts.txt").write_text("Once upon a time\nThe dog ran\n")
    for name in ("text.txt", "prompts.txt"):
        (world / name).chmod(0o644)
    options = ["--device", "cpu", "--text", world / "text.txt", "--prompts", world / "prompts.txt"]
    assert cli("verify", out, *options)[0] == 0  # imports, as root
    shard = next(out.glob("model-*.safetensors"))
    shard.chmod(0)
    code, output = as_user("verify", out, *options)
    assert code == 1, output
    user_said(output, [f"{shard}: cannot read it (Permission denied)", f"{shard.name}: cannot read it "
                       "(Permission denied); its sha256 was not checked",
                       "not loaded with transformers: a weight file cannot be read (see above)"])
    assert "missing" not in output and "FileNotFoundError" not in output


@pytest.mark.parametrize("closed", ["cache", "refs/main"])
def test_a_hub_cache_the_user_cannot_read_is_not_called_missing(closed, world, monkeypatch):
    """Before: "model 'acme/tiny' not found ... download the hub model first" (or "only at other revisions")."""
    from huggingface_hub import constants

    cache = world / "hub"
    entry = cache / "models--acme--tiny"
    (entry / "snapshots" / "abc123").mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("abc123")
    for item in (world / "base").iterdir():
        shutil.copy(item, entry / "snapshots" / "abc123" / item.name)
    for root, dirs, files in os.walk(cache):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    cfg = world / "hub.yaml"
    cfg.write_text("base_model: acme/tiny\nnum_experts: 2\ngate_mode: random\n")
    cfg.chmod(0o644)
    code, output = cli("plan", cfg)  # imports, as root: the cache works
    assert code == 0, output
    path = cache if closed == "cache" else entry / "refs" / "main"
    path.chmod(0)
    code, output = as_user("plan", cfg)
    assert code == 1, output
    user_said(output, [f"base_model: model 'acme/tiny': the Hugging Face cache's {path} cannot be read by you "
                       f"(permission denied)", "point HF_HUB_CACHE at a cache you may read"])
    assert "not found" not in output


@pytest.mark.parametrize("command", ["plan", "build"])
def test_an_output_folder_the_user_may_not_write_into_is_said_by_plan_too(command, world):
    """Before: plan said the output "fits" (disk space only), and build said it only at its lock file."""
    cfg = recipe(world, world / "base")
    closed = world / "readonly"
    closed.mkdir()
    closed.chmod(0o555)
    assert cli("plan", cfg)[0] == 0  # imports, as root
    args = ["plan", cfg, "-o", closed / "moe"] if command == "plan" else ["build", cfg, closed / "moe"]
    code, output = as_user(*args)
    assert code == 1, output
    said = (f"the output's folder {closed} is not writable by you" if command == "plan" else  # build: its lock
            f"the folder {closed} must be writable and searchable by you")
    user_said(output, [said, "choose another output folder"])
    assert list(closed.iterdir()) == []


def test_a_deleted_current_folder_is_said_before_torch_loads(tmp_path):
    """Before: torch's "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so", exit 2."""
    import shlex
    import subprocess

    from failure_checks import module_cmd, module_env

    command = " ".join(shlex.quote(str(a)) for a in module_cmd("plan", "x.yaml"))
    run = subprocess.run(["sh", "-c", f"mkdir gone && cd gone && rmdir ../gone && {command}"], cwd=tmp_path,
                         env=module_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert run.stderr.endswith("error: the current folder no longer exists (it was deleted or moved); cd to a folder "
                               "that exists and run the command again\n"), run.stderr


@pytest.mark.parametrize("args", [
    ["plan", "{cfg}"], ["build", "{cfg}", "{world}/out"], ["lint", "{cfg}"],
    ["prompts", "grow", "{cfg}", "--pool", "{world}/pool.txt"],
    ["route", "{world}/base", "--prompts", "{world}/closed.txt"], ["verify", "{world}/base", "--text", "{world}/closed.txt"],
])
def test_a_file_given_on_the_command_line_the_user_cannot_read_is_ours_to_say(args, world):
    """typer checks every Path argument's readability itself (its default) and printed a usage box, exit 2
    ("Invalid value for 'CONFIG': path 'r.yaml' is not readable."), no user named, nothing to check. The command
    now reads the file itself: the recipe's refusal names the user and the `ls -ld` to run; the others get on to
    their own checks and words, exit 1."""
    cfg = recipe(world, world / "base")
    closed = world / "closed.txt"
    closed.write_text("hello\n")
    (world / "pool.txt").write_text("a candidate prompt\n")
    (world / "pool.txt").chmod(0o644)
    for path in (cfg, closed):
        path.chmod(0)
    code, output = as_user(*[a.format(cfg=cfg, world=world) for a in args])
    assert code == 1, output
    assert "Invalid value" not in output and "Usage:" not in output and "not readable" not in output, output
    if args[0] in ("plan", "build", "lint", "prompts"):
        user_said(output, [f"{cfg}: Permission denied for {USER}", f"(ls -ld {cfg} {world})"])
    elif args[0] == "route":
        user_said(output, [f"prompt file {closed}: cannot read it (Permission denied)"])
    else:  # verify refuses the dense folder before it reads the text: the text's permissions did not stop it first
        user_said(output, ["is a dense model", "nothing to verify"])
    assert not (world / "out").exists()
