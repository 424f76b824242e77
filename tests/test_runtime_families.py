"""The dense models people upcycle, as published, run as the plan says in transformers 5 and 4.57.

Each case is a tiny random model whose config.json has the features of a real published one
(written as the Hub has it: ``rope_theta`` / ``rope_scaling``, ``torch_dtype``): Llama-3.2 (llama3
rope, tied), Mistral v0.1 (a sliding window shorter than the text), Mistral-Nemo (head_dim other
than hidden / heads), Qwen2.5 (biases, tied, window switched off, yarn), a Qwen2 that slides only its
upper layers, Qwen3 (q/k norms, head_dim 32 of hidden 64 / 4 heads), and configs that write the family
default as null (``head_dim``, ``num_key_value_heads``). Each is upcycled by copy (or an
exact split), and the MoE's logits on 40 tokens (past every window) are compared with the dense
model's *in the same transformers version*. The plan's transformers 4.x verdict must say what 4.57
does: exact (equal logits), runs, not exact (it loads and differs), or will not load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.planning.runtimes import EXACT, NO_LOAD, RUNS, compatibility
from tf4_logits import NO_TF4, TF4_PYTHON, tf4_logits, tf5_logits
from tolerances import assert_close_rel

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer")  # logits are fed token ids
WINDOW, SEQ = 8, 40  # every window set here is shorter than the compared text
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300)
COMMON = dict(DIMS, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, hidden_act="silu",
              initializer_range=0.02, rms_norm_eps=1e-5, use_cache=True, attention_dropout=0.0,
              transformers_version="4.45.0")
LLAMA3 = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
          "rope_type": "llama3"}
QWEN2 = dict(COMMON, model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6, rope_scaling=None,
             sliding_window=WINDOW, use_sliding_window=False, max_window_layers=1, tie_word_embeddings=True,
             torch_dtype="bfloat16")
# name -> published-style config.json
CONFIGS = {
    "llama-3.2": dict(COMMON, model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=False,
                      mlp_bias=False, head_dim=16, rope_scaling=LLAMA3, rope_theta=500000.0, tie_word_embeddings=True,
                      torch_dtype="bfloat16"),
    "mistral-v0.1": dict(COMMON, model_type="mistral", architectures=["MistralForCausalLM"], rope_theta=10000.0,
                         sliding_window=WINDOW, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "mistral-nemo": dict(COMMON, model_type="mistral", architectures=["MistralForCausalLM"], head_dim=32,
                         rope_theta=1e6, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen2.5": QWEN2,
    "qwen2.5-yarn": dict(QWEN2, rope_scaling={"factor": 4.0, "original_max_position_embeddings": 16, "type": "yarn"}),
    "qwen2-upper-layers-slide": dict(QWEN2, use_sliding_window=True),
    "qwen3": dict(COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], attention_bias=False, head_dim=32,
                  rope_theta=1e6, rope_scaling=None, sliding_window=None, use_sliding_window=False,
                  max_window_layers=2, tie_word_embeddings=True, torch_dtype="bfloat16"),
    # null is the family default (Mistral configs may say "head_dim": null; old Llama ones "num_key_value_heads": null)
    "mistral-head-dim-null": dict(COMMON, model_type="mistral", architectures=["MistralForCausalLM"], head_dim=None,
                                  rope_theta=1e6, sliding_window=WINDOW, tie_word_embeddings=False,
                                  torch_dtype="float32"),
    "llama-kv-null": dict(COMMON, model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=None,
                          rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32"),
    "llama-fp16-dynamic": dict(COMMON, model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=32,
                               rope_scaling={"type": "dynamic", "factor": 2.0}, rope_theta=10000.0,
                               tie_word_embeddings=False, torch_dtype="float16"),
}
SPLIT = {"method": "split", "granularity": 2}  # exact: G = 2 divides k = 2 and E = 4
# (config, architecture, expert_init) -> transformers 4.x verdict (transformers 5: exact for all)
CASES = {
    ("llama-3.2", "mixtral", "copy"): EXACT,
    ("llama-3.2", "qwen2_moe", "split"): EXACT,
    ("mistral-v0.1", "mixtral", "copy"): EXACT,
    ("mistral-v0.1", "qwen2_moe", "copy"): EXACT,
    ("mistral-nemo", "mixtral", "split"): EXACT,
    ("mistral-nemo", "qwen2_moe", "copy"): NO_LOAD,  # 4.57's Qwen2-MoE needs head_dim = hidden / heads
    ("qwen2.5", "qwen2_moe", "copy"): EXACT,
    ("qwen2.5-yarn", "qwen2_moe", "split"): EXACT,
    ("qwen2-upper-layers-slide", "qwen2_moe", "copy"): RUNS,  # 4.57 slides every layer
    ("qwen3", "qwen3_moe", "copy"): EXACT,
    ("llama-fp16-dynamic", "mixtral", "split"): EXACT,
    ("mistral-head-dim-null", "qwen2_moe", "copy"): EXACT,
    ("llama-kv-null", "qwen2_moe", "copy"): EXACT,
}

def _ids() -> list[int]:
    return torch.randint(3, DIMS["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(0)).tolist()


def _dense(root: Path, name: str) -> Path:
    config = CONFIGS[name]
    extra = {k: config[k] for k in ("head_dim", "attention_bias") if config.get(k) is not None}
    dims = {**DIMS, "num_key_value_heads": config["num_key_value_heads"] or config["num_attention_heads"]}
    folder = make_dense_model(root / name, family=config["model_type"], seed=7, random_norms_and_biases=True,
                              tie_word_embeddings=config["tie_word_embeddings"], tokenizer=False,
                              dtype=getattr(torch, config["torch_dtype"]), **dims, **extra)
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # as published, not as transformers 5 saves it
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """Every case built once: (config, arch, init) -> (dense folder, MoE folder, plan)."""
    root = tmp_path_factory.mktemp("families")
    dense = {name: _dense(root, name) for name in CONFIGS}
    out = {}
    for (name, arch, init) in CASES:
        recipe = {"base_model": str(dense[name]), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                  "architecture": arch, "expert_init": SPLIT if init == "split" else "copy"}
        result = upcycle(recipe, root / f"{name}-{arch}-{init}")
        out[(name, arch, init)] = (dense[name], result.output, result.plan)
    return out


def _logits(folder: Path) -> torch.Tensor:
    return tf5_logits(folder, _ids())


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(c) for c in CASES])
def test_transformers5_exact_and_verdicts_say_so(case, built):
    dense, moe, plan = built[case]
    verdicts = {v.runtime: v for v in compatibility(plan)}
    assert verdicts["transformers 5"].status == EXACT
    assert verdicts["transformers 4.x"].status == CASES[case], verdicts["transformers 4.x"].line()
    assert_close_rel(_logits(moe), _logits(dense))


def test_window_fields_as_written(built):
    """Mistral's window on every layer, as Qwen2-MoE fields (max_window_layers: the first layer that slides, which
    4.57's flash-attention path reads); a published Qwen2.5 (window off) gets no window at all."""
    cfg = json.loads((built[("mistral-v0.1", "qwen2_moe", "copy")][1] / "config.json").read_text())
    assert (cfg["sliding_window"], cfg["use_sliding_window"], cfg["max_window_layers"]) == (WINDOW, True, 0)
    assert cfg["layer_types"] == ["sliding_attention"] * 2
    cfg = json.loads((built[("qwen2-upper-layers-slide", "qwen2_moe", "copy")][1] / "config.json").read_text())
    assert (cfg["max_window_layers"], cfg["layer_types"]) == (1, ["full_attention", "sliding_attention"])
    cfg = json.loads((built[("qwen2.5", "qwen2_moe", "copy")][1] / "config.json").read_text())
    assert (cfg["sliding_window"], cfg["use_sliding_window"]) == (None, False)
    cfg = json.loads((built[("mistral-v0.1", "mixtral", "copy")][1] / "config.json").read_text())
    assert cfg["sliding_window"] == WINDOW
    plan = built[("qwen2-upper-layers-slide", "qwen2_moe", "copy")][2]
    why = {v.runtime: v for v in compatibility(plan)}["transformers 4.x"].why
    assert "applies sliding_window to every layer" in why
    plan = built[("mistral-nemo", "qwen2_moe", "copy")][2]
    why = {v.runtime: v for v in compatibility(plan)}["transformers 4.x"].why
    assert "head_dim = hidden_size / num_attention_heads (16), not 32" in why


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_transformers4_does_what_the_verdict_says(built):
    """One 4.57 process loads every dense model and MoE; each MoE's verdict is checked against what happened."""
    folders = sorted({str(p) for dense, moe, _ in built.values() for p in (dense, moe)})
    got = tf4_logits(_ids(), folders)
    wrong = []
    for case, (dense, moe, plan) in built.items():
        verdict = {v.runtime: v.status for v in compatibility(plan)}["transformers 4.x"]
        want, have = got[str(dense)], got[str(moe)]
        assert not isinstance(want, str), f"4.57 cannot run the dense {case[0]}: {want}"
        if isinstance(have, str):
            seen = NO_LOAD
        else:
            want, have = torch.tensor(want), torch.tensor(have)
            seen = EXACT if float((have - want).abs().max()) <= 1e-5 * float(want.abs().max()) else RUNS
        if seen != verdict:
            wrong.append(f"{case}: verdict {verdict}, 4.57 {seen}" + (f" ({have})" if seen == NO_LOAD else ""))
    assert not wrong, wrong


