"""Outputs that llama.cpp can load and evaluate, checked without llama.cpp.

`llamacpp_qwen2moe` re-implements llama.cpp's qwen2moe FFN block in torch from the facts in
`moe_upcycle.planning.llamacpp` (softmax, top-k, no renormalisation, shared gate as silu(z)/z);
``scripts/check_llamacpp.py`` checks the same outputs against the real llama.cpp.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from moe_upcycle import upcycle
from moe_upcycle.planning.plan_report import parameter_counts
from moe_upcycle.planning.llamacpp import LLAMACPP, half_gate_value, verdict
from test_architectures import dense_tensor, tensor

REL = 1e-5  # fp32 logits, relative to max |logit|: summation order only


def _cfg(base, arch, k=2, experts=4, shared=(), routed_scale=None, **extra):
    expert = {"source_model": str(base)}
    if routed_scale is not None:
        expert["residual_scale"] = routed_scale
    cfg = {"base_model": str(base), "architecture": arch, "gate_mode": "random", "experts_per_token": k,
           "experts": [dict(expert) for _ in range(experts)], **extra}
    if shared:
        cfg["shared_experts"] = [{"source_model": str(base), "residual_scale": s} for s in shared]
    return cfg


def _shard_shapes(folder) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


@pytest.mark.parametrize("fixture,arch,shared,layout", [
    ("tiny_llama", "mixtral", (), "per_expert"),
    ("tiny_llama", "qwen2_moe", (), "per_expert"),
    ("tiny_qwen2", "qwen2_moe", (), "fused"),
    ("tiny_qwen2", "qwen2_moe", (1.0,), "per_expert"),
    ("tiny_qwen2", "qwen2_moe", (0.5, 0.5), "fused"),
    ("tiny_qwen3", "qwen3_moe", (), "per_expert"),
])
def test_no_output_tensor_is_empty(fixture, arch, shared, layout, request, tmp_path):
    """llama.cpp refuses a 0-wide shared expert ("wrong shape ... got 64, 0"); every tensor has elements."""
    base = request.getfixturevalue(fixture)
    result = upcycle(_cfg(base, arch, shared=shared, layout=layout), tmp_path / "moe")
    shapes = _shard_shapes(result.output)
    empty = {k: s for k, s in shapes.items() if not math.prod(s)}
    assert shapes and not empty, empty
    cfg = json.loads((result.output / "config.json").read_text())
    if arch == "qwen2_moe":
        width = 128 * len(shared) if shared else 1
        assert cfg["shared_expert_intermediate_size"] == width
        assert shapes["model.layers.1.mlp.shared_expert.down_proj.weight"] == (64, width)
    if arch == "qwen2_moe" and not shared:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert not tensor(result.output, f"model.layers.0.mlp.shared_expert.{proj}.weight").any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_gate_is_nonzero_in_its_dtype_and_a_half_for_large_inputs(dtype):
    v = half_gate_value(dtype)
    assert torch.tensor(v, dtype=dtype).item() == v != 0  # representable: not flushed to a zero gate
    # llama.cpp keeps the gate in f32 (1-D tensor) and computes z = g . x in f32
    x = torch.linspace(-3.0, 5.0, 4096) * 20  # sum(x) = 81920: far above a normed hidden state's
    z = (torch.full((4096,), v) * x).sum()
    assert z != 0
    half = F.silu(z) / z
    if dtype != torch.float16:
        assert torch.sigmoid(z) == 0.5 and half == 0.5
    else:  # 2^-24 * sum(x): the gate is 1/2 to a relative 2^-25 * |sum(x)|
        assert abs(float(half) - 0.5) <= 0.5 * 2.0 ** -25 * float(x.sum().abs()) + 1e-7


def llamacpp_qwen2moe(block, h: torch.Tensor, k: int, gates: list) -> torch.Tensor:
    """llama.cpp's qwen2moe FFN (src/models/qwen2moe.cpp, build_moe_ffn with norm_w = false) on h (T, H)."""
    probs = F.softmax(F.linear(h, block.gate.weight), dim=-1)  # (T, E): softmax over all experts
    weights, chosen = probs.topk(k, dim=-1)  # (T, k), never renormalised
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj  # (E, 2I, H), (E, H, I)
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(h)
    for slot in range(k):
        for e in chosen[:, slot].unique().tolist():
            rows = chosen[:, slot] == e
            x = h[rows]
            y = F.linear(F.silu(F.linear(x, gate_up[e, :inter])) * F.linear(x, gate_up[e, inter:]), down[e])
            out[rows] += weights[rows, slot, None] * y
    z = block.shared_expert_gate(h)  # (T, 1)
    gate = F.silu(z) / z  # llama.cpp's "sigmoid": NaN where z == 0
    gates.append(gate)
    return out + gate * block.shared_expert(h)


