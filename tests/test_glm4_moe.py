"""GLM-4-MoE outputs (``architecture: glm4_moe``): exact copies from Llama, Mistral, Qwen2 and Qwen3 bases.

The oracle is the dense model run by plain transformers (its logits), transformers' own module classes per layer,
and the formula of `planning.glm4` written out here: with norm_topk_prob the chosen sigmoid weights sum to 1,
so y = routed_scaling_factor * r * F(x) + s * F(x) for routed / shared residual_scale r / s.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import model_logits
from moe_upcycle import upcycle
from moe_upcycle.errors import PlanError
from tf4_logits import NO_TF4, TF4_PYTHON, tf4_logits
from tolerances import assert_close_rel
from test_architectures import dense_tensor, tensor

BASES = ["tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_qwen3"]
BF16_REL = 2 ** -6  # a few bf16 ulps (2^-8 relative) of the largest logit: two runs rounding in another order


def _cfg(base, n=4, k=2, **extra):
    return {"base_model": str(base), "architecture": "glm4_moe", "gate_mode": "random", "experts_per_token": k,
            "experts": [{"source_model": str(base)} for _ in range(n)], **extra}


def _load(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("fixture", BASES)
def test_copies_reproduce_the_dense_logits_with_glm4_modules_and_config(fixture, request, tmp_path):
    base = request.getfixturevalue(fixture)
    out = upcycle(_cfg(base), tmp_path / "moe").output
    cfg = json.loads((out / "config.json").read_text())
    dense_cfg = json.loads((base / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["model_type"] == "glm4_moe"
    assert {k: cfg[k] for k in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                                "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group",
                                "partial_rotary_factor", "moe_intermediate_size", "num_nextn_predict_layers")} == {
        "n_routed_experts": 4, "n_shared_experts": 0, "num_experts_per_tok": 2, "first_k_dense_replace": 0,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
        "partial_rotary_factor": 1.0, "moe_intermediate_size": 128, "num_nextn_predict_layers": 0}
    assert cfg["attention_bias"] is (fixture == "tiny_qwen2")  # q/k/v biases: Qwen2 only
    assert cfg["use_qk_norm"] is (fixture == "tiny_qwen3")
    model = _load(out)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["Glm4MoeMoE", "Glm4MoeMoE"]
    attn = model.model.layers[1].self_attn
    assert attn.o_proj.bias is None and (attn.q_proj.bias is not None) is (fixture == "tiny_qwen2")
    assert model.model.rotary_emb.inv_freq.numel() * 2 == dense_cfg["head_dim"]  # the whole head rotates
    for layer in range(2):
        bias = tensor(out, f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
        assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(4))
        assert tensor(out, f"model.layers.{layer}.mlp.shared_experts.down_proj.weight").shape == (64, 0)
    for key in ["self_attn.q_proj.bias"] * (fixture == "tiny_qwen2") + ["self_attn.q_norm.weight"] * (
            fixture == "tiny_qwen3"):
        assert torch.equal(tensor(out, f"model.layers.1.{key}"), dense_tensor(base, f"model.layers.1.{key}"))
    assert_close_rel(model_logits(out), model_logits(base))


@pytest.mark.parametrize("split", [False, True])
def test_bf16_output_matches_the_bf16_dense_model(tiny_qwen3, split, tmp_path):
    """In bf16 too: halving (the shared split) is exact in every dtype, so only the runtime's rounding differs."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tiny_qwen3, dtype="bfloat16")
    if split:
        cfg["shared_experts"] = [{"source_model": str(tiny_qwen3), "residual_scale": 0.5}]
        for e in cfg["experts"]:
            e["residual_scale"] = 0.5
    out = upcycle(cfg, tmp_path / "moe").output
    assert tensor(out, "model.layers.0.mlp.experts.3.up_proj.weight").dtype == torch.bfloat16
    if split:
        down = dense_tensor(tiny_qwen3, "model.layers.0.mlp.down_proj.weight").to(torch.bfloat16)
        for key in ("experts.1.down_proj", "shared_experts.down_proj"):
            assert torch.equal(tensor(out, f"model.layers.0.mlp.{key}.weight"), down * 0.5)
    assert tensor(out, "model.layers.0.mlp.gate.e_score_correction_bias").dtype == torch.float32
    ids = torch.tensor([[1, 17, 40, 99, 5, 250, 3, 77]])
    dense = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = dense(ids).logits.float()
        actual = _load(out, torch.bfloat16)(ids).logits.float()
    assert_close_rel(actual, expected, rel=BF16_REL)


