"""Qwen3.5 (hybrid: Gated DeltaNet + full attention) → Qwen3.5-MoE: files, config.json, module types, exact logits.

The oracle is transformers itself: the dense Qwen3_5ForCausalLM's logits on fixed token ids, its own tensors
stacked by hand for the fused experts, and the classes Qwen3_5MoeForCausalLM builds for each layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.errors import PlanError
from tf4_logits import TF4_PYTHON, NO_TF4, folder_logits, folder_tensors
from tolerances import assert_close_rel

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
# hidden 32, 4 heads of 8 (q_proj 2x: query and output gate), 2 linear key heads and 4 value heads of 8
DIMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES)
IDS = torch.tensor([[1, 17, 42, 250, 9, 77, 123, 5, 61, 200, 33, 8, 299, 14, 90, 3]])  # (1, 16): chunked DeltaNet path
LINEAR = [f"linear_attn.{t}" for t in ("A_log", "conv1d.weight", "dt_bias", "in_proj_a.weight", "in_proj_b.weight",
                                       "in_proj_qkv.weight", "in_proj_z.weight", "norm.weight", "out_proj.weight")]
FULL = [f"self_attn.{t}.weight" for t in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
MOE = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.shared_expert.gate_proj.weight",
       "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    # random norms: Qwen3.5's RMSNorm is (1 + w) with w = 0 at init, so a norm left out would go unseen
    return make_dense_model(tmp_path_factory.mktemp("q35") / "dense", family="qwen3_5_text", seed=3,
                            random_norms_and_biases=True, **DIMS)


_tensors = folder_tensors


def _logits(folder: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return folder_logits(folder, IDS, dtype)


def _build(dense: Path, out: Path, verify: bool = False, **recipe):
    return upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                    "architecture": "qwen3_5_moe", **recipe}, out, verify=verify)


@pytest.fixture(scope="module")
def built(dense, tmp_path_factory) -> Path:
    return _build(dense, tmp_path_factory.mktemp("q35") / "moe").output


def test_config_is_qwen3_5_moe_text_with_the_bases_hybrid_layout(built, dense):
    cfg = json.loads((built / "config.json").read_text())
    base = json.loads((dense / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["model_type"] == "qwen3_5_moe_text"
    assert cfg["layer_types"] == LAYER_TYPES
    for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "hidden_size"):
        assert cfg[key] == base[key], key
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 64)
    assert cfg["shared_expert_intermediate_size"] == 1  # no shared_experts: one all-zero neuron
    assert "norm_topk_prob" not in cfg and "mlp_only_layers" not in cfg  # Qwen3.5-MoE has neither


def test_tensor_names_per_layer_kind_and_fused_experts(built, dense):
    got = _tensors(built)
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i, kind in enumerate(LAYER_TYPES):
        own = LINEAR if kind == "linear_attention" else FULL
        want |= {f"model.layers.{i}.{s}" for s in own + MOE + ["input_layernorm.weight",
                                                               "post_attention_layernorm.weight"]}
    assert set(got) == want
    base = _tensors(dense)
    for i in range(4):
        gate, up, down = (base[f"model.layers.{i}.mlp.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
        # transformers' fused layout: gate_up_proj (E, 2I, H) = per expert [gate; up], down_proj (E, H, I)
        assert torch.equal(got[f"model.layers.{i}.mlp.experts.gate_up_proj"], torch.cat([gate, up]).expand(4, -1, -1))
        assert torch.equal(got[f"model.layers.{i}.mlp.experts.down_proj"], down.expand(4, -1, -1))
        assert not got[f"model.layers.{i}.mlp.shared_expert.down_proj.weight"].any()
        for s in (LINEAR if LAYER_TYPES[i] == "linear_attention" else FULL):
            assert torch.equal(got[f"model.layers.{i}.{s}"], base[f"model.layers.{i}.{s}"]), s


def test_module_types_per_layer_and_no_missing_keys(built):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(built), output_loading_info=True)
    assert type(model) is m.Qwen3_5MoeForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for layer, kind in zip(model.model.layers, LAYER_TYPES):
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        assert type(mixer) is (m.Qwen3_5MoeGatedDeltaNet if kind == "linear_attention" else m.Qwen3_5MoeAttention)
        assert type(layer.mlp) is m.Qwen3_5MoeSparseMoeBlock
        assert layer.mlp.experts.gate_up_proj.shape == (4, 128, 32)


def test_copy_upcycle_reproduces_the_dense_logits(built, dense):
    assert_close_rel(_logits(built), _logits(dense))


def test_bf16_copy_upcycle_reproduces_the_dense_logits(dense, tmp_path):
    moe = _build(dense, tmp_path / "moe", dtype="bfloat16").output
    expected = _logits(dense, torch.bfloat16)
    # bf16 (8 bits of mantissa): the MoE sums the same bf16 products in another order (routed weights w, 1 - w)
    assert_close_rel(_logits(moe, torch.bfloat16), expected, rel=2 ** -6)


def test_exact_split_with_a_shared_expert_behind_the_constant_gate(dense, tmp_path):
    result = upcycle({"base_model": str(dense), "experts_per_token": 2, "gate_mode": "random",
                      "architecture": "qwen3_5_moe", "shared_expert_gate": "constant",
                      "experts": [{"source_model": str(dense), "residual_scale": 0.5}] * 4,
                      "shared_experts": [{"source_model": str(dense)}]}, tmp_path / "moe")
    cfg = json.loads((result.output / "config.json").read_text())
    assert cfg["shared_expert_intermediate_size"] == 64
    gate = _tensors(result.output)["model.layers.0.mlp.shared_expert_gate.weight"]
    assert torch.sigmoid(gate.float() @ torch.ones(32)).item() == 0.5  # 0.5 x routed + sigmoid(g.x) x shared
    assert_close_rel(_logits(result.output), _logits(dense))
    assert any("the exact split" in n for n in result.plan.notes)


def test_plain_shared_expert_without_the_split_is_not_the_dense_model(dense, tmp_path):
    """The guarantee above is the split's: a shared copy at full weight adds 1/2 FFN on top (1.5 x the FFN)."""
    result = upcycle({"base_model": str(dense), "experts_per_token": 2, "gate_mode": "random",
                      "architecture": "qwen3_5_moe", "shared_expert_gate": "constant",
                      "experts": [{"source_model": str(dense)}] * 4, "shared_experts": [{"source_model": str(dense)}]},
                     tmp_path / "moe")
    diff = (_logits(result.output) - _logits(dense)).abs().max()
    assert diff > 1e-2 * _logits(dense).abs().max()
    assert any("1.5 x the dense FFN" in n for n in result.plan.notes)


