"""`plan`'s memory figures: each equals its documented formula (exact numbers on meta plans), and the
plan output says what they assume. Measured against real builds by scripts/bench_plan_memory.py."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from moe_upcycle import load_config
from moe_upcycle.check import drift
from moe_upcycle.checkpoint.meta_model import describe_dense
from moe_upcycle.checkpoint.source import meta_checkpoint, open_sources
from moe_upcycle.cli import app
from moe_upcycle.planning import memory
from moe_upcycle.planning.memory import (
    LINT_BYTES,
    RUNTIME_BYTES,
    RUNTIME_FILE_BYTES,
    TRANSFORMERS_BYTES,
    estimate_memory,
)
from moe_upcycle.planning.plan import make_plan
from moe_upcycle.recipe.params import CheckParams
from moe_upcycle.recipe.resolve import check_params, gate_params, write_params
from moe_upcycle.terminal.allocator import return_large_frees

runner = CliRunner()
REF = "mistralai/Mistral-7B-v0.1"
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
PARAMS = 7_241_732_096
ROUTERS = 32 * 8 * 4096 * 4  # fp32 (E, H) per layer
MLP = 14336 * 4096  # elements of one expert matrix
STAGING = 4 * 16 * 2**20  # the writer's staging buffers (checkpoint.shard_file), every shard of 7B > 64 MiB


def estimate(**recipe):
    config = load_config({"base_model": REF, "num_experts": 8, "gate_mode": "random", **recipe})
    sources = {REF: meta_checkpoint(REF, MISTRAL_7B, describe_dense(MISTRAL_7B))}
    plan = make_plan(config, sources)
    return estimate_memory(plan, gate_params(config), write_params(config), check_params(config), sources, REF)


def test_dtype_cast_holds_the_largest_cast_tensor():
    m = estimate(dtype="float32")  # bf16 in, fp32 out: each source tensor gets a private fp32 copy
    # lm_head's fp32 copy, while the previous tensor (the final norm's fp32 copy) is still referenced
    assert m.build_private_bytes == RUNTIME_BYTES + ROUTERS + 32000 * 4096 * 4 + 4096 * 4 + STAGING
    assert m.build_phase == "writing" and m.lint_bytes == 0
    assert m.mapped_input_bytes == 2 * PARAMS  # every input tensor is read (mapped) once
    assert m.build_rss_bytes == m.build_private_bytes + RUNTIME_FILE_BYTES + 2 * PARAMS


def test_noise_holds_two_fp32_copies_and_the_previous_slot():
    m = estimate(experts=[{"source_model": REF, "noise_scale": 0.01}] * 8, num_experts=None)
    # a noisy bf16 slot: its fp32 copy and the noise, scaled and added in place (2 x 4 bytes per
    # element), beside the previous slot's bf16 result (2 bytes per element)
    assert m.build_private_bytes == RUNTIME_BYTES + ROUTERS + 2 * 4 * MLP + 2 * MLP + STAGING


def test_drop_and_clone_working_memory():
    m = estimate(expert_init={"method": "drop", "ratio": 0.5})
    # one fp32 copy and drop's fresh rows (0.5 of it), or the fp32 result and its bf16 cast: 6 bytes
    # per element, + previous slot's bf16
    assert m.build_private_bytes == RUNTIME_BYTES + ROUTERS + 6 * MLP + 2 * MLP + STAGING
    m = estimate(tensor_policy="clone")  # a bf16 clone per slot, beside the previous slot's clone
    assert m.build_private_bytes == RUNTIME_BYTES + ROUTERS + 2 * 2 * MLP + STAGING


LAYER = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * MLP + 2 * 4096  # elements of one Mistral-7B decoder layer


def test_hidden_gates_on_cpu_stream_one_fp32_layer_and_the_prompts(monkeypatch):
    """Streamed gates hold one layer cast to fp32 (the bf16 input is mapped), the prompts' hidden states between
    layers with their masks and rotary cos/sin, and one batch's activations inside a layer — not the model."""
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: False)
    prompts = ["x" * 98, "short"]
    experts = [{"source_model": REF, "positive_prompts": prompts},
               {"source_model": REF, "positive_prompts": ["y" * 98, "other"]}]  # same lengths, not the same prompts
    m = estimate(num_experts=None, gate_mode="hidden", device="cpu", experts=experts)
    states = 4 * 100 * (4096 + 2 * 128 + 2 * 100) * 4  # one batch: 4 prompts x (98 bytes + 2 special tokens), fp32
    acts = 4 * 100 * (3 * 14336 + 6 * 4096) * 4
    routers = 32 * 2 * 4096 * 4
    assert m.gate_private_bytes == RUNTIME_BYTES + TRANSFORMERS_BYTES + routers + 4 * LAYER + states + acts
    assert m.gate_private_bytes < PARAMS  # a tenth of the 29 GB the whole fp32 model took
    assert m.build_phase == "gates"
    assert m.build_private_bytes == m.gate_private_bytes + (LINT_BYTES if memory.lints_prompts(
        gate_params(load_config({"base_model": REF, "gate_mode": "hidden", "experts": experts}))) else 0)
    assert any("one layer at a time" in line and "float32" in line and "tokens" in line for line in m.assumptions)
    quantized = estimate(num_experts=None, gate_mode="hidden", device="cpu", experts=experts, quantize="4bit")
    assert quantized.gate_private_bytes == m.gate_private_bytes  # not applied: the same full-precision layers
    assert "quantize: 4bit is not applied: the gates stream the base at full precision (float32)" in quantized.assumptions
    # a layer stored in the compute dtype runs on the mapped file: no private copy of it
    same = estimate(num_experts=None, gate_mode="hidden", device="cpu", experts=experts, gate_dtype="bfloat16")
    acts16, states16 = acts // 2, states // 2
    assert same.gate_private_bytes == RUNTIME_BYTES + TRANSFORMERS_BYTES + routers + states16 + acts16