def test_shared_expert_split_is_exact_and_the_unsplit_build_says_its_factor(tiny_llama, tmp_path):
    """Routed residual_scale 1/2 + one ungated shared expert at 1/2 = the dense FFN; at 1 and 1 it is 2 x FFN."""
    base = str(tiny_llama)
    cfg = _cfg(tiny_llama, shared_experts=[{"source_model": base, "residual_scale": 0.5}])
    for e in cfg["experts"]:
        e["residual_scale"] = 0.5
    result = upcycle(cfg, tmp_path / "split")
    assert any("exactly the dense FFN" in n for n in result.plan.notes), result.plan.notes
    out = result.output
    assert json.loads((out / "config.json").read_text())["n_shared_experts"] == 1
    down = dense_tensor(tiny_llama, "model.layers.1.mlp.down_proj.weight")
    assert torch.equal(tensor(out, "model.layers.1.mlp.shared_experts.down_proj.weight"), down * 0.5)
    assert torch.equal(tensor(out, "model.layers.1.mlp.experts.2.down_proj.weight"), down * 0.5)
    assert torch.equal(tensor(out, "model.layers.1.mlp.shared_experts.gate_proj.weight"),
                       dense_tensor(tiny_llama, "model.layers.1.mlp.gate_proj.weight"))
    assert_close_rel(model_logits(out), model_logits(tiny_llama))

    unsplit = upcycle(_cfg(tiny_llama, shared_experts=[{"source_model": base}]), tmp_path / "unsplit")
    assert any("2 x the dense FFN" in n and "(e.g. 0.5 and 0.5)" in n for n in unsplit.plan.notes), unsplit.plan.notes
    diff = (model_logits(unsplit.output) - model_logits(tiny_llama)).abs().max()
    assert diff > 1e-2 * model_logits(tiny_llama).abs().max()


def test_moe_layers_suffix_is_first_k_dense_replace(models, tmp_path):
    from moe_upcycle.checkpoint.tiny import make_dense_model

    base = make_dense_model(models / "llama_4l_glm", family="llama", seed=41, num_hidden_layers=4)
    out = upcycle(_cfg(base, moe_layers={"every": 1, "start": 2}), tmp_path / "moe").output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["first_k_dense_replace"] == 2 and "mlp_only_layers" not in cfg
    model = _load(out)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["Glm4MoeMLP"] * 2 + ["Glm4MoeMoE"] * 2
    assert torch.equal(tensor(out, "model.layers.1.mlp.up_proj.weight"),
                       dense_tensor(base, "model.layers.1.mlp.up_proj.weight"))
    assert_close_rel(model_logits(out), model_logits(base))
    from moe_upcycle.check.verify import verify

    report = verify(out, base, max_new_tokens=1)  # the layers transformers built as MoE blocks, against the recipe
    assert report.ok and report.moe_layers == [2, 3] and report.loaded_class == "Glm4MoeForCausalLM", report.problems


@pytest.mark.parametrize("layers", [[0, 2], {"every": 2}, [1, 2]])
def test_moe_layers_that_are_not_a_suffix_are_refused_naming_the_qwen_outputs(models, layers, tmp_path):
    from moe_upcycle.checkpoint.tiny import make_dense_model

    base = make_dense_model(models / "llama_4l_glm_r", family="llama", seed=42, num_hidden_layers=4)
    with pytest.raises(PlanError) as err:
        upcycle(_cfg(base, moe_layers=layers), tmp_path / "moe")
    text = str(err.value)
    assert "architecture: glm4_moe: GLM-4-MoE keeps only its first layers dense" in text
    assert "qwen2_moe and qwen3_moe keep any layers dense (mlp_only_layers)" in text
    assert text.endswith("→ use architecture: qwen2_moe")  # the output that fits this Llama base
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("init,size,experts", [({"method": "noise", "scale": 0.05}, 128, 4),
                                               ({"method": "drop", "ratio": 0.5}, 128, 4),
                                               ({"method": "split", "granularity": 2}, 64, 4)])
