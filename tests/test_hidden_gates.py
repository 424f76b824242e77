"""Hidden-state gates: the hooks capture the true router input, padding does not matter, modes differ.

References are written here or in `gate_oracle` (the dense model loaded whole with transformers, each prompt alone),
never the product's gate code."""

from __future__ import annotations

import pytest
import torch

import gate_oracle as oracle
from moe_upcycle.checkpoint.source import open_checkpoint
from moe_upcycle.gates import batches, capture as cap
from moe_upcycle.gates import hidden_gates as hg
from moe_upcycle.gates.device import resolve_device
from moe_upcycle.gates.stream import open_streamed
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import ConfigError, DependencyError, UpcycleWarning
from moe_upcycle.recipe.resolve import expert_prompts, gate_params
from tolerances import assert_close_rel
from routing_prompts import CODE, STORY

F = torch.nn.functional


@pytest.fixture(scope="module")
def streamed(stories):
    return open_streamed(open_checkpoint(str(stories), "base_model"), device="cpu")


@pytest.fixture(scope="module")
def whole(stories):
    """(model, tokenizer) as transformers loads them whole: the oracle's."""
    return oracle.load_dense(stories)


def _experts(stories, **extra):
    cfg = load_config({"base_model": str(stories), "gate_mode": "hidden", "experts": [
        {"source_model": str(stories), "name": "code", "positive_prompts": CODE[:5], **extra},
        {"source_model": str(stories), "name": "story", "positive_prompts": STORY[:4]}]})
    return cfg.expert_list()


def _reference_means(whole, prompts):
    """Router inputs rebuilt independently: one prompt at a time, no padding, the input of each layer's MLP; mean
    over non-special tokens, then over prompts. Returns (L, H) float64."""
    model, tokenizer = whole
    return oracle.prompt_vectors(model, tokenizer, prompts).mean(dim=1)


def test_captured_router_input_equals_the_mlps_input(streamed, whole, stories):
    experts = _experts(stories)
    own, _, inputs = hg.prompt_router_inputs(streamed, expert_prompts(experts), "mean", batch_size=3)
    for e, expert in enumerate(experts):
        expected = _reference_means(whole, expert.positive_prompts)
        assert_close_rel(own[:, e].double(), expected)
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
def test_padding_does_not_change_the_vector(streamed, side, reduce):
    short = "The cat sat."
    batch = [short, STORY[2], CODE[6], STORY[5] + " " + STORY[6]]
    enc_alone = batches.encode(streamed.tokenizer, [short], streamed.max_length)
    enc_batch = batches.encode(streamed.tokenizer, batch, streamed.max_length)
    alone = cap.capture_router_inputs(streamed, enc_alone, [0], 1, reduce, batch_size=1).sums[:, 0]
    padded = cap.capture_router_inputs(streamed, enc_batch, [0, 1, 1, 1], 2, reduce, batch_size=4,
                                      padding_side=side).sums[:, 0]
    assert len(enc_batch[3].ids) > 2 * len(enc_alone[0].ids)  # the short prompt really is padded
    assert_close_rel(padded, alone)


@pytest.mark.parametrize("reduce", ["mean", "last", "tokens"])
def test_each_batch_goes_to_the_device_in_one_copy(streamed, whole, monkeypatch, reduce):
    """A host-to-device copy costs the host as much as a launch (pinning, queueing, an event): a batch's ids, mask,
    positions, real-token mask and group indices go in one buffer, whatever is reduced."""
    copies = []
    real_to_device = batches.to_device
    monkeypatch.setattr(batches, "to_device", lambda t, d: copies.append(tuple(t.shape)) or real_to_device(t, d))
    texts = [STORY[2], CODE[6], "The cat sat.", STORY[5], CODE[1]]
    enc = batches.encode(streamed.tokenizer, texts, streamed.max_length)
    got = cap.capture_router_inputs(streamed, enc, [0, 1, 0, 1, 1], 2, reduce, batch_size=2)
    assert len(copies) == 3, copies  # 5 texts in batches of 2
    order = sorted(range(5), key=lambda i: len(enc[i].ids))
    for start, shape in zip(range(0, 5, 2), copies):
        rows = order[start:start + 2]
        width = max(len(enc[i].ids) for i in rows)
        assert shape == (4 * len(rows) * width + (len(rows) if reduce != "tokens" else 0),), (shape, rows)
    if reduce == "mean":  # and the sums are the texts' own, each through the whole model alone
        alone = oracle.prompt_vectors(*whole, texts)  # (L, N, H)
        assert_close_rel(got.sums[:, 0].double(), alone[:, 0] + alone[:, 2])
        assert_close_rel(got.sums[:, 1].double(), alone[:, 1] + alone[:, 3] + alone[:, 4])