def test_chosen_without_architecture_for_a_qwen3_5_base(dense, tmp_path):
    result = upcycle({"base_model": str(dense), "num_experts": 2, "experts_per_token": 2, "gate_mode": "random"},
                     tmp_path / "moe", dry_run=True)
    assert result.plan.architecture == "qwen3_5_moe_text" and result.plan.layout == "fused"


@pytest.mark.parametrize("recipe,message", [
    ({"norm_topk_prob": False}, "Qwen3.5-MoE always renormalises the top-k router weights"),
    ({"moe_layers": [1, 3]}, "Qwen3.5-MoE makes every layer an MoE layer"),
])
def test_settings_qwen3_5_moe_cannot_hold_are_refused(dense, tmp_path, recipe, message):
    with pytest.raises(PlanError, match=message):
        upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                 "architecture": "qwen3_5_moe", **recipe}, tmp_path / "moe", dry_run=True)
    assert not (tmp_path / "moe").exists()


def test_a_qwen3_base_is_refused_for_qwen3_5_moe(tiny_qwen3, tmp_path):
    with pytest.raises(PlanError, match=r"architecture: qwen3_5_moe \(read as qwen3_5_moe_text\): Qwen3.5-MoE holds "
                                        r"the layers of a Qwen3_5ForCausalLM only"):
        upcycle({"base_model": str(tiny_qwen3), "num_experts": 2, "experts_per_token": 1, "gate_mode": "random",
                 "architecture": "qwen3_5_moe"}, tmp_path / "moe", dry_run=True)


def test_a_qwen3_5_base_fits_no_other_output(dense, tmp_path):
    with pytest.raises(PlanError, match=r"linear_attn\.A_log"):
        upcycle({"base_model": str(dense), "num_experts": 2, "experts_per_token": 1, "gate_mode": "random",
                 "architecture": "qwen3_moe"}, tmp_path / "moe", dry_run=True)


def test_layer_types_that_qwen3_5_moe_cannot_build_are_named(dense, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in dense.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((dense / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**cfg, "layer_types": LAYER_TYPES[:3] + ["sliding_attention"]}))
    with pytest.raises(PlanError, match=r"layer_types\[3\] is 'sliding_attention', which Qwen3.5-MoE does not build"):
        upcycle({"base_model": str(bad), "num_experts": 2, "experts_per_token": 1, "gate_mode": "random"},
                tmp_path / "moe", dry_run=True)