def _logits_both_ways(folder, k):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 17, 42, 99, 5, 250, 3, 77, 120, 64, 8, 200]])
    gates: list = []
    with torch.inference_mode():
        ref = model(ids).logits
        hooks = [layer.mlp.register_forward_hook(
            lambda mod, args, out: llamacpp_qwen2moe(mod, args[0].reshape(-1, args[0].shape[-1]), k, gates)
            .reshape(out.shape)) for layer in model.model.layers]
        emulated = model(ids).logits
        for hook in hooks:
            hook.remove()
    return ref, emulated, torch.cat(gates)


@pytest.mark.parametrize("shared,routed_scale", [((), None), ((1.0,), 0.5)])
def test_qwen2moe_as_llamacpp_computes_it_matches_transformers_with_all_experts_active(
        tiny_qwen2, shared, routed_scale, tmp_path):
    """The README's exact split (and no shared expert): finite in llama.cpp, and equal when k = E."""
    result = upcycle(_cfg(tiny_qwen2, "qwen2_moe", k=4, shared=shared, routed_scale=routed_scale,
                          shared_expert_gate="constant"), tmp_path / "moe")
    assert verdict(result.plan)[0] == "exact"
    ref, emulated, gates = _logits_both_ways(result.output, k=4)
    assert torch.isfinite(gates).all() and (gates == 0.5).all()  # the zero gate gave 0/0 here
    assert (emulated - ref).abs().max() <= REL * ref.abs().max()


def test_qwen2moe_with_fewer_active_experts_differs_in_llamacpp_and_the_plan_says_why(tiny_qwen2, tmp_path):
    result = upcycle(_cfg(tiny_qwen2, "qwen2_moe", k=2, shared=(1.0,), routed_scale=0.5,
                          shared_expert_gate="constant"), tmp_path / "moe")
    status, why = verdict(result.plan)
    assert status == "runs, not exact" and "norm_topk_prob" in why and "experts_per_token: 4" in why
    note = next(n for n in result.plan.notes if n.startswith("llama.cpp: runs, not exact"))
    assert "never renormalises the top-2 router weights" in note
    card = (result.output / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| llama.cpp |"))  # the card's Runtimes table
    assert "runs, not exact" in row and "llama.cpp's qwen2moe never renormalises" in row
    ref, emulated, gates = _logits_both_ways(result.output, k=2)
    assert torch.isfinite(emulated).all() and (gates == 0.5).all()
    assert (emulated - ref).abs().max() > 1e-2 * ref.abs().max()  # the top-2 mass (< 1) scales the routed half


def test_verdicts_per_architecture(tiny_llama, tiny_qwen3, tiny_qwen3_tied_bias):
    assert verdict(upcycle(_cfg(tiny_llama, "mixtral"), dry_run=True).plan)[0] == "exact"
    assert verdict(upcycle(_cfg(tiny_qwen3, "qwen3_moe"), dry_run=True).plan)[0] == "exact"
    plan = upcycle(_cfg(tiny_qwen3_tied_bias, "qwen3_moe"), dry_run=True).plan
    status, why = verdict(plan)
    assert status == "will not load" and "self_attn.o_proj.bias" in why
    assert any(n.startswith("llama.cpp: will not load") for n in plan.notes)
    assert not any(n.startswith("llama.cpp") for n in upcycle(_cfg(tiny_llama, "mixtral"), dry_run=True).plan.notes)
    assert {a: (x.name, x.renormalises_top_k) for a, x in LLAMACPP.items()} == {
        "mixtral": ("llama", True), "qwen2_moe": ("qwen2moe", False), "qwen3_moe": ("qwen3moe", True),
        "qwen3_5_moe_text": ("qwen35moe", True), "granitemoeshared": ("granitemoe", True),
        "ernie4_5_moe": ("ernie4_5-moe", True), "glm4_moe": ("glm4moe", True)}


def test_tied_qwen2moe_writes_lm_head_for_llamacpp_and_stays_tied(tiny_qwen2_tied, tmp_path):
    """llama.cpp's qwen2moe requires output.weight ("tensor 'output.weight' not found" otherwise)."""
    result = upcycle(_cfg(tiny_qwen2_tied, "qwen2_moe", k=4), tmp_path / "moe")
    embed = dense_tensor(tiny_qwen2_tied, "model.embed_tokens.weight")
    assert torch.equal(tensor(result.output, "lm_head.weight"), embed)
    assert json.loads((result.output / "config.json").read_text())["tie_word_embeddings"] is True
    assert any("written twice" in n for n in result.plan.notes)
    total, _ = parameter_counts(result.plan)  # the parameter is still one
    assert total == sum(math.prod(s.shape) for s in result.plan.steps) - embed.numel()
    assert result.summary.tied_note == ", written twice (llama.cpp needs output.weight)"  # the plan's row says so
    assert "The input and output embeddings are tied (stored twice" in (result.output / "README.md").read_text()
    ref, emulated, _ = _logits_both_ways(result.output, k=4)
    assert (emulated - ref).abs().max() <= REL * ref.abs().max()


# ---- the llama.cpp verdict for whole classes of bases and recipes (scripts/check_llamacpp.py measures each) ----

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VERDICT_BASES = {  # name: make_dense_model arguments (published configs' shapes of the same kind)
    "llama": dict(family="llama"),
    "llama_tied": dict(family="llama", tie_word_embeddings=True),
    "mistral_v01": dict(family="mistral", sliding_window=4096),  # Mistral-7B-v0.1
    "mistral_nowin": dict(family="mistral", sliding_window=None),  # Mistral-7B-v0.2 and later
    "qwen25": dict(family="qwen2", sliding_window=8, use_sliding_window=False, max_window_layers=1),  # Qwen2.5
    "qwen2_swa": dict(family="qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1),
    "llama3": dict(family="llama", rope_parameters=LLAMA3_ROPE),  # Llama-3.1 / 3.2
    "nemo": dict(family="mistral", head_dim=32, sliding_window=None),  # Mistral-Nemo: head_dim != hidden / heads
    "qwen3_hd32": dict(family="qwen3", head_dim=32),  # Qwen3: head_dim 128 != hidden / heads
    # rope scaling that llama.cpp cannot follow, and yarn that it can (scripts/check_llamacpp.py measures each)
    "llama_dynamic": dict(family="llama", max_position_embeddings=16,
                          rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "llama_yarn_attn": dict(family="llama", max_position_embeddings=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "attention_factor": 0.8}),
    "llama_yarn_betas": dict(family="llama", max_position_embeddings=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 16.0, "beta_slow": 2.0}),
    "llama_longrope": dict(family="llama", max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}),
}
EXACT, RUNS, NO_LOAD = "exact", "runs, not exact", "will not load"
WINDOW = "no sliding-window attention"


