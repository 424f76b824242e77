"""The research path on CPU (issue 16): upcycle_model keeps device and dtype, is deterministic per seed,
a trained in-memory MoE saves, reloads with dtype="auto" and generates, and builds create missing parents.

The CUDA half of the same paths is in test_cuda_paths.py (``pytest -m cuda``).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import PROMPT_TEXT
from moe_upcycle import upcycle, upcycle_model
from moe_upcycle.errors import ConfigError, OutputError
from moe_upcycle.planning.model_config import experts_implementation_for
from moe_upcycle.checkpoint.placement import DensePlacement, dense_placement
from tf4_logits import NO_TF4, REPO, TF4_PYTHON

INITS = {
    "copy": "copy",
    "noise": {"method": "noise", "scale": 0.01},
    "drop": {"method": "drop", "ratio": 0.5},
    "split": {"method": "split", "granularity": 2, "shuffle": True},
}


def load_dense(folder, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


def logits(model, ids):
    with torch.inference_mode():
        return model.eval()(input_ids=ids).logits.float()


def close(actual, expected, rel):
    """assert_close with a tolerance relative to the largest |expected| value."""
    torch.testing.assert_close(actual, expected, atol=rel * float(expected.abs().max()), rtol=0)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def stories_dense(request, stories):
    model, tok = load_dense(stories, request.param)
    return model, tok, request.param


# ---------------------------------------------------------------- experts_implementation


def test_experts_implementation_follows_16_byte_rows():
    stories = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 172}
    assert experts_implementation_for(stories, torch.bfloat16) == "eager"  # 344-byte rows
    assert experts_implementation_for(stories, "float32") is None  # 688-byte rows: grouped_mm runs
    assert experts_implementation_for({**stories, "intermediate_size": 86}, "float32") == "eager"  # split G=2
    assert experts_implementation_for({**stories, "hidden_size": 60, "intermediate_size": 128}, "bfloat16") == "eager"
    qwen = {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 176, "moe_intermediate_size": 44}
    assert experts_implementation_for(qwen, torch.bfloat16) == "eager"  # the routed experts' size counts
    assert experts_implementation_for({**qwen, "moe_intermediate_size": 48}, torch.bfloat16) is None


# ---------------------------------------------------------------- device, dtype, determinism


@pytest.mark.parametrize("init", INITS)
def test_dtype_and_device_kept_and_deterministic_per_seed(stories_dense, init):
    dense, _, dtype = stories_dense
    a = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=5)
    b = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=5)
    c = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=6)
    assert {(p.dtype, p.device.type) for p in a.parameters()} == {(dtype, "cpu")}
    assert {b.device.type for b in a.buffers()} == {"cpu"}
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    # copy and split take the dense FFN's bytes; noise, drop and a shuffled split depend on the seed
    assert torch.equal(sa[experts], sc[experts]) == (init == "copy")
    assert not torch.equal(sa["model.layers.0.mlp.gate.weight"], sc["model.layers.0.mlp.gate.weight"])


def test_offloaded_dense_model_is_refused_with_the_parameter_named(stories):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(stories)))
    with pytest.raises(ConfigError, match=r"parameter\(s\) are on the meta device \(e.g. model.embed_tokens.weight\)"):
        upcycle_model(meta, num_experts=2, experts_per_token=1)


def test_each_moe_parameter_goes_where_its_dense_module_was(stories):
    dense, _ = load_dense(stories, torch.float32)
    placement = dense_placement(dense)
    assert placement.main == torch.device("cpu") and placement.device_map is None
    # a spread placement, as accelerate's device_map makes it (meta stands in for a second device)
    spread = DensePlacement(torch.device("cpu"), {**placement.modules, "model.layers.1": torch.device("meta"),
                                                  "model.layers.1.mlp": torch.device("meta")})
    assert spread.device_for("model.layers.1.mlp.experts.gate_up_proj").type == "meta"
    assert spread.device_for("model.layers.1.mlp.gate.weight").type == "meta"  # router beside its experts
    assert spread.device_for("model.layers.0.mlp.experts.down_proj").type == "cpu"
    assert spread.device_for("model.rotary_emb.inv_freq").type == "cpu"  # unknown module: main device


# ---------------------------------------------------------------- train, save, reload, generate


@pytest.mark.parametrize("init", INITS)
def test_trained_moe_saves_reloads_with_dtype_auto_and_generates(stories_dense, init, tmp_path):
    from transformers import AutoModelForCausalLM

    dense, tok, dtype = stories_dense
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=1)
    ids = tok(PROMPT_TEXT, return_tensors="pt")["input_ids"]
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    loss = moe.train()(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(moe.parameters(), lr=0.05).step()  # a step big enough to move bf16 weights
    experts = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(moe.state_dict()[experts], before[experts])  # it really trained
    moe.eval()
    moe.save_pretrained(tmp_path / "trained")
    saved = json.loads((tmp_path / "trained" / "config.json").read_text())
    # 172 (86 for split) x 2 bytes are not 16-byte aligned: eager, in fp32 too (it may be cast to bf16 and saved)
    assert saved.get("experts_implementation") == "eager"
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype="auto").eval()
    assert next(reloaded.parameters()).dtype == dtype
    assert reloaded.config._experts_implementation == moe.config._experts_implementation
    # same weights, same kernel: the same logits (bf16: up to rounding of the last ops)
    close(logits(reloaded, ids), logits(moe, ids), 1e-6 if dtype == torch.float32 else 1e-2)
    gen_args = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        out_mem = moe.generate(input_ids=ids, **gen_args)
        out_disk = reloaded.generate(input_ids=ids, **gen_args)
    assert out_disk.shape == (1, ids.shape[1] + 8)
    assert torch.equal(out_disk, out_mem)


@pytest.mark.parametrize("family, architecture", [("stories", "qwen2_moe"), ("qwen3", "qwen3_moe")])
@pytest.mark.parametrize("init", INITS)
def test_every_init_into_every_output_architecture_trains_saves_and_reloads(stories, tmp_path, init, family,
                                                                            architecture):
    """Beside Mixtral (above): every init into Qwen2-MoE (from stories260K) and Qwen3-MoE (from a tiny Qwen3), in
    bf16: dtype kept, one step trains, save -> from_pretrained(dtype="auto") gives the trained weights bit for bit,
    the same logits and the same greedy tokens."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle.checkpoint.tiny import make_dense_model

    folder = stories if family == "stories" else make_dense_model(tmp_path / family, family=family, seed=0)
    dense = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    ids = torch.tensor([[1, 403, 257, 118, 30, 37, 13, 400, 267, 94]]) % dense.config.vocab_size
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=INITS[init], seed=1,
                        architecture=architecture)
    assert type(moe).__name__ == {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[architecture]
    assert {p.dtype for p in moe.parameters()} == {torch.bfloat16}
    moe.train()(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(moe.parameters(), lr=0.05).step()
    moe.eval().save_pretrained(tmp_path / "trained")
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype="auto").eval()
    assert type(back) is type(moe)
    saved, trained = back.state_dict(), moe.state_dict()
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in trained)
    close(logits(back, ids), logits(moe, ids), 1e-2)
    with torch.inference_mode():
        a = moe.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        b = back.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert a.shape == (1, ids.shape[1] + 6) and torch.equal(a, b)


