"""Issue 14: outputs run where they say they run.

`build --verify` on a copy-upcycle of every input family to every output it supports, fp32 and
bf16 (verify loads the MoE as a user would); bf16 stories260K generates; fused shards refuse
transformers 4.57; the runtime compatibility report in `plan` and the model card.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import PROMPT_TEXT
from moe_upcycle import upcycle
from moe_upcycle.cli import app
from moe_upcycle.publish.model_files import experts_implementation
from moe_upcycle.planning.runtimes import EXACT, NO_LOAD, RUNS, compatibility
from moe_upcycle.check.verify import IDENTITY_MAX_KL, verify

REPO = Path(__file__).resolve().parents[1]
TF4_PYTHON = REPO / ".venv-tf4" / "bin" / "python"  # made by .ci/run before pytest
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
EXPERTS_KEY = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}
# every input family -> each output architecture it supports (Qwen2 biases need qwen2_moe, Qwen3 q/k norms qwen3_moe)
PAIRS = [("tiny_llama", "mixtral"), ("tiny_llama", "qwen2_moe"), ("tiny_mistral", "mixtral"),
         ("tiny_mistral", "qwen2_moe"), ("tiny_qwen2", "qwen2_moe"), ("tiny_qwen3", "qwen3_moe")]


def _recipe(base: Path, arch: str, dtype: str = "float32", **extra) -> dict:
    return {"base_model": str(base), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
            "architecture": arch, "dtype": dtype, **extra}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture,arch", PAIRS)
def test_build_verify_passes_for_every_family_and_architecture(fixture, arch, dtype, request, tmp_path):
    base = request.getfixturevalue(fixture)
    result = upcycle(_recipe(base, arch, dtype), tmp_path / "moe", verify=True)
    v = result.verify
    assert v.ok, v.problems
    assert (v.loaded_class, v.loaded_dtype) == (CLASSES[arch], dtype)  # loaded in the folder's own dtype
    assert (v.num_experts, v.experts_per_token) == (4, 2)  # read under the architecture's own field names
    cfg = json.loads((result.output / "config.json").read_text())
    assert cfg[EXPERTS_KEY[arch]] == 4
    c = v.comparison
    assert c.positions > 50 and c.mean_kl <= IDENTITY_MAX_KL and c.top1_agreement >= 0.95
    if dtype == "float32":  # copies are function-preserving: only summation order differs
        assert c.mean_kl < 1e-9 and c.top1_agreement == 1.0
    assert v.perplexity_moe == pytest.approx(v.perplexity_dense, rel=1e-5 if dtype == "float32" else 1e-2)
    card = (result.output / "README.md").read_text()
    assert "## Runtimes" in card and "| transformers 5 | exact |" in card


def test_qwen2_base_and_output_tokenizers_differ_and_verify_feeds_both_the_same_ids(tiny_qwen2, tmp_path):
    """transformers 5 loads a generic-class qwen2 tokenizer as Qwen2Tokenizer but its qwen2_moe copy as the
    generic backend; they split digits differently, which used to crash verify with 'logit shapes differ'."""
    result = upcycle(_recipe(tiny_qwen2, "qwen2_moe"), tmp_path / "moe", verify=True)
    assert result.verify.ok, result.verify.problems
    assert any("Qwen2Tokenizer" in n and "What is 12 times 7?" in n for n in result.verify.notes), result.verify.notes


def test_experts_implementation_rule():
    assert experts_implementation(64, 172, torch.bfloat16) == "eager"  # 344-byte rows
    assert experts_implementation(64, 172, torch.float32) is None  # 688 = 43 x 16
    assert experts_implementation(64, 128, torch.bfloat16) is None
    assert experts_implementation(36, 128, torch.float16) == "eager"  # hidden rows of 72 bytes


def test_bf16_stories_generates_and_verify_fails_without_the_written_experts_implementation(stories, tmp_path):
    result = upcycle(_recipe(stories, "mixtral", "bfloat16"), tmp_path / "moe", verify=True)
    assert result.verify.ok, result.verify.problems
    assert result.verify.experts_implementation == "eager"
    cfg_path = result.output / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["experts_implementation"] == "eager" and cfg["intermediate_size"] == 172
    assert all(c["moe"] for c in result.verify.continuations)  # generated in bf16, as a user runs it
    assert result.verify.comparison.mean_kl < 1e-3  # compared upcast to fp32: bf16 weights, fp32 arithmetic
    # the output as transformers' default (grouped_mm) would run it: verify must fail, naming the cause
    del cfg["experts_implementation"]
    cfg_path.write_text(json.dumps(cfg))
    broken = verify(result.output, hashes=False)
    assert not broken.ok
    assert any("does not run" in p and "strides should be multiple of 16 bytes" in p for p in broken.problems), \
        broken.problems


def test_fp32_build_loaded_as_bf16_runs_and_aligned_shapes_keep_transformers_default(stories, tiny_llama, tmp_path):
    """An fp32 stories260K MoE has 688-byte rows (grouped_mm runs them) but 344-byte rows once loaded as bf16, as
    `route` loads it on a GPU and as most users load an fp32 checkpoint: the written field covers both (the H200
    run of `route` on CUDA failed with "strides should be multiple of 16 bytes" before)."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle.check.route import load_kwargs

    result = upcycle(_recipe(stories, "mixtral"), tmp_path / "moe")
    cfg_path = result.output / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert (cfg["dtype"], cfg["intermediate_size"], cfg["experts_implementation"]) == ("float32", 172, "eager")
    model = AutoModelForCausalLM.from_pretrained(str(result.output), dtype=torch.bfloat16).eval()
    assert model.config._experts_implementation == "eager"
    out = model.generate(torch.tensor([[1, 400, 37, 90]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)
    # a folder written without the field (an older build, another tool): route passes it where it loads in bf16
    del cfg["experts_implementation"]
    cfg_path.write_text(json.dumps(cfg))
    assert load_kwargs(result.output, "cuda") == {"dtype": torch.bfloat16, "device_map": "auto",
                                                  "experts_implementation": "eager"}
    assert load_kwargs(result.output, "cpu") == {"dtype": torch.float32}
    # rows aligned in every dtype (intermediate 128): transformers' own choice is left alone
    aligned = upcycle(_recipe(tiny_llama, "mixtral"), tmp_path / "aligned")
    assert "experts_implementation" not in json.loads((aligned.output / "config.json").read_text())
    assert load_kwargs(aligned.output, "cuda") == {"dtype": torch.bfloat16, "device_map": "auto"}
    # an MoE of an architecture this tool does not write (OLMoE): plain bf16, not a "plan error"
    from moe_upcycle.checkpoint.tiny import make_dense_model

    olmoe = make_dense_model(tmp_path / "olmoe", family="olmoe", seed=0, intermediate_size=172, num_experts=4,
                             num_experts_per_tok=2)
    assert load_kwargs(olmoe, "cuda") == {"dtype": torch.bfloat16, "device_map": "auto"}


# the ids come from the test (transformers 5 writes tiny tokenizers as "TokenizersBackend", unknown to 4.x)
TF4_LOGITS = """
import sys, json, torch
from transformers import AutoModelForCausalLM
model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, output_loading_info=True)
ids = torch.tensor([json.loads(sys.argv[2])])
with torch.inference_mode():
    logits = model.eval()(ids).logits[0]
print(json.dumps({"class": type(model).__name__, "problems": {k: list(v) for k, v in info.items() if v},
                  "logits": logits.tolist()}))
"""


def _ids(folder: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))(PROMPT_TEXT)["input_ids"]


def _tf4(folder: Path) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(TF4_PYTHON), "-c", TF4_LOGITS, str(folder), json.dumps(_ids(folder))],
                          capture_output=True, text=True, timeout=300, env=env, check=False)


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason="needs .venv-tf4 (transformers 4.57), which .ci/run creates")
@pytest.mark.parametrize("fixture,arch,shared", [("tiny_llama", "mixtral", False), ("tiny_qwen2", "qwen2_moe", False),
                                                 ("tiny_qwen2", "qwen2_moe", True), ("tiny_qwen3", "qwen3_moe", False)])
