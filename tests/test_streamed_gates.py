"""Hidden-state gates stream the base one layer at a time (gates/stream.py) and give the routers the whole loaded
model gives: every family (Llama, Qwen2 with biases, Qwen3 with q/k norms, Mistral and Qwen2 with a sliding window
shorter than the prompts), every mode (hidden, hidden_last, kmeans), negative prompts, gate_center, a LoRA base,
``gate_source: mergekit`` bit for bit. Only one layer's tensors are read at a time, the final norm and the LM head
never, and ``from_pretrained`` is never called for gates.

The references are the whole-model paths as they were before streaming: `capture.load_base` + `run_batches` for
native gates, and a whole-model forward with ``output_hidden_states`` for mergekit's rows (`whole_model_mergekit`).
"""

from __future__ import annotations

import threading
import warnings
from typing import Sequence

import pytest
import torch
from safetensors.torch import load_file

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.source import open_checkpoint
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.errors import SourceError, UpcycleWarning
from moe_upcycle.gates import batches, capture as cap
from moe_upcycle.gates import hidden_gates as hg
from moe_upcycle.gates import layer_reader
from moe_upcycle.gates import mergekit_gates as mk
from moe_upcycle.gates.stream import open_streamed
from moe_upcycle.recipe.params import ExpertPrompts, GateParams
from routing_prompts import CODE, STORY
from tf4_logits import NO_TF4, REPO, TF4_PYTHON

CALIBRATION = "\n\n".join(CODE + STORY)
EXPERTS = (ExpertPrompts("code", tuple(CODE[:4]), (STORY[7],)), ExpertPrompts("story", tuple(STORY[:3])),
           ExpertPrompts("mixed", (CODE[5], STORY[4], "Hello there!")))


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Mistral and Qwen2 whose sliding window (4 tokens) is shorter than every prompt: the mask matters."""
    root = tmp_path_factory.mktemp("windowed")
    return {"mistral": make_dense_model(root / "mistral", family="mistral", seed=7, sliding_window=4,
                                        max_shard_size="40KB"),
            "qwen2": make_dense_model(root / "qwen2", family="qwen2", seed=8, random_norms_and_biases=True,
                                      use_sliding_window=True, sliding_window=4, max_window_layers=1)}


@pytest.fixture(params=["stories", "qwen2", "qwen3", "mistral-window", "qwen2-window"])
def base(request, stories, tiny_qwen2, tiny_qwen3, windowed):
    return {"stories": stories, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "mistral-window": windowed["mistral"],
            "qwen2-window": windowed["qwen2"]}[request.param]


def rows_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6) -> None:
    """Every row (last dim) of `actual` within `rel` of its norm of `expected`'s row (fp32)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    err = (actual.double() - expected.double()).norm(dim=-1)
    bound = rel * expected.double().norm(dim=-1).clamp_min(1e-30)
    assert bool((err <= bound).all()), float((err / bound).max())


def whole_model_gates(params: GateParams, path, adapter=None, loaded=None) -> torch.Tensor:
    """`compute_hidden_gates` as it was before streaming: the base loaded whole, the same capture and rows."""
    loaded = loaded or cap.load_base(path, params.device, params.dtype, None, adapter)
    if params.mode == "kmeans":
        direction, own, token_norm = hg.kmeans_router_inputs(loaded, str(params.calibration_text),
                                                             len(params.experts), params.seed, params.batch_size)
    else:
        reduce = "last" if params.mode == "hidden_last" else "mean"
        own, negative, inputs = hg.prompt_router_inputs(loaded, params.experts, reduce, params.batch_size)
        has_negative = torch.tensor([bool(e.negative) for e in params.experts])[None, :, None]
        token_norm = inputs.token_norm
        if params.center:  # gate_center: the mean of the positive means taken from both means, then subtracted
            shared = own.mean(dim=1, keepdim=True)
            direction = (own - shared) - (negative - shared) * has_negative
            return hg.gate_rows(direction, own, token_norm, center=False, scale=params.scale)
        direction = own - negative * has_negative
    return hg.gate_rows(direction, own, token_norm, center=params.center, scale=params.scale)


