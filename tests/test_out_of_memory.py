"""Running out of memory, on the GPU or the machine, is not a bug: each command says so, names the options that make
it fit, exits 1 without a traceback, and a build leaves nothing under its output name (before: torch's traceback)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import moe_upcycle.check.route
import moe_upcycle.check.verify
import moe_upcycle.gates.hidden_gates
import moe_upcycle.planning.execute
from failure_checks import assert_clean_failure, cli, previous_build
from moe_upcycle.cli import app

GPU_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
           "is free. Including non-PyTorch memory, this process has 78.10 GiB memory in use.")
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")


def raises(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("force", [False, True])
def test_gpu_out_of_memory_in_hidden_gates(stories, tmp_path, monkeypatch, force):
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: hidden\nexperts:\n"
                   f"  - source_model: {stories}\n    positive_prompts: [a story about a cat]\n"
                   f"  - source_model: {stories}\n    positive_prompts: [a story about a dog]\n")
    target = tmp_path / "moe"
    if force:
        previous_build(target, {"keep.txt": "previous build"})
    monkeypatch.setattr(moe_upcycle.gates.hidden_gates, "capture_router_inputs", raises(torch.OutOfMemoryError(GPU_OOM)))
    code, output = cli("build", cfg, target, "--batch-size", "3", "--device", "cpu", *(["--force"] if force else []))
    words = ["error: the GPU ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
             "capacity of 79.19 GiB of which 1.06 GiB is free);", "lower --batch-size (now 3) for hidden-state gates",
             "--device cpu", "one layer of the base", "nvidia-smi", "nothing was written under the output name"]
    if force:  # the previous build is kept as it was
        assert code == 1 and "Traceback" not in output
        assert all(w in " ".join(output.split()) for w in words), output
        assert sorted(p.name for p in target.iterdir()) == ["keep.txt", "moe_upcycle.json"]
    else:
        assert_clean_failure(code, output, target, words)


def test_machine_out_of_memory_while_writing(tiny_llama, tmp_path, monkeypatch):
    cfg = tmp_path / "experts.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\nexpert_init: {{method: noise, "
                   f"scale: 0.01}}\n")
    monkeypatch.setattr(moe_upcycle.planning.execute, "apply_transforms", raises(RuntimeError(CPU_OOM)))
    code, output = cli("build", cfg, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [
        "error: the machine ran out of memory (an allocation of 68.7 GB failed);",
        "`moe-upcycle plan CONFIG` shows what the build holds in each phase", "nothing was written under the output name"])
    assert "nvidia-smi" not in output and "alloc_cpu.cpp" not in output


@pytest.mark.parametrize("exc, words", [
    (MemoryError(), ["error: the machine ran out of memory; lower --batch-size (now 4)"]),
    (torch.OutOfMemoryError(GPU_OOM), ["error: the GPU ran out of memory (CUDA out of memory.",
                                       "lower --batch-size (now 4) or use --device cpu"]),
    (ImportError("/site-packages/scipy/linalg/_fblas.cpython-311-x86_64-linux-gnu.so: failed to map segment from "
                 "shared object"),  # a library loaded late, under `ulimit -v` (seen for real in verify)
     ["error: the machine ran out of memory (the library _fblas.cpython-311-x86_64-linux-gnu.so could not be "
      "loaded); lower --batch-size (now 4)"])], ids=["MemoryError", "CUDA", "library"])
def test_route_out_of_memory(tmp_path, monkeypatch, exc, words):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a story\n")
    (tmp_path / "moe").mkdir()
    monkeypatch.setattr(moe_upcycle.check.route, "route", raises(exc))
    code, output = cli("route", tmp_path / "moe", "--prompts", prompts, "--batch-size", "4")
    flat = " ".join(output.split())
    assert code == 1 and "Traceback" not in output and all(w in flat for w in words), output
    assert "nothing was written" not in flat  # route writes no output folder


def test_verify_out_of_memory_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_upcycle.check.verify, "verify", raises(torch.OutOfMemoryError(GPU_OOM)))
    code, output = cli("verify", tmp_path, "--device", "cpu")
    flat = " ".join(output.split())
    assert code == 1 and "Traceback" not in output and "error: the GPU ran out of memory" in flat, output
    assert "; use --device cpu;" in flat


@pytest.mark.parametrize("exc", [RuntimeError("shape mismatch in layer 3"), ImportError("cannot import name 'x'"),
                                 ImportError("libfoo.so: failed to map segment from shared object: Operation not "
                                             "permitted")])  # a noexec mount, not memory
def test_other_errors_stay_bugs_with_their_traceback(tmp_path, monkeypatch, exc):
    monkeypatch.setattr(moe_upcycle.check.verify, "verify", raises(exc))
    result = CliRunner().invoke(app, ["verify", str(tmp_path), "--device", "cpu"])
    assert result.exception is exc


def test_no_memory_for_the_writers_buffers_is_memory_not_the_output(tiny_llama, tmp_path, monkeypatch):
    """ENOMEM while the writer sets up a shard (its staging buffers; seen for real under `ulimit -v` in the demo) is
    the machine's memory: before, "output error: creating .../.moe.partial-N/model-00001-of-00001.safetensors
    failed: Cannot allocate memory" named a staging file as if the output were at fault."""
    import errno

    import moe_upcycle.checkpoint.writer

    cfg = tmp_path / "experts.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n")
    monkeypatch.setattr(moe_upcycle.checkpoint.writer, "ShardFile",
                        raises(OSError(errno.ENOMEM, "Cannot allocate memory")))
    code, output = cli("build", cfg, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", [
        "error: the machine ran out of memory (Cannot allocate memory);", "moe-upcycle plan CONFIG",
        "nothing was written under the output name"])
    assert "output error" not in output and ".partial-" not in output