def test_fp32_master_weights_cast_to_bf16_save_and_generate(stories, tmp_path):
    """The README recipe: train fp32 master weights, cast to bf16, save; the bf16 reload runs generate."""
    from transformers import AutoModelForCausalLM

    dense, tok = load_dense(stories, torch.bfloat16)
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, dtype="float32")
    assert {p.dtype for p in moe.parameters()} == {torch.float32}
    ids = tok(PROMPT_TEXT, return_tensors="pt")["input_ids"]
    ref = logits(moe, ids)  # fp32 (a module cast in place also casts its rotary buffer: compare before)
    moe.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype="auto").eval()
    assert next(reloaded.parameters()).dtype == torch.bfloat16
    with torch.inference_mode():
        out = reloaded.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape == (1, ids.shape[1] + 4)
    close(logits(reloaded, ids), ref, 3e-2)  # bf16 weights vs fp32: a few bf16 ulps of the largest logit


def test_copy_and_split_stay_equal_to_dense_in_bf16(stories_dense):
    dense, tok, dtype = stories_dense
    ids = tok(PROMPT_TEXT, return_tensors="pt")["input_ids"]
    ref = logits(dense, ids)
    rel = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: the MoE sums experts in another order
    for init in ("copy", "split"):
        moe = upcycle_model(dense, num_experts=8, experts_per_token=2,
                            expert_init={"method": "split", "granularity": 2} if init == "split" else "copy")
        close(logits(moe, ids), ref, rel)