@pytest.fixture(scope="module")
def verdict_bases(tmp_path_factory) -> dict:
    from moe_upcycle.checkpoint.tiny import make_dense_model

    root = tmp_path_factory.mktemp("verdict_bases")
    return {name: make_dense_model(root / name, seed=i, tokenizer=False, **kw)
            for i, (name, kw) in enumerate(VERDICT_BASES.items())}


@pytest.mark.parametrize("base,arch,extra,status,fragment", [
    # attention windows: llama.cpp's llama / qwen2moe / qwen3moe attend over the whole context
    ("mistral_v01", "mixtral", {}, RUNS,
     "through a window of 4096 tokens on 2 of 2 layers; identical up to 4096 tokens"),
    ("mistral_v01", "qwen2_moe", {"experts_per_token": 4}, RUNS, WINDOW),
    ("qwen2_swa", "qwen2_moe", {"experts_per_token": 4}, RUNS, "window of 8 tokens on 1 of 2 layers"),
    ("mistral_nowin", "mixtral", {}, EXACT, "renormalised as in transformers"),
    ("qwen25", "qwen2_moe", {"experts_per_token": 4}, EXACT, "all experts active"),  # window off: nothing slides
    ("qwen25", "qwen2_moe", {}, RUNS, "never renormalises the top-2"),
    # rope_type llama3: only the converter's llama writes rope_freqs
    ("llama3", "mixtral", {}, EXACT, "renormalised"),
    ("llama3", "qwen2_moe", {"experts_per_token": 4}, RUNS, "rope_type llama3"),
    # dynamic NTK: no such scaling in llama.cpp (unscaled); yarn's attention_factor replaced; no longrope factors
    ("llama_dynamic", "mixtral", {}, RUNS, "identical up to max_position_embeddings (16 tokens)"),
    ("llama_dynamic", "qwen2_moe", {"experts_per_token": 4}, RUNS, "no dynamic NTK scaling"),
    ("llama_yarn_attn", "mixtral", {}, RUNS, "attention_factor"),
    ("llama_yarn_betas", "mixtral", {}, EXACT, "renormalised"),
    ("llama_longrope", "mixtral", {}, RUNS, "no short/long rope factors"),
    ("llama_longrope", "qwen2_moe", {"experts_per_token": 4}, RUNS, "longrope"),
    # head_dim != hidden / heads: llama.cpp's qwen2moe sizes q/o hidden x hidden
    ("nemo", "mixtral", {}, EXACT, "renormalised"),
    ("nemo", "qwen2_moe", {"experts_per_token": 4}, NO_LOAD, "head_dim 32 x 4 heads is 128"),
    ("qwen3_hd32", "qwen3_moe", {}, EXACT, "renormalised"),
    # tied embeddings, 16-bit outputs, expert inits: llama.cpp computes what transformers computes
    ("llama_tied", "mixtral", {}, EXACT, "renormalised"),
    ("llama", "mixtral", {"dtype": "bfloat16", "expert_init": {"method": "noise", "scale": 0.05}}, EXACT, ""),
    ("llama", "mixtral", {"expert_init": {"method": "split", "granularity": 2}}, EXACT, ""),
    ("llama", "qwen2_moe", {"experts_per_token": 4, "dtype": "float16",
                            "expert_init": {"method": "drop", "ratio": 0.5}}, EXACT, ""),
    # the fused (transformers-5) layout: the converter's qwen2moe / qwen3moe split gate_up_proj, its llama does not
    ("llama", "mixtral", {"layout": "fused"}, NO_LOAD, "per-expert"),
    ("llama", "qwen2_moe", {"layout": "fused", "experts_per_token": 4}, EXACT, ""),
    ("qwen3_hd32", "qwen3_moe", {"layout": "fused"}, EXACT, ""),
])
def test_llamacpp_verdict_per_class_of_base(verdict_bases, base, arch, extra, status, fragment):
    from moe_upcycle.planning.runtimes import compatibility

    plan = upcycle(_cfg(verdict_bases[base], arch, **extra), dry_run=True).plan
    found = next(v for v in compatibility(plan) if v.runtime == "llama.cpp")
    assert (found.status, found.basis) == (status, "measured"), found.line()
    assert fragment in found.why
    if status != EXACT:  # the plan says it where the user reads it
        assert any(n.startswith(f"llama.cpp: {status}") for n in plan.notes), plan.notes