def test_streamed_states_are_batched_as_the_gates_batch_them(monkeypatch):
    """Prompts sorted by length in batches of batch_size, each padded to its longest: 10 prompts of 10..100
    bytes in batches of 4 are (4, 42), (4, 82), (2, 102) tokens at most; mergekit batches per expert's set."""
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: False)
    experts = [{"source_model": REF, "positive_prompts": ["p" * (10 * k) for k in range(1, 11, 2)]},
               {"source_model": REF, "positive_prompts": ["q" * (10 * k) for k in range(2, 11, 2)]}]
    config = load_config({"base_model": REF, "gate_mode": "hidden", "batch_size": 4, "experts": experts})
    assert memory.batch_shapes(gate_params(config)) == [(4, 42), (4, 82), (2, 102)]
    mergekit = load_config({**config.model_dump(exclude_none=True), "gate_source": "mergekit"})
    assert memory.batch_shapes(gate_params(mergekit)) == [(5, 92), (5, 102)]
    plan = make_plan(config, {REF: meta_checkpoint(REF, MISTRAL_7B, describe_dense(MISTRAL_7B))})
    held, passes = memory.streamed_states(plan, gate_params(config))
    per = [b * t * (4096 + 256 + 2 * t) * 4 for b, t in [(4, 42), (4, 82), (2, 102)]]
    assert (held, passes) == (sum(per), 1)