MMAP_ENOMEM = "unable to mmap 90868376 bytes from file </models/minilm/model.safetensors>: Cannot allocate memory (12)"


def test_a_base_that_did_not_fit_is_not_called_broken(tiny_llama, tmp_path, monkeypatch):
    """verify's dense base failing to load for want of memory (seen under `ulimit -v`: "can't start new thread") is
    memory, not "dense base ... does not load; pass a working --base DENSE" as before."""
    from moe_upcycle import upcycle
    from moe_upcycle.check.compare import load_causal_lm

    out = upcycle({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"}, tmp_path / "moe").output
    calls = []

    def second_fails(*args, **kwargs):  # the MoE loads; the dense base, loaded second, does not fit
        calls.append(args[0])
        if len(calls) == 2:
            raise RuntimeError("can't start new thread")
        return load_causal_lm(*args, **kwargs)

    monkeypatch.setattr(moe_upcycle.check.verify, "load_causal_lm", second_fails)
    code, output = cli("verify", out, "--device", "cpu", "--skip-hashes")
    flat = " ".join(output.split())
    assert code == 1 and "Traceback" not in output and len(calls) == 2, output
    assert "error: the machine ran out of memory (can't start new thread); verify on a machine with more memory" in flat
    assert "does not load" not in flat and "--base" not in flat


def test_an_embedder_that_did_not_fit_is_memory(write_yaml, tiny_llama, monkeypatch):
    """lint's embedder whose weights could not be mapped (seen for real under `ulimit -v`: a traceback before)."""
    import moe_upcycle.prompts.embed

    cfg = write_yaml({"base_model": str(tiny_llama), "gate_mode": "cheap_embed", "experts": [
        {"source_model": str(tiny_llama), "positive_prompts": ["a story"]},
        {"source_model": str(tiny_llama), "positive_prompts": ["some code"]}]})
    monkeypatch.setattr(moe_upcycle.prompts.embed, "load_embedder", raises(RuntimeError(MMAP_ENOMEM)))
    code, output = cli("lint", cfg)
    flat = " ".join(output.split())
    assert code == 1 and "Traceback" not in output, output
    assert ("error: the machine ran out of memory (mapping 90.9 MB of /models/minilm/model.safetensors failed); "
            "lower --batch-size (now 64)") in flat


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError(MMAP_ENOMEM)], ids=["MemoryError", "mmap-ENOMEM"])
def test_a_source_that_did_not_fit_is_not_called_damaged(tiny_llama_bin_tied, tmp_path, monkeypatch, exc):
    """A source tensor that could not be read for want of memory: before, "cannot read tensor ...; the file is
    damaged or truncated — re-download it" (a re-download of a model that only did not fit)."""
    import moe_upcycle.checkpoint.source

    cfg = tmp_path / "experts.yaml"
    cfg.write_text(f"base_model: {tiny_llama_bin_tied}\nnum_experts: 2\ngate_mode: random\n")
    monkeypatch.setattr(moe_upcycle.checkpoint.source.Checkpoint, "_open", raises(exc))
    code, output = cli("build", cfg, tmp_path / "moe")
    assert_clean_failure(code, output, tmp_path / "moe", ["error: the machine ran out of memory",
                                                          "nothing was written under the output name"])
    assert "damaged" not in output and "re-download" not in output