def test_runtime_table(dense, tmp_path):
    from moe_upcycle.planning.runtimes import compatibility

    plan = upcycle({"base_model": str(dense), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                    "architecture": "qwen3_5_moe"}, tmp_path / "moe", dry_run=True).plan
    verdicts = {v.runtime: (v.status, v.why) for v in compatibility(plan)}
    assert {k: s for k, (s, _) in verdicts.items()} == {
        "transformers 5": "exact", "transformers 4.x": "will not load", "vLLM": "exact", "llama.cpp": "exact",
        "ExLlamaV2": "will not load"}
    assert "no Qwen3.5" in verdicts["transformers 4.x"][1]
    assert verdicts["llama.cpp"][1] == ("softmax over all experts, then top-k, renormalised as in transformers; "
                                        "convert with --no-mtp")




@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_transformers4_has_no_qwen3_5_moe_class(built):
    """The runtime table's "will not load" for 4.57, measured: its AutoConfig does not know the model_type."""
    import subprocess

    code = ("import sys, transformers; print(transformers.__version__)\n"
            "try:\n    transformers.AutoConfig.from_pretrained(sys.argv[1])\n"
            "except Exception as e:\n    print('refused', type(e).__name__)")
    run = subprocess.run([str(TF4_PYTHON), "-c", code, str(built)], capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, check=False)
    lines = run.stdout.split()
    assert lines[0].startswith("4.57") and "refused" in lines, run.stdout + run.stderr[-2000:]


def test_verify_passes_and_sees_every_layer_built_as_the_base_says(dense, tmp_path):
    result = _build(dense, tmp_path / "moe", verify=True)
    assert result.verify.problems == [], result.verify.problems
    assert result.verify.loaded_class == "Qwen3_5MoeForCausalLM" and result.verify.moe_layers == [0, 1, 2, 3]
    assert result.verify.comparison.max_kl < 1e-8  # KL(dense || MoE) on the prompts: the same distribution


def test_verify_names_a_layer_built_as_the_wrong_kind(built, dense, tmp_path):
    from moe_upcycle.check.verify import verify

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in built.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = json.loads((built / "config.json").read_text())
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention"] * 4}))
    got = verify(bad, base=str(dense))
    assert any("transformers built layer 0 as full_attention, but the dense base's layer_types says linear_attention"
               in p for p in got.problems), got.problems


def test_upcycle_model_in_memory(dense):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    from moe_upcycle import upcycle_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    moe = upcycle_model(model, num_experts=4, experts_per_token=2, architecture="qwen3_5_moe").eval()
    assert type(moe) is Qwen3_5MoeForCausalLM and moe.config.layer_types == LAYER_TYPES
    with torch.inference_mode():
        assert_close_rel(moe(IDS).logits, model(IDS).logits)


def test_meta_description_matches_the_saved_model(dense):
    """``--from-config`` describes a Qwen3.5 as transformers saves it: every name and shape, per layer kind."""
    from moe_upcycle.checkpoint.meta_model import describe_dense

    described = {k: s for k, (s, _) in describe_dense(json.loads((dense / "config.json").read_text())).items()}
    assert described == {k: tuple(v.shape) for k, v in _tensors(dense).items()}


def test_a_qwen3_5_9b_shaped_plan_on_meta_tensors(tmp_path):
    cfg = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 4096,
           "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
           "head_dim": 256, "vocab_size": 248320, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
           "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8, "dtype": "bfloat16",
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = upcycle({"base_model": str(tmp_path), "num_experts": 8, "experts_per_token": 2, "gate_mode": "random",
                      "architecture": "qwen3_5_moe"}, dry_run=True, from_config=True)
    h, i, v = 4096, 12288, 248320
    linear = 2 * 16 * 128 * h + 32 * 128 * h + 2 * 32 * h + (2 * 16 * 128 + 32 * 128) * 4 + 2 * 32 + 128 \
        + 32 * 128 * h + h * 32 * 128  # in_proj_qkv, in_proj_z, in_proj_a/b, conv1d, A_log + dt_bias, norm, out_proj
    full = 2 * 16 * 256 * h + 2 * 4 * 256 * h + h * 16 * 256 + 2 * 256  # q (with its gate), k, v, o, q/k norms
    moe = 8 * 3 * i * h + 8 * h + 3 * 1 * h + h  # experts, router, the one-neuron shared expert, its gate
    total = 2 * v * h + h + 32 * (2 * h + moe) + 24 * linear + 8 * full
    assert result.summary.total_params == total
    assert result.summary.active_params == total - 32 * 6 * 3 * i * h  # 2 of 8 experts run