# ---------------------------------------------------------------- build output folder


def test_build_makes_missing_parent_folders(stories, write_yaml, tmp_path):
    config = write_yaml({"base_model": str(stories), "num_experts": 2, "experts_per_token": 1, "gate_mode": "uniform"})
    target = tmp_path / "out" / "runs" / "my-moe"
    result = upcycle(config, target)
    assert result.output == target.resolve()
    assert json.loads((target / "config.json").read_text())["num_local_experts"] == 2
    assert sorted(p.name for p in (tmp_path / "out" / "runs").iterdir()) == ["my-moe"]  # no lock/stage left


def test_build_parent_blocked_by_a_file_is_a_clear_error(stories, write_yaml, tmp_path):
    config = write_yaml({"base_model": str(stories), "num_experts": 2, "experts_per_token": 1, "gate_mode": "uniform"})
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(OutputError, match=r"my-moe: .*/out is a file, not a folder, so the output cannot go under it"):
        upcycle(config, tmp_path / "out" / "runs" / "my-moe")
    assert (tmp_path / "out").read_text() == "not a folder"


TF4_ROUND_TRIP = """
import json, sys, tempfile, torch
import transformers
from transformers import AutoModelForCausalLM
from moe_upcycle import upcycle_model
inits = json.loads(sys.argv[2])
dense = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.tensor([[1, 403, 257, 118, 30, 37, 13, 400, 267, 94]])
with torch.no_grad():
    want = dense(ids).logits
out = {"version": transformers.__version__}
for arch in ("mixtral", "qwen2_moe"):
    for name, init in inits.items():
        moe = upcycle_model(dense, num_experts=2, expert_init=init, architecture=arch).eval()
        with torch.no_grad():
            got = moe(ids).logits
        with tempfile.TemporaryDirectory() as folder:  # the child's own: removed, not left in /tmp
            moe.save_pretrained(folder)
            back = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
        with torch.no_grad():
            again = back(ids).logits
            new = back.generate(ids, max_new_tokens=4, do_sample=False).shape[1] - ids.shape[1]
        out[arch + " " + name] = [float((got - want).abs().max()), float((again - got).abs().max()), new,
                                  type(back).__name__]
print(json.dumps(out))
"""


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_upcycle_model_in_transformers_4(stories):
    """In transformers 4.57 (the `.venv-tf4` CI makes), upcycle_model on stories260K — whose expert rows are not
    16-byte aligned in bf16, so transformers 5 gets experts_implementation — works for every init and both
    Qwen/Mixtral outputs: copy equals the dense logits, and save_pretrained -> from_pretrained(dtype="auto") gives
    the same logits and generates. Before, every call raised "MixtralForCausalLM.__init__() got an unexpected keyword
    argument 'experts_implementation'"."""
    import subprocess

    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    run = subprocess.run([str(TF4_PYTHON), "-c", TF4_ROUND_TRIP, str(stories), json.dumps(INITS)], capture_output=True,
                         text=True, timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("version").startswith("4.57")
    assert len(out) == 2 * len(INITS)
    for case, (to_dense, reload_gap, new_tokens, cls) in out.items():
        assert reload_gap == 0.0 and new_tokens == 4, (case, out[case])
        assert cls == ("MixtralForCausalLM" if case.startswith("mixtral") else "Qwen2MoeForCausalLM")
        if case.endswith(("copy", "split")):  # function-preserving inits
            assert to_dense < 1e-4, (case, to_dense)