def whole_model_mergekit(params: GateParams, experts: Sequence[ExpertPrompts], num_layers: int, path,
                         adapter=None, loaded=None) -> torch.Tensor:
    """`mergekit_gates.hidden_rows` as it was before streaming: a forward of the whole model per prompt set,
    ``hidden_states[:-1]``, in the model dtype."""
    loaded = loaded or cap.load_base(path, params.device, params.dtype or "bfloat16", None, adapter)
    tokenizer = mk.mergekit_tokenizer(path)
    average = params.mode == "hidden_avg"

    def vector(prompts) -> torch.Tensor:  # (L, H)
        batch = {k: v.to(loaded.input_device) for k, v in mk.tokenize_prompts(prompts, tokenizer).items()}
        with torch.inference_mode():
            output = loaded.model(**batch, output_hidden_states=True, return_dict=True, use_cache=False)
        states = torch.stack(list(output.hidden_states[:-1]))  # (L, B, T, H)
        assert len(states) == num_layers
        per_prompt = states.sum(dim=2) / states.shape[2] if average else states[:, :, -1, :]
        return per_prompt.sum(dim=1) / per_prompt.shape[1]

    return torch.stack(mk._expert_rows(experts, vector), dim=1).cpu()


# ------------------------------------------------------------------------------------ the same router inputs


def test_streamed_router_inputs_are_the_whole_models(base):
    """Sums, token norms and k-means token points, right and left padding, batches of 2: within 1e-6 of each row's
    norm of the whole model's (the same batches through transformers' own layers: in practice bit for bit)."""
    texts = [CODE[0], STORY[1], "Hello there, my friend!", CODE[3] + " " + STORY[2], STORY[5]]
    groups = [0, 1, 0, 1, 1]
    loaded = cap.load_base(base, device="cpu")
    streamed = open_streamed(open_checkpoint(str(base), "base_model"), device="cpu")
    enc = batches.encode(loaded.tokenizer, texts, loaded.max_length)
    assert min(len(e.ids) for e in enc) > 4  # longer than the sliding windows
    for reduce, side in [(r, s) for r in ("mean", "last", "tokens") for s in ("right", "left")]:
        want = cap.capture_router_inputs(loaded, enc, groups, 2, reduce, batch_size=2, padding_side=side)
        got = cap.capture_router_inputs(streamed, enc, groups, 2, reduce, batch_size=2, padding_side=side)
        rows_close(got.token_norm[:, None], want.token_norm[:, None])
        if reduce == "tokens":
            assert [p.shape for p in got.points] == [p.shape for p in want.points]
            for g, w in zip(got.points, want.points):
                rows_close(g, w)
        else:
            rows_close(got.sums, want.sums)
            assert torch.equal(got.counts, want.counts)


