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
             "--device cpu", "quantize: 8bit", "nvidia-smi", "nothing was written under the output name"]
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
                                       "lower --batch-size (now 4) or use --device cpu"])])
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


def test_other_runtime_errors_stay_bugs_with_their_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_upcycle.check.verify, "verify", raises(RuntimeError("shape mismatch in layer 3")))
    result = CliRunner().invoke(app, ["verify", str(tmp_path), "--device", "cpu"])
    assert isinstance(result.exception, RuntimeError) and "shape mismatch" in str(result.exception)


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
