"""The research path on a GPU (issue 16): every init x {model on CUDA, spread CUDA + CPU} keeps its devices and
dtype, is deterministic per seed, trains, saves, reloads with dtype="auto" and generates; so does every output
architecture (Mixtral, Qwen2-MoE, Qwen3-MoE); gate capture on CUDA matches the CPU's. Run with ``pytest -m cuda``; every test skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPT_TEXT
from moe_upcycle.gates import batches, capture as cap
from moe_upcycle import upcycle_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

INITS = {
    "copy": "copy",
    "noise": {"method": "noise", "scale": 0.01},
    "drop": {"method": "drop", "ratio": 0.5},
    "split": {"method": "split", "granularity": 2, "shuffle": True},
}


def load_dense(folder, dtype, placement: str):
    """stories260K on the GPU (``cuda``) or spread: embeddings and layer 0 on the GPU, the rest on the CPU."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    if placement == "cuda":
        model = model.to("cuda")
    else:  # weights really on both devices (main_device cpu: nothing offloaded to meta): layer 0 on the GPU
        device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": "cpu", "lm_head": 0}
        device_map |= {f"model.layers.{i}": 0 if i == 0 else "cpu" for i in range(model.config.num_hidden_layers)}
        model = dispatch_model(model, device_map=device_map, main_device="cpu")
    return model, AutoTokenizer.from_pretrained(str(folder))


def logits(model, ids):
    with torch.inference_mode():
        return model.eval()(input_ids=ids).logits.float().cpu()


def close(actual, expected, rel):
    torch.testing.assert_close(actual, expected, atol=rel * float(expected.abs().max()), rtol=0)


def devices_of(model) -> dict[str, str]:
    return {n: str(p.device) for n, p in model.named_parameters()}


