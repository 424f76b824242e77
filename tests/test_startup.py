"""The command line's start-up: what a random-gate build imports, and the cyclic collector around the imports.

A real ``python -m moe_upcycle build`` runs in a subprocess with a recorder around it (``gc.callbacks`` and the
process's last step, `terminal.exit.finish`), so nothing in the package is imported before its own start-up.
"""

from __future__ import annotations

import gc
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from failure_checks import REPO, module_env
from moe_upcycle.terminal import import_gc

# runs `python -m moe_upcycle ARGS`, then writes what it recorded to RECORD (the first argument)
RECORDER = r"""
import gc, json, runpy, sys
record_path, args = sys.argv[1], sys.argv[2:]
collections = []  # (generation, frozen objects at that moment, torch loaded)
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(
    (info["generation"], gc.get_freeze_count(), "torch" in sys.modules)))
import moe_upcycle.terminal.exit as exit_module
finish = exit_module.finish

def recorded_finish(code):
    with open(record_path, "w") as fh:
        json.dump({"modules": sorted(sys.modules), "collections": collections, "gc_enabled": gc.isenabled(),
                   "frozen": gc.get_freeze_count()}, fh)
    finish(code)

exit_module.finish = recorded_finish
sys.argv = ["moe-upcycle", *args]
runpy.run_module("moe_upcycle", run_name="__main__", alter_sys=True)
"""

# libraries a build with random routers never needs (each costs 0.1-2 s to import)
NOT_FOR_RANDOM_GATES = ("transformers", "sentence_transformers", "matplotlib", "sklearn", "scipy",
                        "moe_upcycle.prompts.lint", "moe_upcycle.prompts.embed", "moe_upcycle.check.verify",
                        "moe_upcycle.gates.capture", "moe_upcycle.gates.batches")


def _recorded(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    record = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, "-c", RECORDER, str(record), *args], cwd=REPO, env=module_env(),
                          capture_output=True, text=True, timeout=300)
    return proc, json.loads(record.read_text())


@pytest.fixture(scope="module")
def random_gate_build(tiny_llama, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    folder = tmp_path_factory.mktemp("startup")
    cfg = folder / "experts.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\nnum_experts: 4\ngate_mode: random\n")
    proc, record = _recorded(folder, "build", str(cfg), str(folder / "moe"))
    return proc, record, folder / "moe"


def test_random_gate_build_imports_no_model_library(random_gate_build):
    proc, record, out = random_gate_build
    assert proc.returncode == 0, proc.stdout + proc.stderr
    digests = json.loads((out / "moe_upcycle.json").read_text())["sha256"]
    shard = out / "model-00001-of-00001.safetensors"
    assert hashlib.sha256(shard.read_bytes()).hexdigest() == digests[shard.name]
    modules = set(record["modules"])
    assert {"torch", "moe_upcycle.build", "moe_upcycle.checkpoint.writer"} <= modules  # the recorder saw the build
    loaded = sorted(m for m in modules if m.split(".")[0] in NOT_FOR_RANDOM_GATES or m in NOT_FOR_RANDOM_GATES)
    assert loaded == []


def test_start_up_imports_make_no_collection_and_are_frozen(random_gate_build):
    proc, record, _ = random_gate_build
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # none while torch and the command's modules were imported: every collection with torch loaded came after
    # its objects were frozen (the few before are the interpreter's own start, before `main` runs)
    during = [c for c in record["collections"] if c[2] and c[1] == 0]
    assert during == []
    assert any(c[2] and c[1] > 0 for c in record["collections"])  # the build's own collections were recorded
    assert record["gc_enabled"] is True
    assert record["frozen"] > 10_000  # torch's objects, at least


def test_without_the_pause_start_up_collects_torch_s_objects(random_gate_build, tmp_path):
    """The comparison that gives the test above its meaning: the same command with `import_gc.pause` made a no-op
    (the product's guarantee broken in the subprocess) collects while torch's objects are not frozen."""
    _, _, built = random_gate_build
    cfg = built.parent / "experts.yaml"
    broken = RECORDER.replace("import moe_upcycle.terminal.exit as exit_module",
                              "import moe_upcycle.terminal.import_gc as import_gc\n"
                              "import_gc.pause = lambda: None\n"
                              "import moe_upcycle.terminal.exit as exit_module")
    record_path = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, "-c", broken, str(record_path), "plan", str(cfg)], cwd=REPO,
                          env=module_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(record_path.read_text())
    assert record["frozen"] == 0  # nothing paused, so `resume` froze nothing
    full_during = [c for c in record["collections"] if c[2] and c[1] == 0 and c[0] == 2]
    assert len(full_during) >= 1  # full passes over torch's objects: what the pause spares


@pytest.fixture
def gc_state():
    """Restore the collector (enabled, nothing frozen by the test) after a test that changes it."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    import_gc._PAUSED["on"] = False
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_pause_then_resume_freezes_and_restarts(gc_state):
    gc.enable()
    import_gc.pause()
    assert not gc.isenabled()
    made = [[i] for i in range(1000)]  # tracked objects made while paused
    import_gc.resume()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    import_gc.resume()  # a second resume changes nothing
    assert gc.isenabled()


def test_resume_without_pause_changes_nothing(gc_state):
    gc.enable()
    frozen = gc.get_freeze_count()
    import_gc.resume()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_collector_turned_off_by_the_caller_stays_off(gc_state):
    gc.disable()
    import_gc.pause()
    import_gc.resume()
    assert not gc.isenabled()