def test_every_expert_init_builds_and_loads(tiny_qwen2, init, size, experts, tmp_path):
    base = str(tiny_qwen2)
    cfg = _cfg(tiny_qwen2, expert_init=init, shared_experts=[{"source_model": base, "residual_scale": 0.5}])
    for e in cfg["experts"]:
        e["residual_scale"] = 0.5
    out = upcycle(cfg, tmp_path / "moe").output
    got = json.loads((out / "config.json").read_text())
    # the shared MLP keeps the dense width: n_shared_experts x moe_intermediate_size = 128
    assert (got["moe_intermediate_size"], got["n_routed_experts"], got["n_shared_experts"]) == (size, experts, 128 // size)
    model = _load(out)
    assert model.model.layers[0].mlp.shared_experts.down_proj.weight.shape == (64, 128)
    up = dense_tensor(tiny_qwen2, "model.layers.0.mlp.up_proj.weight")
    first = tensor(out, "model.layers.0.mlp.experts.0.up_proj.weight")
    if init["method"] == "split":  # expert 0 holds the first half of the dense neurons
        assert torch.equal(first, up[:64])
    elif init["method"] == "noise":  # the dense matrix plus noise of std 0.05 x the matrix's std
        assert abs(float((first - up).std()) / (0.05 * float(up.std())) - 1) < 0.1
    else:  # drop 0.5: half of the neurons (up_proj rows) re-drawn, the other half the dense rows byte for byte
        kept = (first == up).all(dim=1)
        assert int(kept.sum()) == 64
    assert torch.isfinite(model_logits(out)).all()


@pytest.mark.parametrize("spelling", ["glm4_moe", "GLM4 MoE", "glm4moe", "GLM-4-MoE"])
def test_spellings_of_the_architecture(spelling):
    from moe_upcycle.recipe.mergekit_names import architecture_name

    assert architecture_name(spelling) == "glm4_moe"


def test_shared_expert_gate_is_refused(tiny_llama, tmp_path):
    cfg = _cfg(tiny_llama, shared_experts=[{"source_model": str(tiny_llama)}], shared_expert_gate="constant")
    with pytest.raises(PlanError, match=r"GLM-4-MoE's shared experts are ungated .* shared_expert_gate: constant"):
        upcycle(cfg, tmp_path / "moe")


def test_qwen3_with_an_o_proj_bias_is_refused(tiny_qwen3_tied_bias, tmp_path):
    with pytest.raises(PlanError, match=r"an attention output bias \(self_attn.o_proj.bias\), which GLM-4-MoE cannot"):
        upcycle(_cfg(tiny_qwen3_tied_bias), tmp_path / "moe")


def test_runtime_table(tiny_qwen2, tmp_path):
    from moe_upcycle.planning.runtimes import compatibility

    split = _cfg(tiny_qwen2, shared_experts=[{"source_model": str(tiny_qwen2), "residual_scale": 0.5}])
    for e in split["experts"]:
        e["residual_scale"] = 0.5
    for cfg, llamacpp_why in ((split, "[gMASK]"), (_cfg(tiny_qwen2), "zero-size tensors")):
        plan = upcycle(cfg, tmp_path / "moe", dry_run=True).plan
        verdicts = {v.runtime: (v.status, v.why) for v in compatibility(plan)}
        assert verdicts["transformers 5"][0] == verdicts["transformers 4.x"][0] == verdicts["vLLM"][0] == "exact"
        assert verdicts["llama.cpp"][0] == "will not load" and llamacpp_why in verdicts["llama.cpp"][1]
        assert verdicts["ExLlamaV2"] == ("will not load", "it has no Glm4MoeForCausalLM: it falls back to Llama and "
                                                          "finds no dense mlp.gate_proj")


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_transformers_457_loads_the_same_function(tiny_qwen3, tiny_qwen2, tmp_path):
    outs = [upcycle(_cfg(b), tmp_path / f"moe{i}").output for i, b in enumerate((tiny_qwen3, tiny_qwen2))]
    split = _cfg(tiny_qwen2, shared_experts=[{"source_model": str(tiny_qwen2), "residual_scale": 0.5}],
                 moe_layers=[1])
    for e in split["experts"]:
        e["residual_scale"] = 0.5
    outs.append(upcycle(split, tmp_path / "split").output)
    ids = [1, 17, 40, 99, 5, 250, 3, 77]
    dense = {str(b): b for b in (tiny_qwen3, tiny_qwen2)}
    got = tf4_logits(ids, [str(o) for o in outs] + list(dense))
    for out, base in zip(outs, (tiny_qwen3, tiny_qwen2, tiny_qwen2)):
        assert isinstance(got[str(out)], list), got[str(out)]
        assert_close_rel(torch.tensor(got[str(out)]), torch.tensor(got[str(base)]))


PROMPTS = [["Once upon a time"], ["def add(a, b):"], ["import numpy as np"], ["for i in range(10): print(i)"]]


def test_prompt_gates_are_a_quarter_as_long_for_the_sigmoid_router(tiny_llama, tmp_path):
    """Same directions as the softmax router's rows, a quarter of the length: sigmoid(w.x) stays below saturation."""
    def build(arch, name, **extra):
        cfg = _cfg(tiny_llama, architecture=arch, gate_mode="cheap_embed", **extra)
        for e, prompts in zip(cfg["experts"], PROMPTS):
            e["positive_prompts"] = prompts
        return upcycle(cfg, tmp_path / name).output

    glm, mixtral = build("glm4_moe", "glm"), build("mixtral", "mixtral")
    for layer in range(2):
        rows = tensor(mixtral, f"model.layers.{layer}.block_sparse_moe.gate.weight")
        assert torch.equal(tensor(glm, f"model.layers.{layer}.mlp.gate.weight"), rows / 4)
        assert torch.allclose(rows.norm(dim=1), torch.full((4,), 16 / 64 ** 0.5))  # 16/sqrt(H), H = 64
    # the router logits on real tokens (captured from transformers' own Glm4MoeTopkRouter): sigmoid not saturated
    from transformers import AutoTokenizer

    model, logits = _load(glm), []
    model.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: logits.append(out[0]))
    with torch.inference_mode():
        model(**AutoTokenizer.from_pretrained(str(glm))("Once upon a time. def add(a, b):", return_tensors="pt"))
    scores = torch.sigmoid(logits[0])
    assert float(scores.max()) < 0.999 and float(scores.min()) > 0.001, scores
    explicit = build("glm4_moe", "explicit", gate_scale=2.0)  # a given gate_scale is the row length as given
    assert torch.allclose(tensor(explicit, "model.layers.0.mlp.gate.weight").norm(dim=1), torch.full((4,), 2.0))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen2"])