@pytest.mark.parametrize("base,written", [
    ("mistral_v01", {"sliding_window": 4096}),
    ("qwen25", {"sliding_window": None, "use_sliding_window": False, "layer_types": ["full_attention"] * 2}),
    ("qwen2_swa", {"sliding_window": 8, "use_sliding_window": True,
                   "layer_types": ["full_attention", "sliding_attention"]}),
])
def test_written_window_is_the_one_the_verdict_reads(verdict_bases, base, written, tmp_path):
    """The window fields the converter and transformers read are those the verdict was made from."""
    from moe_upcycle.planning.model_config import moe_config

    plan = upcycle(_cfg(verdict_bases[base], "qwen2_moe", k=4), dry_run=True).plan
    cfg = moe_config(plan)
    assert {k: cfg.get(k) for k in written} == written


def test_fused_qwen_moe_card_says_llamacpp_reads_it(tiny_qwen2, tmp_path):
    """convert_hf_to_gguf.py splits qwen2moe's fused gate_up_proj: measured exact, not 'will not load'."""
    result = upcycle(_cfg(tiny_qwen2, "qwen2_moe", k=4, layout="fused"), tmp_path / "moe")
    card = (result.output / "README.md").read_text()
    assert "The fused expert layout is transformers >= 5 and llama.cpp only." in card
    row = next(line for line in card.splitlines() if line.startswith("| llama.cpp |"))
    assert row.startswith("| llama.cpp | exact |") and row.endswith("| measured |")


HUB_CONFIGS = Path(__file__).resolve().parent / "data" / "hub_configs"
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings")


@pytest.mark.parametrize("hub,mixtral,qwen2_moe", [
    ("meta-llama--Llama-3.2-1B", (EXACT, "renormalised"), (RUNS, "rope_type llama3")),
    ("mistralai--Mistral-7B-v0.1", (RUNS, "window of 4096 tokens"), (RUNS, "window of 4096 tokens")),
    ("mistralai--Mistral-7B-Instruct-v0.1", (RUNS, "identical up to 4096 tokens"), (RUNS, "4096")),
    ("mistralai--Mistral-7B-Instruct-v0.2", (EXACT, "renormalised"), (EXACT, "all experts active")),
])
def test_llamacpp_verdict_of_published_configs(hub, mixtral, qwen2_moe, tmp_path):
    """A published config.json (its rope, window, family) on tiny tensors: the verdicts its users would read."""
    published = json.loads((HUB_CONFIGS / hub / "config.json").read_text())
    from moe_upcycle.checkpoint.tiny import make_dense_model

    base = make_dense_model(tmp_path / "base", family=published["model_type"], tokenizer=False)
    tiny = json.loads((base / "config.json").read_text())
    cfg = {**{k: v for k, v in published.items() if k not in ("rope_parameters", "torch_dtype", "dtype")},
           **{k: tiny[k] for k in SIZE_KEYS if k in tiny}}
    (base / "config.json").write_text(json.dumps(cfg))
    for arch, (status, fragment) in (("mixtral", mixtral), ("qwen2_moe", qwen2_moe)):
        plan = upcycle(_cfg(base, arch, k=4), dry_run=True).plan
        status_why = verdict(plan)
        assert status_why[0] == status and fragment in status_why[1], (arch, status_why)
