"""Hidden-state gates: the hooks capture the true router input, padding does not matter, modes differ."""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_upcycle.gates import batches, capture as cap
from moe_upcycle.gates import hidden_gates as hg
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import ConfigError, DependencyError, UpcycleWarning
from moe_upcycle.recipe.resolve import expert_prompts, gate_params
from tolerances import assert_close_rel
from routing_prompts import CODE, STORY

F = torch.nn.functional


@pytest.fixture(scope="module")
def loaded(stories):
    return cap.load_base(stories, device="cpu")


def _experts(stories, **extra):
    cfg = load_config({"base_model": str(stories), "gate_mode": "hidden", "experts": [
        {"source_model": str(stories), "name": "code", "positive_prompts": CODE[:5], **extra},
        {"source_model": str(stories), "name": "story", "positive_prompts": STORY[:4]}]})
    return cfg.expert_list()


def _reference_means(loaded, prompts):
    """Router inputs rebuilt independently: one prompt at a time, no padding, capture the residual
    *entering* post_attention_layernorm and apply the model's own norm to it; mean over non-special
    tokens, then over prompts. Returns (L, H)."""
    special = set(loaded.tokenizer.all_special_ids)
    per_layer = [[] for _ in loaded.norms]
    for prompt in prompts:
        ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
        keep = torch.tensor([i not in special for i in ids[0].tolist()])
        residuals = {}
        handles = [norm.register_forward_pre_hook(lambda m, args, i=i: residuals.__setitem__(i, args[0]))
                   for i, norm in enumerate(loaded.norms)]
        with torch.inference_mode():
            loaded.model(input_ids=ids)
        for h in handles:
            h.remove()
        for i, norm in enumerate(loaded.norms):
            with torch.inference_mode():
                router_input = norm(residuals[i])[0]  # (T, H): the model's own RMSNorm on the residual
            per_layer[i].append(router_input[keep].mean(dim=0))
    return torch.stack([torch.stack(v).mean(dim=0) for v in per_layer])


def test_captured_router_input_equals_norm_of_residual(loaded, stories):
    experts = _experts(stories)
    own, _, inputs = hg.prompt_router_inputs(loaded, expert_prompts(experts), "mean", batch_size=3)
    for e, expert in enumerate(experts):
        expected = _reference_means(loaded, expert.positive_prompts)
        assert_close_rel(own[:, e], expected)
    # the gate rows the build writes are these vectors, normalised and scaled
    cfg = load_config({"base_model": str(stories), "gate_mode": "hidden", "device": "cpu", "batch_size": 4,
                       "experts": [e.model_dump(exclude_none=True) for e in experts]})
    gates = hg.compute_hidden_gates(gate_params(cfg), 5, stories)
    for layer in range(5):
        for e, expert in enumerate(experts):
            assert F.cosine_similarity(gates[layer][e], own[layer, e], dim=0) > 1 - 1e-6
    assert inputs.token_norm.shape == (5,) and (inputs.token_norm > 1).all()


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("reduce", ["mean", "last"])
def test_padding_does_not_change_the_vector(loaded, side, reduce):
    short = "The cat sat."
    batch = [short, STORY[2], CODE[6], STORY[5] + " " + STORY[6]]
    enc_alone = batches.encode(loaded.tokenizer, [short], loaded.max_length)
    enc_batch = batches.encode(loaded.tokenizer, batch, loaded.max_length)
    alone = cap.capture_router_inputs(loaded, enc_alone, [0], 1, reduce, batch_size=1).sums[:, 0]
    padded = cap.capture_router_inputs(loaded, enc_batch, [0, 1, 1, 1], 2, reduce, batch_size=4,
                                      padding_side=side).sums[:, 0]
    assert len(enc_batch[3].ids) > 2 * len(enc_alone[0].ids)  # the short prompt really is padded
    assert_close_rel(padded, alone)