def test_negative_prompts_move_the_vector(streamed, stories):
    plain = _experts(stories)
    with_neg = _experts(stories, negative_prompts=STORY[6:9])
    own, neg, _ = hg.prompt_router_inputs(streamed, expert_prompts(with_neg), "mean", batch_size=8)
    own_plain, neg_plain, _ = hg.prompt_router_inputs(streamed, expert_prompts(plain), "mean", batch_size=8)
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


def test_hidden_last_differs_from_hidden(streamed, whole, stories):
    experts = _experts(stories)
    mean, _, _ = hg.prompt_router_inputs(streamed, expert_prompts(experts), "mean", batch_size=4)
    last, _, _ = hg.prompt_router_inputs(streamed, expert_prompts(experts), "last", batch_size=4)
    cos = F.cosine_similarity(mean, last, dim=-1)  # (L, E)
    assert cos.max() < 0.98
    # hidden_last of one prompt is its last real token's router input (the whole model's MLP input there)
    model, tokenizer = whole
    ref = torch.stack([x[-1] for x in oracle.router_inputs(model, tokenizer, CODE[0])])
    enc = batches.encode(streamed.tokenizer, [CODE[0]], streamed.max_length)
    got = cap.capture_router_inputs(streamed, enc, [0], 1, "last", batch_size=1).sums[:, 0]
    assert_close_rel(got.double(), ref, rel=1e-06)


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


def test_gate_center_removes_shared_component(streamed, stories):
    experts = _experts(stories)
    own, _, inputs = hg.prompt_router_inputs(streamed, expert_prompts(experts), "mean", batch_size=8)
    centered = hg.gate_rows(own, own, inputs.token_norm, center=True, scale=1.0)
    plain = hg.gate_rows(own, own, inputs.token_norm, center=False, scale=1.0)
    assert torch.allclose(centered.norm(dim=-1), torch.ones(5, 2), atol=1e-5)
    # two centred experts are opposite; uncentred rows share most of their direction
    assert_close_rel(centered[:, 0], -centered[:, 1])
    assert F.cosine_similarity(plain[:, 0], plain[:, 1], dim=-1).min() > 0.5


def test_cuda_requested_without_gpu_is_a_clear_error(stories, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DependencyError, match=r"device: 'cuda:1' .* use device: cpu"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == "cpu"


def test_prompt_with_only_special_tokens_is_named(streamed):
    with pytest.raises(ConfigError, match="'<s>' has no tokens besides special tokens"):
        batches.encode(streamed.tokenizer, ["<s>"], streamed.max_length)


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
def test_gpu_bf16_gates_match_cpu(stories, streamed):
    experts = _experts(stories)
    cpu = streamed
    gpu = open_streamed(open_checkpoint(str(stories), "base_model"), device="cuda")
    assert gpu.skeleton.dtype == torch.bfloat16 and gpu.device.type == "cuda"
    own_cpu, _, _ = hg.prompt_router_inputs(cpu, expert_prompts(experts), "mean", batch_size=4)
    own_gpu, _, _ = hg.prompt_router_inputs(gpu, expert_prompts(experts), "mean", batch_size=4)
    assert own_gpu.device.type == "cpu"  # sums come back to the CPU
    assert F.cosine_similarity(own_cpu, own_gpu, dim=-1).min() > 0.99


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_explicit_index_and_fp32(stories):
    gpu = open_streamed(open_checkpoint(str(stories), "base_model"), device="cuda:0", dtype="float32")
    assert gpu.skeleton.dtype == torch.float32
    assert gpu.device == torch.device("cuda", 0)


def test_hidden_avg_is_an_alias_of_hidden(stories):
    experts = [e.model_dump(exclude_none=True) for e in _experts(stories)]
    gates = {mode: hg.compute_hidden_gates(gate_params(load_config({"base_model": str(stories), "gate_mode": mode,
                                                        "device": "cpu", "experts": experts})), 5, stories)
             for mode in ("hidden", "hidden_avg")}
    for layer in range(5):
        assert torch.equal(gates["hidden"][layer], gates["hidden_avg"][layer])


def test_a_prompt_cut_at_the_models_context_is_said(streamed):
    """A prompt longer than max_position_embeddings is cut there, as before, and now a warning says so (naming its
    recipe field and both lengths); a prompt that fits says nothing."""
    long = "once upon a time there was a little cat " * 200
    with pytest.warns(UpcycleWarning) as said:
        encoded = batches.encode(streamed.tokenizer, [long, "a short one"], streamed.max_length,
                             fields=["experts[0].positive_prompts", "experts[1].positive_prompts"])
    assert len(encoded[0].ids) == streamed.max_length and len(said) == 1
    text = str(said[0].message)
    assert text.startswith("experts[0].positive_prompts: prompt 'once upon a time there was a little cat '... has ")
    assert text.endswith(f"tokens; only its first {streamed.max_length} (the model's max_position_embeddings) are used")