@pytest.mark.parametrize("prompt_bytes", [98, 8])
def test_hidden_gates_on_a_gpu_hold_two_layers_and_the_prompts(monkeypatch, prompt_bytes):
    """On a GPU the layer running and the one arriving are both there, in bf16, beside the prompts' hidden states,
    one batch's activations and one router input being reduced; host memory holds their pinned staging."""
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    experts = [{"source_model": REF, "positive_prompts": ["x" * prompt_bytes, "short"]},
               {"source_model": REF, "positive_prompts": ["y" * prompt_bytes, "other"]}]
    m = estimate(num_experts=None, gate_mode="hidden", experts=experts)
    tokens = max(prompt_bytes, 5) + 2
    acts = 4 * tokens * (3 * 14336 + 6 * 4096) * 2
    states = 4 * tokens * (4096 + 2 * 128 + 2 * tokens) * 2
    assert m.gpu_bytes == 2 * 2 * LAYER + states + acts + 3 * 4 * tokens * 4096 * 2
    assert m.gate_private_bytes == RUNTIME_BYTES + TRANSFORMERS_BYTES + 32 * 2 * 4096 * 4 + 2 * 2 * LAYER
    assert any("hidden gates on the GPU" in line and "one layer at a time" in line for line in m.assumptions)


def test_kmeans_counts_its_token_sample_and_its_passes(monkeypatch, tmp_path):
    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: False)
    sample = min(16384, 2 * 2**30 // (4 * 32 * 4096))
    m = estimate(gate_mode="kmeans", calibration_text="corpus.txt", device="cpu")  # unreadable: the largest case
    batch = 8 * 256 * (4096 + 256 + 512) * 4  # one batch of windows between layers
    per_pass = 2**30 // batch
    acts = 8 * 256 * (3 * 14336 + 6 * 4096) * 4 + sample * 4 * 32 * 4096
    assert m.gate_private_bytes == RUNTIME_BYTES + TRANSFORMERS_BYTES + ROUTERS + 4 * LAYER + per_pass * batch + acts
    assert any(f"in {-(-(sample // 8) // per_pass)} passes, each reading the layers again" in line
               for line in m.assumptions)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("word " * 300 + "\n\n" + "word " * 10)  # two documents: 2 + 1 windows of 256 tokens at most
    small = estimate(gate_mode="kmeans", calibration_text=str(corpus), device="cpu")
    assert small.gate_private_bytes == m.gate_private_bytes - per_pass * batch + batch
    assert not any("passes" in line for line in small.assumptions)


@pytest.mark.parametrize("report, changed, size, expected", [
    (None, True, 2 * 10**9, True), (None, True, 2 * 10**9 + 1, False), (None, False, 10**6, False),
    (True, False, 10**12, True), (False, True, 10**6, False)])
def test_plan_and_build_share_one_drift_rule(stories, tmp_path, monkeypatch, report, changed, size, expected):
    """The plan predicts the drift phase exactly when the build would run it (one rule, `measures_drift`)."""
    check = CheckParams(str(stories), report_init_drift=report, inits_changed=changed)
    assert check.measures_drift(size) is expected
    config = load_config({"base_model": str(stories), "num_experts": 2, "gate_mode": "random"})
    sources = open_sources({str(stories): "base_model"})
    plan = make_plan(config, sources)
    monkeypatch.setattr(type(plan), "total_bytes", property(lambda self: size))
    predicted = memory.drift_phase(plan, check, sources[str(stories)]) is not None
    ran = []
    monkeypatch.setattr(drift, "measure_drift_folders", lambda dense, moe, text, adapter=None: ran.append(text))
    drift.build_drift(check, plan, stories, tmp_path)
    assert predicted is expected and bool(ran) is expected


def test_init_drift_phase_of_a_small_noisy_build(stories):
    config = load_config({"base_model": str(stories), "num_experts": 4, "gate_mode": "random",
                          "expert_init": {"method": "noise", "scale": 0.01}})
    from moe_upcycle.checkpoint.source import open_sources

    sources = open_sources({config.base_model: config.base_model})
    plan = make_plan(config, sources)
    m = estimate_memory(plan, gate_params(config), write_params(config), check_params(config), sources,
                        config.base_model)
    assert m.build_phase == "init drift"  # a non-copy init of a small output: both models loaded in fp32
    dense = sum(math.prod(t.shape) for t in sources[config.base_model].tensors.values())
    assert m.build_private_bytes > RUNTIME_BYTES + TRANSFORMERS_BYTES + 4 * dense
    config = load_config({**config.model_dump(exclude_none=True), "report_init_drift": False})
    m = estimate_memory(plan, gate_params(config), write_params(config), check_params(config), sources,
                        config.base_model)
    assert m.build_phase == "writing"


def test_plan_output_says_what_memory_assumes(stories, write_yaml):
    cfg = write_yaml({"base_model": str(stories), "num_experts": 4, "gate_mode": "random"})
    res = runner.invoke(app, ["plan", str(cfg)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "private to build (writing phase)" in text and "mapped from page cache (reclaimable)" in text
    assert f"memory assumes │ private = {RUNTIME_BYTES // 10**6} MB Python+torch runtime (measured" in text
    res = runner.invoke(app, ["plan", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    mem = data["memory"]
    assert mem["build_private_bytes"] >= RUNTIME_BYTES and mem["build_rss_bytes"] > mem["build_private_bytes"]
    assert mem["assumptions"] and data["total_params"] > 0 and data["runtimes"][0]["runtime"] == "transformers 5"


def test_allocator_setting_is_harmless():
    assert return_large_frees() in (True, False)  # glibc: set; elsewhere: nothing done


@pytest.mark.parametrize("mode", ["random", "uniform", "cheap_embed"])
def test_cheap_modes_never_load_the_model(mode):
    experts = [{"source_model": REF, "positive_prompts": [p]} for p in "ab"] if mode == "cheap_embed" else None
    m = estimate(gate_mode=mode, **({"experts": experts, "num_experts": None} if experts else {}))
    assert m.gate_private_bytes < RUNTIME_BYTES + TRANSFORMERS_BYTES + 32000 * 4096 * 4 + ROUTERS + 1


def test_staging_buffers_are_touched_only_as_far_as_the_largest_shard():
    from pathlib import Path

    from moe_upcycle import upcycle

    stories = Path(__file__).parent / "data" / "stories260K"
    result = upcycle({"base_model": str(stories), "num_experts": 4, "gate_mode": "random"}, dry_run=True)
    total = result.plan.total_bytes  # one shard: well under the 4 x 16 MiB of buffers
    assert memory.staging_bytes(result.plan, write_params(result.config)) == total + (-total % 4096)
    big = load_config({"base_model": REF, "num_experts": 8, "gate_mode": "random"})
    plan = make_plan(big, {REF: meta_checkpoint(REF, MISTRAL_7B, describe_dense(MISTRAL_7B))})
    assert memory.staging_bytes(plan, write_params(big)) == STAGING


# runs `python -m moe_upcycle ARGS` (or with "--gates-only", what a build does up to its gates, then exits) with a
# thread sampling the process's own RssAnon every millisecond; at the process's last step (`terminal.exit.finish`)
# writes the peak sampled RssAnon and the kernel's VmHWM to RECORD
MEASURED = r"""
import json, runpy, sys, threading, time
record_path, args = sys.argv[1], sys.argv[2:]
peak = {"anon": 0}

def status():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out

def sample():
    while True:
        peak["anon"] = max(peak["anon"], status()["RssAnon"])
        time.sleep(0.001)

threading.Thread(target=sample, daemon=True).start()
import moe_upcycle.terminal.exit as exit_module
finish = exit_module.finish

def recorded_finish(code):
    with open(record_path, "w") as fh:
        json.dump({"anon": max(peak["anon"], status()["RssAnon"]), "hwm": status()["VmHWM"]}, fh)
    finish(code)

exit_module.finish = recorded_finish
if args[0] == "--gates-only":
    from moe_upcycle.terminal.allocator import return_large_frees
    return_large_frees()  # as the CLI does
    import moe_upcycle.cli.commands  # the CLI's imports, so the runtime is the build's
    from moe_upcycle.build import prepare
    from moe_upcycle.gates.router import compute_gate_rows
    from moe_upcycle.recipe.resolve import gate_params
    config, sources, plan = prepare(args[1])
    compute_gate_rows(gate_params(config), plan, sources[config.base_model])
    exit_module.finish(0)
sys.argv = ["moe-upcycle", *args]
runpy.run_module("moe_upcycle", run_name="__main__", alter_sys=True)
"""


def test_a_lora_bases_merge_is_planned_as_the_build_holds_it(tmp_path):
    """A ``model+lora`` base with hidden-state gates on the CPU (2 layers, fp32, every projection adapted): the reader
    merges a whole layer one layer ahead, so layer 0's merged tensors (28.3 MB) and layer 1's up to its router input
    (9.4 MB) are alive at once, with one merge's fp32 delta (6.3 MB).

    - What the LoRA adds to the gates' peak private memory (RssAnon sampled every millisecond; the same gates on the
      plain base subtracted, which removes the runtime) is within 25 % of what the plan adds for it (measured: 48 MB
      for 44 MB; the plan before counted one merged tensor and its work, 25 MB).
    - The build's peak private memory is within 25 % of the plan's (``--no-lint``: without the lint's embedder).
    """
    import subprocess
    import sys

    import yaml

    from failure_checks import REPO, module_env
    from moe_upcycle.checkpoint.tiny import make_dense_model
    from routing_prompts import CODE, STORY
    from test_lora import make_adapter

    # 2 layers of 768 x 768 attention (4 matrices) and 768 x 2048 MLP (3), fp32: 28.3 MB per layer
    dense = make_dense_model(tmp_path / "dense", family="llama", seed=3, hidden_size=768, intermediate_size=2048,
                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8)
    modules = {f"model.layers.{layer}.{kind}.{proj}": 8 for layer in range(2)
               for kind, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                   ("mlp", ("gate_proj", "up_proj", "down_proj"))) for proj in projs}
    adapter = make_adapter(tmp_path / "adapter", dense, modules, seed=4)
    peaks, planned = {}, {}
    for name, ref in (("plain", str(dense)), ("lora", f"{dense}+{adapter}")):
        recipe = {"base_model": ref, "gate_mode": "hidden", "device": "cpu", "experts": [
            {"source_model": ref, "positive_prompts": [CODE[0], CODE[1]]},
            {"source_model": ref, "positive_prompts": [STORY[0], STORY[1]]}]}
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(recipe))
        plan = subprocess.run([sys.executable, "-m", "moe_upcycle", "plan", str(config), "--json"], cwd=REPO,
                              env=module_env(), capture_output=True, text=True, timeout=300)
        assert plan.returncode == 0, plan.stderr[-2000:]
        planned[name] = json.loads(plan.stdout)["memory"]
        for kind, args in (("gates", ["--gates-only", str(config)]),
                           ("build", ["-q", "build", str(config), str(tmp_path / f"moe-{name}"), "--no-lint"])):
            if kind == "build" and name == "plain":
                continue
            record = tmp_path / f"{name}-{kind}.json"
            run = subprocess.run([sys.executable, "-c", MEASURED, str(record), *args], cwd=REPO, env=module_env(),
                                 capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr[-2000:]
            peaks[name, kind] = json.loads(record.read_text())["anon"]
    layer, attention, delta = 4 * 768 * 768 * 4 + 3 * 768 * 2048 * 4, 4 * 768 * 768 * 4, 4 * 768 * 2048
    predicted = planned["lora"]["gate_private_bytes"] - planned["plain"]["gate_private_bytes"]
    assert predicted == layer + attention + delta
    measured = peaks["lora", "gates"] - peaks["plain", "gates"]
    build = planned["lora"]["build_private_bytes"] - planned["lora"]["lint_bytes"]
    print(f"LoRA merge: measured +{measured / 1e6:.1f} MB, planned +{predicted / 1e6:.1f} MB; build peak "
          f"{peaks['lora', 'build'] / 1e6:.0f} MB, planned {build / 1e6:.0f} MB")
    assert 0.75 <= measured / predicted <= 1.25, (measured, predicted, peaks, planned)
    assert 0.75 <= peaks["lora", "build"] / build <= 1.25, (peaks, planned)