@pytest.mark.parametrize("placement", ["cuda", "spread"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("init", INITS)
def test_every_init_on_cuda_trains_saves_reloads_and_generates(stories, tmp_path, init, dtype, placement):
    from transformers import AutoModelForCausalLM

    dense, tok = load_dense(stories, dtype, placement)
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=3)
    again = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=3)
    # same dtype, each layer where the dense layer was
    assert {p.dtype for p in moe.parameters()} == {dtype}
    where = devices_of(moe)
    for layer in range(dense.config.num_hidden_layers):
        dense_dev = str(dense.model.layers[layer].mlp.gate_proj.weight.device)
        assert {d for n, d in where.items() if n.startswith(f"model.layers.{layer}.")} == {dense_dev}
    if placement == "cuda":
        assert set(where.values()) == {"cuda:0"}
    # deterministic per seed on the device
    a, b = moe.state_dict(), again.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = tok(PROMPT_TEXT, return_tensors="pt")["input_ids"].to(dense.device if placement == "cuda" else "cpu")
    if init in ("copy", "split"):  # function-preserving inits: equal to the dense model on the device
        close(logits(moe, ids), logits(dense, ids), 1e-5 if dtype == torch.float32 else 3e-2)
    # one training step, then save -> from_pretrained(dtype="auto") -> the same logits and generations
    moe.train()(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(moe.parameters(), lr=0.05).step()
    moe.eval().save_pretrained(tmp_path / "trained")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype="auto", device_map="cuda")
    assert next(reloaded.parameters()).dtype == dtype
    saved, trained = reloaded.state_dict(), moe.state_dict()  # the very values trained, wherever they were
    assert all(torch.equal(saved[k].cpu(), trained[k].cpu()) for k in trained)
    ids_gpu = ids.to("cuda")
    if placement == "cuda":  # the same kernels: the same logits
        close(logits(reloaded, ids_gpu), logits(moe, ids), 1e-5 if dtype == torch.float32 else 3e-2)
    else:  # spread, in-memory layers 1.. ran on the CPU: reloaded onto the same devices, the same logits
        from accelerate import dispatch_model

        again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype="auto")
        again = dispatch_model(again, device_map=moe.hf_device_map, main_device="cpu")
        close(logits(again, ids), logits(moe, ids), 1e-5 if dtype == torch.float32 else 3e-2)
    with torch.inference_mode():
        out = reloaded.generate(input_ids=ids_gpu, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape == (1, ids.shape[1] + 8)


@pytest.mark.parametrize("family, architecture", [("stories", "mixtral"), ("stories", "qwen2_moe"),
                                                  ("qwen3", "qwen3_moe")])
def test_every_output_architecture_on_cuda_round_trips(stories, tmp_path, family, architecture, device="cuda"):
    """Each output architecture a dense family can become, from a bf16 model on the GPU: parameters stay on the GPU
    in bf16, copy experts give the dense logits, one step trains, and save -> from_pretrained(dtype="auto") gives the
    same weights, the same logits and generates."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle.checkpoint.tiny import make_dense_model

    folder = stories if family == "stories" else make_dense_model(tmp_path / family, family=family, seed=0)
    dense = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor([[1, 403, 257, 118, 30, 37, 13, 400, 267, 94]], device=device) % dense.config.vocab_size
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, architecture=architecture, seed=0)
    assert type(moe).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                  "qwen3_moe": "Qwen3MoeForCausalLM"}[architecture]
    assert {(p.device.type, p.dtype) for p in moe.parameters()} == {(device, torch.bfloat16)}
    close(logits(moe, ids), logits(dense, ids), 3e-2)
    moe.train()(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(moe.parameters(), lr=0.05).step()
    moe.eval().save_pretrained(tmp_path / "trained")
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype="auto").to(device).eval()
    assert type(back) is type(moe)
    saved, trained = back.state_dict(), moe.state_dict()
    assert all(torch.equal(saved[k], trained[k]) for k in trained)
    close(logits(back, ids), logits(moe, ids), 1e-2)
    with torch.inference_mode():
        out = back.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 4)


@pytest.mark.parametrize("init", ["noise", "drop", "split"])
def test_random_inits_on_cuda_are_drawn_on_the_gpu_and_depend_on_the_seed(stories, init):
    dense, _ = load_dense(stories, torch.bfloat16, "cuda")
    a = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=1).state_dict()
    b = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=2).state_dict()
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert a[key].device.type == "cuda" and not torch.equal(a[key], b[key])


def test_gate_capture_on_cuda_matches_cpu(stories):
    from moe_upcycle.checkpoint.source import open_checkpoint
    from moe_upcycle.gates.stream import open_streamed

    texts = ["Once upon a time there was a cat.", "The dog ran to the park.", "Lily had a red ball.", "Tom was sad."]
    groups = [0, 0, 1, 1]
    ckpt = open_checkpoint(str(stories), "base_model")
    cpu = open_streamed(ckpt, device="cpu", dtype="float32")
    gpu = open_streamed(ckpt, device="cuda", dtype="float32")
    enc = batches.encode(cpu.tokenizer, texts, cpu.max_length)
    ref = cap.capture_router_inputs(cpu, enc, groups, 2, "mean", batch_size=3)
    got = cap.capture_router_inputs(gpu, enc, groups, 2, "mean", batch_size=3)
    assert got.sums.device.type == "cpu" and got.sums.shape == ref.sums.shape
    close(got.sums, ref.sums, 1e-4)
    close(got.token_norm, ref.token_norm, 1e-4)
    last_ref = cap.capture_router_inputs(cpu, enc, groups, 2, "last", batch_size=3)
    last_gpu = cap.capture_router_inputs(gpu, enc, groups, 2, "last", batch_size=3)
    close(last_gpu.sums, last_ref.sums, 1e-4)
    pts_ref = cap.capture_router_inputs(cpu, enc, groups, 2, "tokens", batch_size=3).points
    pts_gpu = cap.capture_router_inputs(gpu, enc, groups, 2, "tokens", batch_size=3).points
    assert [p.shape for p in pts_gpu] == [p.shape for p in pts_ref]
    for p, r in zip(pts_gpu, pts_ref):
        close(p, r, 1e-4)


def test_route_on_cuda_counts_what_the_cpu_counts(stories, tmp_path):
    """route on the GPU (bf16, counts made on the device) against the CPU (fp32): the same real tokens, every
    token counted once per layer, and the same top-1 expert for nearly every (token, layer) — bf16 may flip
    a near tie."""
    from moe_upcycle import upcycle
    from moe_upcycle.check.route import route
    from routing_prompts import CODE, STORY

    out = tmp_path / "moe"
    upcycle({"base_model": str(stories), "gate_mode": "hidden", "experts_per_token": 1, "device": "cpu",
             "experts": [{"source_model": str(stories), "name": "code", "positive_prompts": CODE},
                         {"source_model": str(stories), "name": "story", "positive_prompts": STORY}]}, out)
    cpu = route(out, CODE + STORY, device="cpu", batch_size=5)
    gpu = route(out, CODE + STORY, device="cuda", batch_size=5)
    assert gpu.top1.device.type == "cpu" and torch.equal(gpu.tokens, cpu.tokens)
    assert torch.equal(gpu.top1.sum(dim=2), cpu.top1.sum(dim=2))
    assert torch.equal(gpu.topk.sum(dim=1), cpu.topk.sum(dim=1))
    same = torch.minimum(gpu.top1, cpu.top1).sum() / cpu.top1.sum()
    assert same >= 0.9, float(same)


def test_streamed_gates_on_cuda_match_the_whole_model_on_cuda(stories, tmp_path):
    """Hidden-state gates stream the base on the GPU (layers copied from pinned memory on a side stream, one ahead):
    the router inputs are those of transformers' whole model on the same GPU (`gate_oracle`: each text alone, the
    input of each layer's MLP), in fp32 and bf16, with and without the reader thread (bit for bit between those two:
    the same kernels on the same data)."""
    import gate_oracle as oracle
    from moe_upcycle.checkpoint.source import open_checkpoint
    from moe_upcycle.gates.stream import open_streamed

    texts = ["Once upon a time there was a cat.", "The dog ran to the park.", "Lily had a red ball.", "Tom was sad.",
             "def add(a, b): return a + b"]
    groups = [0, 0, 1, 1, 0]
    ckpt = open_checkpoint(str(stories), "base_model")
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = oracle.load_dense(stories, getattr(torch, dtype))
        per_text = [oracle.router_inputs(model.to("cuda"), tokenizer, t) for t in texts]  # text -> layer -> (T, H)
        enc = batches.encode(tokenizer, texts, 512)
        for reduce in ("mean", "last", "tokens"):
            got = {prefetch: cap.capture_router_inputs(open_streamed(ckpt, "cuda", dtype, prefetch=prefetch), enc,
                                                       groups, 2, reduce, batch_size=2) for prefetch in (True, False)}
            rel = 1e-5 if dtype == "float32" else 1e-2
            if reduce == "tokens":
                for layer, (a, b) in enumerate(zip(got[True].points, got[False].points)):
                    assert torch.equal(a, b) and a.device.type == "cpu"
                    want = torch.cat([p[layer] for p in per_text]).float()
                    close(a.sort(dim=0).values, want.sort(dim=0).values, rel)  # the same tokens, in any order
                continue
            vec = [[x.mean(dim=0) if reduce == "mean" else x[-1] for x in p] for p in per_text]
            want = torch.stack([torch.stack([sum(vec[i][layer] for i, g in enumerate(groups) if g == k)
                                             for k in (0, 1)]) for layer in range(5)]).float()
            assert torch.equal(got[True].sums, got[False].sums) and got[True].sums.device.type == "cpu"
            close(got[True].sums, want, rel)


def test_streamed_mergekit_rows_on_cuda_are_the_whole_models(stories):
    """gate_source: mergekit on the GPU: bf16, left padding, each layer's input: the bytes of mergekit's algorithm
    on transformers' whole model on the same GPU (`mergekit_reference`)."""
    import mergekit_reference as reference
    from moe_upcycle.checkpoint.source import open_checkpoint
    from moe_upcycle.gates import mergekit_gates as mk
    from moe_upcycle.recipe.params import ExpertPrompts, GateParams

    experts = tuple(ExpertPrompts(f"e{i}", tuple(e["positive_prompts"]), tuple(e.get("negative_prompts", ())))
                    for i, e in enumerate(reference.PUBLISHED_4X))
    want = reference.gate_params(stories, reference.PUBLISHED_4X, "hidden", torch.bfloat16, "cuda")
    params = GateParams(mode="hidden", experts=experts, source="mergekit", device="cuda")
    got = mk.hidden_rows(params, experts, 5, open_checkpoint(str(stories), "base_model"))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_streamed_gates_hold_two_layers_on_the_gpu(tmp_path):
    """GPU memory while streaming an 8-layer model: the layer running, the one arriving and the prompts' activations
    — well under the whole model."""
    from moe_upcycle.checkpoint.source import open_checkpoint
    from moe_upcycle.checkpoint.tiny import make_dense_model
    from moe_upcycle.gates.stream import open_streamed

    folder = make_dense_model(tmp_path / "deep", family="llama", seed=0, hidden_size=512, intermediate_size=1536,
                              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    ckpt = open_checkpoint(str(folder), "base_model")
    layer = sum(t.nbytes for k, t in ckpt.tensors.items() if k.startswith("model.layers.0.")) // 2  # fp32 -> bf16
    whole = sum(t.nbytes for t in ckpt.tensors.values()) // 2
    streamed = open_streamed(ckpt, "cuda", "bfloat16")
    enc = batches.encode(streamed.tokenizer, ["def add(a, b): return a + b"] * 4, 256)
    cap.capture_router_inputs(streamed, enc, [0, 1, 0, 1], 2, "mean", batch_size=2)  # cuBLAS workspaces, once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    cap.capture_router_inputs(streamed, enc, [0, 1, 0, 1], 2, "mean", batch_size=2)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 3 * layer + (8 << 20) < whole, (peak, layer, whole)