def test_transformers4_loads_per_expert_exactly_and_refuses_fused(fixture, arch, shared, request, tmp_path):
    from transformers import AutoModelForCausalLM

    base = request.getfixturevalue(fixture)
    # shared: the README's exact split (routed residual_scale 1/2, one shared expert behind the zero gate)
    extra = dict(num_experts=None, experts=[{"source_model": str(base), "residual_scale": 0.5}] * 4,
                 shared_experts=[{"source_model": str(base)}]) if shared else {}
    per_expert = upcycle(_recipe(base, arch, **extra), tmp_path / "per_expert").output
    run = _tf4(per_expert)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["class"] == CLASSES[arch] and not out["problems"]
    dense = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = dense(torch.tensor([_ids(per_expert)])).logits[0]  # the dense model in transformers 5, same ids
    got = torch.tensor(out["logits"])
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0)

    fused = upcycle(_recipe(base, arch, layout="fused", **extra), tmp_path / "fused").output
    run = _tf4(fused)
    assert run.returncode != 0  # loudly, not with random experts
    assert "does not contain the valid metadata" in run.stderr, run.stderr[-2000:]
    assert "pt-fused-experts" in (fused / "model-00001-of-00001.safetensors").read_bytes()[:4096].decode("latin1")


def _statuses(plan) -> dict[str, str]:
    return {v.runtime: v.status for v in compatibility(plan)}