def test_an_embedder_library_that_did_not_fit_is_not_a_missing_install(write_yaml, tiny_llama, monkeypatch):
    """sentence-transformers failing to import because a library of it could not be mapped (seen for real under
    `ulimit -v` in `prompts grow`): before, "installed but does not import ...; pip install -U sentence-transformers"."""
    import sys

    import moe_upcycle.prompts.embed as embed

    class Unmappable:
        def find_spec(self, name, path=None, target=None):
            if name == "sentence_transformers":
                raise ImportError("libgfortran-8f1e9814.so.5.0.0: failed to map segment from shared object")
            return None

    cfg = write_yaml({"base_model": str(tiny_llama), "gate_mode": "cheap_embed", "experts": [
        {"source_model": str(tiny_llama), "positive_prompts": ["a story"]},
        {"source_model": str(tiny_llama), "positive_prompts": ["some code"]}]})
    monkeypatch.delitem(sys.modules, "sentence_transformers", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Unmappable(), *sys.meta_path])
    embed._embedder.cache_clear()  # loaded once per process: load it again, now
    embed._load_model.cache_clear()
    try:
        code, output = cli("lint", cfg)
    finally:
        embed._embedder.cache_clear()
        embed._load_model.cache_clear()
    flat = " ".join(output.split())
    assert code == 1 and "Traceback" not in output, output
    assert "error: the machine ran out of memory (the library libgfortran-8f1e9814.so.5.0.0 could not be loaded)" in flat
    assert "pip install" not in flat


IMPORT_FAILS = """
import sys
from importlib.abc import MetaPathFinder

class Fail(MetaPathFinder):  # torch failing to load, as under `ulimit -v` (seen for real: 300 MB and 600 MB)
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise {exc}

sys.meta_path.insert(0, Fail())
sys.argv = ["moe-upcycle", "demo", sys.argv[1]]
from moe_upcycle.__main__ import main
main()
"""


@pytest.mark.parametrize("exc, words", [
    ('ImportError("libtorch_cpu.so: failed to map segment from shared object")',
     "error: the machine ran out of memory (the library libtorch_cpu.so could not be loaded); free memory (close "
     "other programs) and run it again\n"),
    ("MemoryError()", "error: the machine ran out of memory; free memory (close other programs) and run it again\n"),
    ('SystemError("<function _find_and_load> returned NULL without setting an exception")',
     "error: torch could not be loaded (SystemError: <function _find_and_load> returned NULL without setting an "
     "exception), as happens when memory is limited (ulimit -v, a container); free memory or raise the limit, and "
     "run it again\n"),
])
def test_torch_that_cannot_load_for_want_of_memory_is_one_line(tmp_path, exc, words):
    """torch is imported before the command's own error handling (for its signals): running out of memory there was
    a traceback; now it is the one line every other shortage gets, in plain text (rich imports more to render
    markup, which failed too), and nothing is made."""
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(IMPORT_FAILS.format(exc=exc))
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert (done.returncode, done.stdout, done.stderr) == (1, "", words)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run.py"]


def test_a_system_error_from_a_broken_torch_is_still_a_bug(tmp_path):
    """Only the interpreter's out-of-memory SystemErrors are called memory; one from a broken install keeps its
    traceback (a one-line "free memory" would send the user the wrong way)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(IMPORT_FAILS.format(exc='SystemError("initialization of _C raised unreported exception")'))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "demo")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 1 and "Traceback" in done.stderr
    assert done.stderr.rstrip().endswith("SystemError: initialization of _C raised unreported exception")
    assert "memory" not in done.stderr