# upcycle_model (in memory, transformers 5): logits equal the dense model's, and what save_pretrained writes reloads
# in 4.57 as the plan's verdict says (transformers 5 writes rope_parameters only and Qwen3-MoE's num_local_experts;
# 4.57 then ran Mixtral with rope_theta 1e6 and refused Qwen3-MoE's routers)
IN_MEMORY = [("llama-3.2", "mixtral"), ("mistral-v0.1", "qwen2_moe"), ("qwen2.5-yarn", "qwen2_moe"),
             ("qwen3", "qwen3_moe"), ("llama-fp16-dynamic", "mixtral")]


@pytest.fixture(scope="module")
def saved_in_memory(built, tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM

    from moe_upcycle import upcycle_model

    root = tmp_path_factory.mktemp("in_memory")
    dense = {name: d for (name, _, _), (d, _, _) in built.items()}
    out = {}
    for name, arch in IN_MEMORY:
        model = AutoModelForCausalLM.from_pretrained(str(dense[name]), dtype=torch.float32).eval()
        moe = upcycle_model(model, num_experts=4, experts_per_token=2, architecture=arch).eval()
        with torch.inference_mode():
            ids = torch.tensor([_ids()])
            assert_close_rel(moe(ids).logits[0], model(ids).logits[0])
        moe.save_pretrained(str(root / f"{name}-{arch}"))
        out[(name, arch)] = (dense[name], root / f"{name}-{arch}")
    return out


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_upcycle_model_save_pretrained_reloads_in_transformers4(saved_in_memory):
    folders = sorted({str(p) for pair in saved_in_memory.values() for p in pair})
    got = tf4_logits(_ids(), folders)
    for case, (dense, saved) in saved_in_memory.items():
        assert not isinstance(got[str(saved)], str), f"{case}: {got[str(saved)]}"
        assert_close_rel(torch.tensor(got[str(saved)]), torch.tensor(got[str(dense)]))
    assert json.loads((saved_in_memory[("qwen3", "qwen3_moe")][1] / "config.json").read_text())["num_experts"] == 4