@pytest.mark.parametrize("held", ["all layers", "a few layers", "one layer"])
@pytest.mark.parametrize("reduce", ["mean", "last", "tokens"])
def test_layers_reduced_together_as_on_a_gpu_give_the_per_layer_results(loaded, monkeypatch, reduce, held):
    """On a GPU consecutive layers' router inputs are held and reduced together (fewer launches); run here on the
    CPU, whatever the number of layers held at once, the sums, norms and token points are those of one layer at a
    time, and nothing is left held between batches."""
    texts = [STORY[2], CODE[6], "The cat sat.", STORY[5], CODE[1]]
    enc = batches.encode(loaded.tokenizer, texts, loaded.max_length)
    ref = cap.capture_router_inputs(loaded, enc, [0, 1, 0, 1, 1], 2, reduce, batch_size=2)
    # one layer's router input is 2 texts x 38..43 tokens x 64 x 4 bytes (19-22 KB): 40 KB holds 2 or 3 of the 5
    budget = {"all layers": 64 << 20, "a few layers": 40_000, "one layer": 1}[held]
    monkeypatch.setattr(cap, "_EACH_LAYER_ON", frozenset())
    monkeypatch.setattr(cap, "_PENDING_BYTES", budget)
    got = cap.capture_router_inputs(loaded, enc, [0, 1, 0, 1, 1], 2, reduce, batch_size=2)
    assert got.sums.shape == ref.sums.shape and got.token_norm.shape == (5,)
    torch.testing.assert_close(got.sums, ref.sums, rtol=0, atol=1e-5 * float(ref.sums.abs().max()) if ref.sums.numel() else 0)
    torch.testing.assert_close(got.token_norm, ref.token_norm, rtol=1e-6, atol=0)
    if reduce == "tokens":
        assert [p.shape for p in got.points] == [p.shape for p in ref.points]
        for p, r in zip(got.points, ref.points):
            torch.testing.assert_close(p, r, rtol=0, atol=1e-5 * float(r.abs().max()))