def test_compatibility_of_each_architecture(tiny_llama, tiny_qwen2, tiny_qwen3_tied_bias):
    def plan(base, arch, **kw):
        return upcycle(_recipe(base, arch, **kw), dry_run=True).plan

    assert _statuses(plan(tiny_llama, "mixtral")) == dict.fromkeys(
        ["transformers 5", "transformers 4.x", "vLLM", "llama.cpp", "ExLlamaV2"], EXACT)
    # no shared experts: a one-neuron all-zero shared expert (no zero-size tensor); top-2 of 4, which
    # llama.cpp's qwen2moe does not renormalise
    q2 = compatibility(plan(tiny_qwen2, "qwen2_moe"))
    assert [v.status for v in q2] == [EXACT, EXACT, EXACT, RUNS, NO_LOAD]
    assert "never renormalises" in q2[3].why and "Qwen2MoeForCausalLM" in q2[4].why
    # the README's exact split: the constant gate is tiny, not zero, so llama.cpp gives no NaN; with
    # every expert active it computes what transformers does
    split = plan(tiny_qwen2, "qwen2_moe", experts=[{"source_model": str(tiny_qwen2), "residual_scale": 0.5}] * 4,
                 shared_experts=[{"source_model": str(tiny_qwen2)}], num_experts=None, experts_per_token=4)
    v = {v.runtime: v for v in compatibility(split)}
    assert v["llama.cpp"].status == EXACT and "NaN" not in v["llama.cpp"].why
    assert v["vLLM"].status == EXACT
    # a prompt-initialised gate is never exactly zero: llama.cpp then differs only by norm_topk_prob
    prompts = plan(tiny_qwen2, "qwen2_moe", gate_mode="cheap_embed", num_experts=None,
                   experts=[{"source_model": str(tiny_qwen2), "positive_prompts": [f"topic {i}"]} for i in range(4)],
                   shared_experts=[{"source_model": str(tiny_qwen2), "positive_prompts": ["shared"]}])
    v = {v.runtime: v for v in compatibility(prompts)}
    assert v["llama.cpp"].status == RUNS and "norm_topk_prob" in v["llama.cpp"].why
    # qwen3 with an attention-output bias
    v = {v.runtime: v for v in compatibility(plan(tiny_qwen3_tied_bias, "qwen3_moe"))}
    assert (v["vLLM"].status, v["llama.cpp"].status, v["ExLlamaV2"].status) == (RUNS, NO_LOAD, EXACT)
    # fused: transformers >= 5 only for Mixtral; llama.cpp's converter splits Qwen-MoE's fused experts
    fused = compatibility(plan(tiny_llama, "mixtral", layout="fused"))
    assert [v.status for v in fused] == [EXACT] + [NO_LOAD] * 4
    assert all("transformers >= 5 only" in v.why for v in fused[1:3] + fused[4:])
    assert "per-expert tensors only" in fused[3].why and "layout: per_expert" in fused[3].why
    fused = compatibility(plan(tiny_qwen3_tied_bias, "qwen3_moe", layout="fused"))  # o_proj bias: llama.cpp refuses
    assert "self_attn.o_proj.bias" in fused[3].why and "transformers >= 5 and llama.cpp only" in fused[1].why


def test_plan_cli_and_card_list_the_runtimes(tiny_llama, write_yaml, tmp_path):
    path = write_yaml(_recipe(tiny_llama, "mixtral", layout="fused"))
    res = CliRunner().invoke(app, ["plan", str(path)])
    assert res.exit_code == 0, res.output
    assert "runtimes (fused layout: transformers >= 5 only)" in res.output
    assert "transformers 4.x" in res.output and "will not load" in res.output
    out = upcycle(_recipe(tiny_llama, "mixtral", layout="fused"), tmp_path / "moe").output
    card = (out / "README.md").read_text()
    assert "The fused expert layout is transformers >= 5 only." in card
    assert "| transformers 4.x | will not load |" in card and "| transformers 5 | exact |" in card


@pytest.mark.parametrize("init,k,decided", [
    ({"method": "noise", "scale": 0.05}, 2, True),   # experts differ, 2 of 4: the tie picks which
    ("copy", 2, False),                              # the same expert 4 times: any pick computes the same
    ({"method": "noise", "scale": 0.05}, 4, False),  # all active: nothing to pick
])
def test_uniform_gates_leave_the_top_k_to_each_runtimes_tie_breaking(init, k, decided, tiny_llama):
    """Measured (issue hunt, llama.cpp 0.3.36 vs transformers 5, 4 noise copies, top-2): max |Δlogit| 0.32 where the
    plan said exact. llama.cpp takes the lowest-indexed experts on a tie; torch.topk on a CPU returned [2, 3]."""
    plan = upcycle({"base_model": str(tiny_llama), "num_experts": 4, "experts_per_token": k, "gate_mode": "uniform",
                    "expert_init": init}, dry_run=True).plan
    verdicts = {v.runtime: v for v in compatibility(plan)}
    said = [n for n in plan.notes if n.startswith("gate_mode uniform: every expert scores the same")]
    assert plan.ties_decide is decided and len(said) == int(decided) and (said == [] or said[0] in plan.cautions)
    assert verdicts["transformers 4.x"].status == EXACT  # the same torch, the same tie order: measured 0.0
    for runtime in ("llama.cpp", "vLLM", "ExLlamaV2"):
        assert verdicts[runtime].status == (RUNS if decided else EXACT), (runtime, verdicts[runtime])
    if decided:
        assert "llama.cpp breaks the tie with the lowest-indexed experts" in verdicts["llama.cpp"].why
        assert verdicts["vLLM"].why.startswith("gate_mode uniform ties every expert's score")
        assert "routing is uniform only with experts_per_token: 4" in said[0]