def test_the_sliding_window_is_applied_as_the_model_applies_it(windowed):
    """The windowed models' router inputs differ from those of the same weights without a window: the masks the
    stream records are the model's own, per layer type (Qwen2 slides layer 1 only)."""
    import json
    import shutil

    for name, folder in windowed.items():
        plain = folder.parent / f"{name}-nowindow"
        if not plain.exists():
            shutil.copytree(folder, plain)
            config = json.loads((plain / "config.json").read_text())
            config.update(sliding_window=None, use_sliding_window=False, layer_types=None)
            (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        sums = {}
        for which, path in (("window", folder), ("plain", plain)):
            streamed = open_streamed(open_checkpoint(str(path), "base_model"), device="cpu")
            enc = batches.encode(streamed.tokenizer, [CODE[0] + " " + STORY[1]], streamed.max_length)
            sums[which] = cap.capture_router_inputs(streamed, enc, [0], 1, "mean").sums
        if name == "qwen2":  # layer 0 attends to everything in both; layer 1 slides
            assert torch.equal(sums["window"][0], sums["plain"][0])
        else:  # Mistral slides in every layer
            assert not torch.allclose(sums["window"][0], sums["plain"][0], rtol=1e-3, atol=0)
        assert not torch.allclose(sums["window"][1], sums["plain"][1], rtol=1e-3, atol=0)


# ------------------------------------------------------------------------------------------ the same routers


def test_streamed_gates_are_the_whole_models(base, tmp_path):
    """compute_hidden_gates (streamed) against the whole-model computation: negative prompts (expert 0), gate_center,
    k-means on a calibration text; every row within 1e-6 of its norm."""
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(CALIBRATION)
    layers = open_checkpoint(str(base), "base_model").config["num_hidden_layers"]
    loaded = cap.load_base(base, device="cpu")
    for mode, center in [("hidden", False), ("hidden_last", False), ("hidden", True), ("kmeans", False)]:
        params = GateParams(mode=mode, experts=EXPERTS, device="cpu", center=center, batch_size=3, seed=3,
                            calibration_text=str(calibration))
        got = hg.compute_hidden_gates(params, layers, base)
        want = whole_model_gates(params, base, loaded=loaded)
        rows_close(torch.stack([got[layer] for layer in range(layers)]), want)


def test_a_lora_base_streams_with_the_adapter_merged(tiny_llama, tmp_path):
    """``model+adapter``: each tensor is merged as it is read; the rows are those of the whole model with the
    adapter merged in (`lora.merge_into_model`), and differ from the model's own."""
    from test_lora import make_adapter

    adapter = make_adapter(tmp_path / "adapter", tiny_llama, {
        "model.embed_tokens": 4, "model.layers.0.self_attn.q_proj": 4, "model.layers.1.self_attn.v_proj": 4,
        "model.layers.0.mlp.up_proj": 4, "model.layers.1.mlp.down_proj": 4}, seed=5, embedding=True)
    base = open_checkpoint(f"{tiny_llama}+{adapter}", "base_model")
    assert base.adapter is not None
    for mode in ("hidden", "hidden_last"):
        params = GateParams(mode=mode, experts=EXPERTS, device="cpu", batch_size=2)
        got = torch.stack(list(hg.compute_hidden_gates(params, 2, base).values()))
        rows_close(got, whole_model_gates(params, tiny_llama, base.adapter))
        plain = torch.stack(list(hg.compute_hidden_gates(params, 2, tiny_llama).values()))
        assert not torch.allclose(got, plain, rtol=1e-3, atol=0)
    params = GateParams(mode="hidden", experts=EXPERTS, source="mergekit", device="cpu", dtype="float32")
    assert torch.equal(mk.hidden_rows(params, EXPERTS, 2, base),
                       whole_model_mergekit(params, EXPERTS, 2, tiny_llama, base.adapter))


def test_mergekit_rows_are_bit_for_bit_the_whole_models(base):
    """``gate_source: mergekit``: each layer's input, mergekit's batches (left padding, default positions), bf16 by
    default: the same bytes as a whole-model forward with output_hidden_states."""
    experts = EXPERTS + (ExpertPrompts("default", ("",)),)  # mergekit's empty "default expert" prompt
    ckpt = open_checkpoint(str(base), "base_model")
    layers = ckpt.config["num_hidden_layers"]
    for dtype in (None, "float32"):
        loaded = cap.load_base(base, device="cpu", dtype=dtype or "bfloat16")
        for mode in ("hidden", "hidden_avg", "hidden_last"):
            params = GateParams(mode=mode, experts=experts, source="mergekit", device="cpu", dtype=dtype)
            got = mk.hidden_rows(params, experts, layers, ckpt)
            want = whole_model_mergekit(params, experts, layers, base, loaded=loaded)
            assert got.dtype == (torch.bfloat16 if dtype is None else torch.float32)
            assert torch.equal(got, want), (mode, dtype)


# ------------------------------------------------------------------------------------ one layer at a time


def test_each_layer_is_read_once_the_head_and_final_norm_never(tiny_qwen3, monkeypatch):
    """A pass reads the embedding, then layer 0..L-1 in order, each tensor once; the last layer without its MLP
    (nothing after its router input runs); never the final norm or the LM head. While a layer runs, at most the
    next one is prepared: the reader waits for the layer before to be released."""
    ckpt = open_checkpoint(str(tiny_qwen3), "base_model")
    reads, events = [], []
    real_read = type(ckpt).read
    monkeypatch.setattr(type(ckpt), "read", lambda self, key: reads.append(key) or real_read(self, key))
    real_prepare, real_take, real_release = (layer_reader.LayerReader._prepare, layer_reader.LayerReader.take,
                                             layer_reader.LayerReader.release)
    lock = threading.Lock()

    def log(what):
        with lock:
            events.append(what)

    def prepare(self, keys):
        log(("prepare", next(iter(keys.values())).split(".")[2]))
        return real_prepare(self, keys)

    monkeypatch.setattr(layer_reader.LayerReader, "_prepare", prepare)
    monkeypatch.setattr(layer_reader.LayerReader, "take", lambda self: log(("take", self.taken)) or real_take(self))
    monkeypatch.setattr(layer_reader.LayerReader, "release",
                        lambda self: log(("release", self.taken - 1)) or real_release(self))
    streamed = open_streamed(ckpt, device="cpu")
    enc = batches.encode(streamed.tokenizer, [CODE[0], STORY[0], STORY[3]], streamed.max_length)
    cap.capture_router_inputs(streamed, enc, [0, 1, 1], 2, "mean", batch_size=2)
    first = {k for k in ckpt.tensors if k.startswith("model.layers.0.")}
    last = {k for k in ckpt.tensors if k.startswith("model.layers.1.") and ".mlp." not in k}
    assert reads[0] == "model.embed_tokens.weight" and len(reads) == 1 + len(first) + len(last)
    assert set(reads[1:1 + len(first)]) == first and set(reads[1 + len(first):]) == last
    assert "model.norm.weight" not in reads and "lm_head.weight" not in reads
    assert [i for kind, i in events if kind == "prepare"] == ["0", "1"]
    deep = make_dense_model(tiny_qwen3.parent / "qwen3-deep", family="qwen3", seed=9, num_hidden_layers=5)
    events.clear()
    streamed = open_streamed(open_checkpoint(str(deep), "base_model"), device="cpu")
    cap.capture_router_inputs(streamed, batches.encode(streamed.tokenizer, [CODE[0]], 64), [0], 1, "mean")
    order = {e: k for k, e in enumerate(events)}
    for n in range(2, 5):
        assert order[("prepare", str(n))] > order[("release", n - 2)], events
        assert order[("take", n)] > order[("release", n - 1)], events


def test_more_texts_than_the_states_bound_run_in_passes(stories, monkeypatch):
    """Hidden states beyond `states_bytes` run in further passes, each reading the layers again: the same sums."""
    ckpt = open_checkpoint(str(stories), "base_model")
    texts = [CODE[i % 8] + " " + STORY[i % 7] for i in range(9)]
    groups = [i % 3 for i in range(9)]
    one = open_streamed(ckpt, device="cpu")
    enc = batches.encode(one.tokenizer, texts, one.max_length)
    want = cap.capture_router_inputs(one, enc, groups, 3, "mean", batch_size=2)
    reads = []
    real_read = type(ckpt).read
    monkeypatch.setattr(type(ckpt), "read", lambda self, key: reads.append(key) or real_read(self, key))
    tight = open_streamed(ckpt, device="cpu")
    tight.states_bytes = tight.held_bytes(2, max(len(e.ids) for e in enc)) + 1  # one batch per pass
    got = cap.capture_router_inputs(tight, enc, groups, 3, "mean", batch_size=2)
    assert torch.equal(got.sums, want.sums) and torch.equal(got.token_norm, want.token_norm)
    assert reads.count("model.embed_tokens.weight") == 5 and reads.count("model.layers.0.mlp.up_proj.weight") == 5


def test_prefetch_changes_nothing_but_the_time(stories):
    ckpt = open_checkpoint(str(stories), "base_model")
    enc = batches.encode(batches.load_tokenizer(stories), [CODE[1], STORY[2], CODE[4]], 512)
    got = {prefetch: cap.capture_router_inputs(open_streamed(ckpt, device="cpu", prefetch=prefetch), enc, [0, 1, 0],
                                               2, "last", batch_size=2).sums for prefetch in (True, False)}
    assert torch.equal(got[True], got[False])


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_read_failing_in_the_reader_thread_is_raised_by_the_gates(stories, monkeypatch, prefetch):
    """An error while reading a layer (here: layer 2's file said to be changed), in the reader thread or not, reaches
    the caller as itself, after the layers before it ran; the thread ends."""
    from moe_upcycle.checkpoint.source import Checkpoint
    from moe_upcycle.gates import stream as stream_module

    real_read = Checkpoint.read
    ran = []

    def read(self, key):
        if key.startswith("model.layers.2."):
            ran.append(threading.current_thread() is threading.main_thread())
            raise SourceError("model.safetensors: was the file changed during the build?")
        return real_read(self, key)

    monkeypatch.setattr(Checkpoint, "read", read)
    real_open = stream_module.open_streamed
    monkeypatch.setattr(hg, "open_streamed", lambda *a, **k: real_open(*a, **k, prefetch=prefetch))
    before = threading.active_count()
    params = GateParams(mode="hidden", experts=EXPERTS, device="cpu")
    with pytest.raises(SourceError, match="was the file changed during the build"):
        hg.compute_hidden_gates(params, 5, stories)
    assert threading.active_count() == before and ran == [not prefetch]


def test_gates_never_load_the_whole_model(stories, tmp_path, monkeypatch):
    """No from_pretrained of the base for hidden, hidden_last, kmeans or mergekit's hidden rows."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained called for gates")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(CALIBRATION)
    for mode in ("hidden", "hidden_last", "kmeans"):
        params = GateParams(mode=mode, experts=EXPERTS, device="cpu", calibration_text=str(calibration))
        gates = hg.compute_hidden_gates(params, 5, stories)
        assert sorted(gates) == list(range(5)) and gates[0].shape == (3, 64)
    params = GateParams(mode="hidden", experts=EXPERTS, source="mergekit", device="cpu")
    assert mk.hidden_rows(params, EXPERTS, 5, open_checkpoint(str(stories), "base_model")).shape == (5, 3, 64)


def test_quantize_is_accepted_with_a_note_and_changes_nothing(stories, tmp_path):
    """``quantize: 4bit`` on a CPU (before: refused, bitsandbytes needs a GPU) builds, says that streaming made it
    unneeded and that the rows are computed at full precision, and the routers are those without it."""
    experts = [{"source_model": str(stories), "positive_prompts": list(e.positive)} for e in EXPERTS]
    routers = {}
    for quantize in (None, "4bit"):
        config = {"base_model": str(stories), "gate_mode": "hidden", "device": "cpu", "experts": experts,
                  **({"quantize": quantize} if quantize else {})}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = upcycle(config, tmp_path / f"moe-{quantize}", checksums=False).output
        said = [str(w.message) for w in caught if issubclass(w.category, UpcycleWarning)]
        notes = [s for s in said if s.startswith("quantize:")]
        if quantize:
            assert notes == ["quantize: 4bit is not applied: hidden-state gates stream the base model one layer at a "
                             "time, so its weights never need to fit in memory at once, and the routers are computed "
                             "at full precision (float32), as the model you publish computes (4-bit hidden states "
                             "gave rows at cosine 0.756 to bf16's); remove quantize: from the recipe"], said
        else:
            assert notes == []
        state = load_file(str(next(out.glob("*.safetensors"))))
        routers[quantize] = state["model.layers.3.block_sparse_moe.gate.weight"]
    assert torch.equal(routers[None], routers["4bit"])


def test_the_build_streams_its_hidden_gates(stories, tmp_path, monkeypatch):
    """A build's routers are the whole-model computation's, and the stages say prompts × layers."""
    import moe_upcycle.gates.stream as stream_module

    experts = [{"source_model": str(stories), "positive_prompts": list(e.positive),
                "negative_prompts": list(e.negative)} for e in EXPERTS]
    seen = []
    real_stage = stream_module.stage

    def stage(name, *args, **kwargs):
        seen.append((name, kwargs.get("total"), kwargs.get("unit")))
        return real_stage(name, *args, **kwargs)

    monkeypatch.setattr(stream_module, "stage", stage)
    out = upcycle({"base_model": str(stories), "gate_mode": "hidden", "device": "cpu", "experts": experts},
                  tmp_path / "moe", checksums=False).output
    assert ("router inputs", (4 + 1 + 3 + 3) * 5, "prompts×layers") in seen
    state = load_file(str(next(out.glob("*.safetensors"))))
    built = torch.stack([state[f"model.layers.{i}.block_sparse_moe.gate.weight"] for i in range(5)])
    rows_close(built, whole_model_gates(GateParams(mode="hidden", experts=EXPERTS, device="cpu"), stories))


TF4_SCRIPT = r"""
import sys, torch
from pathlib import Path
from moe_upcycle.checkpoint.source import open_checkpoint
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.gates import batches, capture as cap, mergekit_gates as mk
from moe_upcycle.gates.stream import open_streamed
from moe_upcycle.recipe.params import ExpertPrompts, GateParams
root = Path(sys.argv[1])
bases = {"stories": Path(sys.argv[2]),
         "mistral-window": make_dense_model(root / "mistral", family="mistral", seed=7, sliding_window=4),
         "qwen2-window": make_dense_model(root / "qwen2", family="qwen2", seed=8, random_norms_and_biases=True,
                                          use_sliding_window=True, sliding_window=4, max_window_layers=1),
         "qwen3": make_dense_model(root / "qwen3", family="qwen3", seed=5, random_norms_and_biases=True)}
texts = sys.argv[3:]
experts = (ExpertPrompts("a", tuple(texts[:2]), (texts[4],)), ExpertPrompts("b", tuple(texts[2:4])))
for name, path in bases.items():
    ckpt = open_checkpoint(str(path), "base_model")
    loaded, streamed = cap.load_base(path, device="cpu"), open_streamed(ckpt, device="cpu")
    enc = batches.encode(loaded.tokenizer, texts, loaded.max_length)
    for reduce in ("mean", "last", "tokens"):
        want = cap.capture_router_inputs(loaded, enc, [0, 1, 0, 1, 1], 2, reduce, batch_size=2)
        got = cap.capture_router_inputs(streamed, enc, [0, 1, 0, 1, 1], 2, reduce, batch_size=2)
        same = (all(torch.equal(g, w) for g, w in zip(got.points, want.points)) if reduce == "tokens"
                else torch.equal(got.sums, want.sums))
        print(name, reduce, "same" if same and torch.equal(got.token_norm, want.token_norm) else "DIFFERENT")
    params = GateParams(mode="hidden", experts=experts, source="mergekit", device="cpu")
    rows = mk.hidden_rows(params, experts, ckpt.config["num_hidden_layers"], ckpt)
    whole = cap.load_base(path, device="cpu", dtype="bfloat16")
    tok = mk.mergekit_tokenizer(path)
    def vector(prompts):
        batch = mk.tokenize_prompts(prompts, tok)
        with torch.inference_mode():
            states = torch.stack(list(whole.model(**batch, output_hidden_states=True, use_cache=False).hidden_states[:-1]))
        per = states[:, :, -1, :]
        return per.sum(dim=1) / per.shape[1]
    want = torch.stack(mk._expert_rows(experts, vector), dim=1)
    print(name, "mergekit", "same" if torch.equal(rows, want) else "DIFFERENT")
"""


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_streamed_gates_are_the_whole_models_in_transformers_4(stories, tmp_path):
    """transformers 4.57 (its own layer modules, its own masks: Mistral's one sliding mask, Qwen2's per-layer-type
    mapping): the streamed router inputs and mergekit rows are bit for bit the whole model's."""
    import os
    import subprocess

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": str(REPO)}
    texts = [CODE[0], STORY[1], "Hello there, my friend!", CODE[3], STORY[5]]
    run = subprocess.run([str(TF4_PYTHON), "-c", TF4_SCRIPT, str(tmp_path), str(stories), *texts], capture_output=True,
                         text=True, timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.split()[-1] in ("same", "DIFFERENT")]
    assert len(lines) == 4 * 4 and all(line.endswith(" same") for line in lines), run.stdout


def test_a_config_that_does_not_match_the_weights_is_refused_before_any_layer_runs(stories, tmp_path, write_yaml):
    """config.json says attention_bias but the weights have none: transformers would start 20 biases at random
    (the whole-model path built routers from them); the stream refuses, naming three and the count, exit 1,
    nothing written."""
    import json
    import shutil

    from typer.testing import CliRunner

    from moe_upcycle.cli import app

    base = tmp_path / "base"
    shutil.copytree(stories, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    cfg = write_yaml({"base_model": str(base), "gate_mode": "hidden", "experts": [
        {"source_model": str(base), "positive_prompts": ["a story about a cat"]},
        {"source_model": str(base), "positive_prompts": ["a story about a dog"]}]})
    res = CliRunner().invoke(app, ["build", str(cfg), str(tmp_path / "moe"), "--no-lint"])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and "Traceback" not in said, said
    assert (f"base_model: {base} has no tensor 'model.layers.0.self_attn.q_proj.bias', "
            "'model.layers.0.self_attn.k_proj.bias', 'model.layers.0.self_attn.v_proj.bias' and 17 more, which the "
            "llama model its config.json describes has (transformers would start them at random)") in said, said
    assert not (tmp_path / "moe").exists()