def test_on_a_gpu_the_capture_adds_operations_per_batch_not_per_layer(loaded, monkeypatch):
    """At small batches a GPU forward is bound by kernel launches: holding the layers' router inputs keeps the
    capture's extra operations (counted at torch's dispatcher, views left out: one per launch) the same for 2
    layers and for 8, about 6 per batch; reduced layer by layer they grow by about 8 with every layer."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM, LlamaConfig

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += not func.is_view  # a view launches nothing
            return func(*args, **(kwargs or {}))

    def ops(fn) -> int:
        Count.ops = 0
        with Count():
            fn()
        return Count.ops

    texts = [STORY[2], CODE[6], "The cat sat.", STORY[5], CODE[1], STORY[3]]
    enc = batches.encode(loaded.tokenizer, texts, loaded.max_length)
    n_batches = 3  # batch_size 2
    monkeypatch.setattr(cap, "_EACH_LAYER_ON", frozenset())  # as on a GPU
    extra = {}
    for layers in (2, 8):
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=loaded.model.config.vocab_size)
        model = AutoModelForCausalLM.from_config(config).eval()
        tiny = cap.LoadedModel(model, loaded.tokenizer, [b.post_attention_layernorm for b in model.model.layers],
                               torch.device("cpu"), loaded.max_length)

        def plain():  # the same batches, no hooks, stopped nowhere
            order = sorted(range(len(enc)), key=lambda i: len(enc[i].ids))
            with torch.inference_mode():
                for start in range(0, len(order), 2):
                    ids, attn, _ = batches.pad_batch([enc[i] for i in order[start:start + 2]], 0, "right")
                    model.model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp_min(0),
                                use_cache=False)

        base = ops(plain)
        held = ops(lambda: cap.capture_router_inputs(tiny, enc, [0, 1, 0, 1, 1, 0], 2, "mean", batch_size=2))
        monkeypatch.setattr(cap, "_PENDING_BYTES", 0)
        alone = ops(lambda: cap.capture_router_inputs(tiny, enc, [0, 1, 0, 1, 1, 0], 2, "mean", batch_size=2))
        monkeypatch.setattr(cap, "_PENDING_BYTES", 64 << 20)
        extra[layers] = ((held - base) / n_batches, (alone - base) / n_batches)
    assert extra[8][0] == extra[2][0] <= 8, extra  # held: ~6 per batch (mask, sums, index), none per layer
    assert extra[8][1] >= extra[2][1] + 6 * 7, extra  # alone: ~8 more for each of the 6 more layers


@pytest.mark.parametrize("reduce", ["mean", "last", "tokens"])
def test_each_batch_goes_to_the_device_in_one_copy(loaded, monkeypatch, reduce):
    """A host-to-device copy costs the host as much as a launch (pinning, queueing, an event): a batch's ids, mask,
    positions, real-token mask and group indices go in one buffer, whatever is reduced."""
    copies = []
    real_to_device = batches.to_device
    monkeypatch.setattr(batches, "to_device", lambda t, d: copies.append(tuple(t.shape)) or real_to_device(t, d))
    texts = [STORY[2], CODE[6], "The cat sat.", STORY[5], CODE[1]]
    enc = batches.encode(loaded.tokenizer, texts, loaded.max_length)
    got = cap.capture_router_inputs(loaded, enc, [0, 1, 0, 1, 1], 2, reduce, batch_size=2)
    assert len(copies) == 3, copies  # 5 texts in batches of 2
    order = sorted(range(5), key=lambda i: len(enc[i].ids))
    for start, shape in zip(range(0, 5, 2), copies):
        rows = order[start:start + 2]
        width = max(len(enc[i].ids) for i in rows)
        assert shape == (4 * len(rows) * width + (len(rows) if reduce != "tokens" else 0),), (shape, rows)
    if reduce == "mean":  # and the sums are the texts' own
        alone = [cap.capture_router_inputs(loaded, [e], [0], 1, "mean", batch_size=1).sums[:, 0] for e in enc]
        assert_close_rel(got.sums[:, 0], alone[0] + alone[2])
        assert_close_rel(got.sums[:, 1], alone[1] + alone[3] + alone[4])


def test_negative_prompts_move_the_vector(loaded, stories):
    plain = _experts(stories)
    with_neg = _experts(stories, negative_prompts=STORY[6:9])
    own, neg, _ = hg.prompt_router_inputs(loaded, expert_prompts(with_neg), "mean", batch_size=8)
    own_plain, neg_plain, _ = hg.prompt_router_inputs(loaded, expert_prompts(plain), "mean", batch_size=8)
    assert_close_rel(own, own_plain)  # positives unchanged
    assert neg_plain.abs().max() == 0 and neg[:, 0].norm(dim=-1).min() > 1
    cfg = load_config({"base_model": str(stories), "gate_mode": "hidden", "device": "cpu",
                       "experts": [e.model_dump(exclude_none=True) for e in with_neg]})
    moved = hg.compute_hidden_gates(gate_params(cfg), 5, stories)
    for layer in range(5):
        direction = own[layer, 0] - neg[layer, 0]
        assert F.cosine_similarity(moved[layer][0], direction, dim=0) > 1 - 1e-6
        assert F.cosine_similarity(moved[layer][0], own[layer, 0], dim=0) < 0.9  # it really moved
        # the expert without negatives keeps its own direction
        assert F.cosine_similarity(moved[layer][1], own[layer, 1], dim=0) > 1 - 1e-6


def test_hidden_last_differs_from_hidden(loaded, stories):
    experts = _experts(stories)
    mean, _, _ = hg.prompt_router_inputs(loaded, expert_prompts(experts), "mean", batch_size=4)
    last, _, _ = hg.prompt_router_inputs(loaded, expert_prompts(experts), "last", batch_size=4)
    cos = F.cosine_similarity(mean, last, dim=-1)  # (L, E)
    assert cos.max() < 0.98
    # hidden_last of one prompt is exactly its last real token's router input
    enc = batches.encode(loaded.tokenizer, [CODE[0]], loaded.max_length)
    ref = {}
    handles = [n.register_forward_hook(lambda m, a, out, i=i: ref.__setitem__(i, out[0, -1].clone()))
               for i, n in enumerate(loaded.norms)]
    with torch.inference_mode():
        loaded.model(input_ids=torch.tensor([enc[0].ids]))
    for h in handles:
        h.remove()
    got = cap.capture_router_inputs(loaded, enc, [0], 1, "last", batch_size=1).sums[:, 0]
    assert_close_rel(got, torch.stack([ref[i] for i in range(5)]), rel=1e-06)


def test_default_scale_gives_decisive_unsaturated_gap():
    # two experts in 3-d: own means 2 units apart along x, token norm 2
    own = torch.tensor([[[1.0, 1.0, 0.0], [1.0, -1.0, 0.0]]])
    unit = F.normalize(own, dim=-1)
    scale = hg.default_scales(unit, own, torch.tensor([2.0]))
    logits = torch.einsum("leh,lfh->lef", own, unit * scale[:, None, None])
    assert logits[0, 0, 0] - logits[0, 0, 1] == pytest.approx(hg.DECISIVE_LOGIT_GAP, rel=1e-5)
    # nearly identical experts: the cap bounds any typical token's logit difference
    close = torch.tensor([[[1.0, 0.001, 0.0], [1.0, -0.001, 0.0]]])
    unit = F.normalize(close, dim=-1)
    scale = hg.default_scales(unit, close, torch.tensor([2.0]))
    spread = (unit[0, 0] - unit[0, 1]).norm()
    assert float(scale * spread * 2.0) == pytest.approx(hg.MAX_TOKEN_LOGIT_GAP, rel=1e-4)


def test_gate_center_removes_shared_component(loaded, stories):
    experts = _experts(stories)
    own, _, inputs = hg.prompt_router_inputs(loaded, expert_prompts(experts), "mean", batch_size=8)
    centered = hg.gate_rows(own, own, inputs.token_norm, center=True, scale=1.0)
    plain = hg.gate_rows(own, own, inputs.token_norm, center=False, scale=1.0)
    assert torch.allclose(centered.norm(dim=-1), torch.ones(5, 2), atol=1e-5)
    # two centred experts are opposite; uncentred rows share most of their direction
    assert_close_rel(centered[:, 0], -centered[:, 1])
    assert F.cosine_similarity(plain[:, 0], plain[:, 1], dim=-1).min() > 0.5


def no_bitsandbytes(monkeypatch):
    """bitsandbytes looks uninstalled; every other module is found as usual (transformers looks some up)."""
    find_spec = cap.importlib.util.find_spec
    monkeypatch.setattr(cap.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))


def test_quantize_without_bitsandbytes_is_a_clear_error(stories, monkeypatch):
    no_bitsandbytes(monkeypatch)
    with pytest.warns(UpcycleWarning, match="4bit"), pytest.raises(
            DependencyError, match=r"quantize: 4bit .* bitsandbytes.*pip install bitsandbytes .*pip install -e '\.\[quant\]'"):
        cap.load_base(stories, device="cpu", quantize="4bit")


def test_quantize_4bit_warns_that_its_gates_are_far_from_bf16(stories, monkeypatch):
    no_bitsandbytes(monkeypatch)
    with pytest.warns(UpcycleWarning, match=r"quantize: 4bit: .*far from bf16 .*min cosine 0\.756.*use quantize: 8bit"):
        with pytest.raises(DependencyError):
            cap.load_base(stories, device="cpu", quantize="4bit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 8bit: no such warning
        with pytest.raises(DependencyError):
            cap.load_base(stories, device="cpu", quantize="8bit")


def test_cuda_requested_without_gpu_is_a_clear_error(stories, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DependencyError, match=r"device: 'cuda:1' .* use device: cpu"):
        cap.resolve_device("cuda:1")
    assert cap.resolve_device("auto") == "cpu"


def test_prompt_with_only_special_tokens_is_named(loaded):
    with pytest.raises(ConfigError, match="'<s>' has no tokens besides special tokens"):
        batches.encode(loaded.tokenizer, ["<s>"], loaded.max_length)


@pytest.mark.parametrize("mode", ["hidden", "hidden_last", "hidden_avg"])
def test_special_only_prompts_are_named_by_field_before_the_weights_load(mode, stories, tmp_path, monkeypatch):
    """Every prompt the base tokenizer makes only special tokens of is named with its recipe field, all at
    once, before the base model's weights are loaded (minutes on a real model); nothing is written."""
    from moe_upcycle.build import upcycle

    monkeypatch.setattr(hg, "open_streamed", lambda *a, **k: pytest.fail("the weights were read before the refusal"))
    config = {"base_model": str(stories), "gate_mode": mode, "experts": [
        {"source_model": str(stories), "positive_prompts": ["write code", "</s>"]},
        {"source_model": str(stories), "positive_prompts": ["a story"], "negative_prompts": ["<s><s>"]}]}
    with pytest.raises(ConfigError) as info:
        upcycle(config, tmp_path / "moe")
    assert info.value.problems == [
        "experts[0].positive_prompts: prompt '</s>' has no tokens besides special tokens (['<s>', '</s>'] with the base "
        "model's tokenizer); write some text, e.g. a sentence of what this expert should see" + MERGEKIT_HINT,
        "experts[1].negative_prompts: prompt '<s><s>' has no tokens besides special tokens (['<s>', '<s>', '<s>'] "
        "with the base model's tokenizer); write some text, e.g. a sentence of what this expert should see"
        + MERGEKIT_HINT]
    assert not (tmp_path / "moe").exists() and list(tmp_path.iterdir()) == []
    # the hint holds: --mergekit (gate_source: mergekit) builds the same recipe
    monkeypatch.undo()
    built = upcycle({**config, "gate_source": "mergekit"}, tmp_path / "mk", verify=True)
    assert built.verify.ok, built.verify.problems