def test_upcycle_model_in_memory(fixture, request, tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_upcycle import upcycle_model

    dense = AutoModelForCausalLM.from_pretrained(str(request.getfixturevalue(fixture)), dtype=torch.float32).eval()
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, architecture="glm4_moe").eval()
    assert type(moe).__name__ == "Glm4MoeForCausalLM"
    assert [type(layer.mlp).__name__ for layer in moe.model.layers] == ["Glm4MoeMoE", "Glm4MoeMoE"]
    gate = moe.model.layers[1].mlp.gate
    assert "e_score_correction_bias" in dict(gate.named_buffers())  # still a buffer, fp32 zeros
    assert gate.e_score_correction_bias.dtype == torch.float32 and not gate.e_score_correction_bias.any()
    ids = torch.tensor([[1, 17, 40, 99, 5, 250, 3, 77]])
    with torch.inference_mode():
        assert_close_rel(moe(ids).logits, dense(ids).logits)
    moe.save_pretrained(str(tmp_path / "saved"))  # what training publishes loads back with every tensor
    with torch.inference_mode():
        assert_close_rel(_load(tmp_path / "saved")(ids).logits, dense(ids).logits)


def test_plan_prints_the_runtime_table_with_the_token_names(tiny_qwen2, write_yaml):
    """Through the CLI: the llama.cpp reason names [gMASK] (rich markup escaped, not swallowed as a tag)."""
    from typer.testing import CliRunner

    from moe_upcycle.cli import app

    split = _cfg(tiny_qwen2, shared_experts=[{"source_model": str(tiny_qwen2), "residual_scale": 0.5}])
    for e in split["experts"]:
        e["residual_scale"] = 0.5
    result = CliRunner().invoke(app, ["plan", str(write_yaml(split))], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("│ llama.cpp"))  # the table's row
    assert "will not load" in row and "special tokens [gMASK], <|user|>" in row