MERGEKIT_HINT = " (or build with --mergekit, which computes the routers as mergekit-moe does, special tokens included)"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_gates_match_cpu(stories):
    experts = _experts(stories)
    cpu = cap.load_base(stories, device="cpu")
    gpu = cap.load_base(stories, device="cuda")
    assert next(gpu.model.parameters()).dtype == torch.bfloat16 and gpu.input_device.type == "cuda"
    own_cpu, _, _ = hg.prompt_router_inputs(cpu, expert_prompts(experts), "mean", batch_size=4)
    own_gpu, _, _ = hg.prompt_router_inputs(gpu, expert_prompts(experts), "mean", batch_size=4)
    assert own_gpu.device.type == "cpu"  # sums come back to the CPU
    assert F.cosine_similarity(own_cpu, own_gpu, dim=-1).min() > 0.99


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_explicit_index_and_fp32(stories):
    gpu = cap.load_base(stories, device="cuda:0", dtype="float32")
    assert next(gpu.model.parameters()).dtype == torch.float32
    assert gpu.input_device == torch.device("cuda", 0)


def test_hidden_avg_is_an_alias_of_hidden(stories):
    experts = [e.model_dump(exclude_none=True) for e in _experts(stories)]
    gates = {mode: hg.compute_hidden_gates(gate_params(load_config({"base_model": str(stories), "gate_mode": mode,
                                                        "device": "cpu", "experts": experts})), 5, stories)
             for mode in ("hidden", "hidden_avg")}
    for layer in range(5):
        assert torch.equal(gates["hidden"][layer], gates["hidden_avg"][layer])


def test_a_prompt_cut_at_the_models_context_is_said(loaded):
    """A prompt longer than max_position_embeddings is cut there, as before, and now a warning says so (naming its
    recipe field and both lengths); a prompt that fits says nothing."""
    long = "once upon a time there was a little cat " * 200
    with pytest.warns(UpcycleWarning) as said:
        encoded = batches.encode(loaded.tokenizer, [long, "a short one"], loaded.max_length,
                             fields=["experts[0].positive_prompts", "experts[1].positive_prompts"])
    assert len(encoded[0].ids) == loaded.max_length and len(said) == 1
    text = str(said[0].message)
    assert text.startswith("experts[0].positive_prompts: prompt 'once upon a time there was a little cat '... has ")
    assert text.endswith(f"tokens; only its first {loaded.max_length} (the model's max_position_embeddings) are used")
