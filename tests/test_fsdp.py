"""`upcycle_model` inside a torch.distributed job (issue 33, part 3): FSDP2 / HSDP-sharded dense models become MoEs
sharded the same way, equal to the one-process upcycle, trainable, checkpointed with DCP and published.

Real processes: tests/fsdp_worker.py and scripts/train_fsdp_example.py run under torchrun with 2 gloo ranks on the
CPU, once per module; the tests compare what they recorded with a one-process `upcycle_model`, a file build
(`upcycle`) and transformers loading the published folders.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_upcycle import upcycle, upcycle_model
from tolerances import assert_close_rel

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "fsdp_worker.py"
PROMPTS = ["Once upon a time there was a little dragon.", "def add(a, b):\n    return a + b"]


def torchrun(args: list, timeout: int = 600, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama, tiny_qwen3, tiny_qwen2_tied):
    """Every scenario of the worker, once: {"out": folder, 0: rank 0's results, 1: rank 1's}."""
    out = tmp_path_factory.mktemp("fsdp")
    torchrun([WORKER, out, tiny_llama, tiny_qwen3, tiny_qwen2_tied])
    return {"out": out, **{r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)}}


def load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval(), AutoTokenizer.from_pretrained(str(folder))


def logits(model, tokenizer, text=PROMPTS[0]):
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits


def tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    found = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    return found


def assert_same_parameters(gathered: dict, model) -> None:
    """The whole parameters gathered from the ranks are the one-process model's, bit for bit."""
    expected = dict(model.named_parameters())
    assert sorted(gathered) == sorted(expected)
    different = [n for n, t in gathered.items() if not torch.equal(t, expected[n].detach())]
    assert not different, different


def test_copy_init_keeps_the_dense_logits_and_the_sharding(run, tiny_llama):
    dense, tok = load(tiny_llama)
    got = run[0]["copy_llama"]
    for rank in (0, 1):  # every rank computes the unsharded dense model's logits (fp32: relative to their size)
        assert_close_rel(run[rank]["copy_llama"]["logits"], logits(dense, tok))
    assert_close_rel(got["dense_logits"], logits(dense, tok))
    assert got["moe_class"] == "FSDPModule" and got["training"]
    assert got["fsdp"] == ["", "model.layers.0", "model.layers.1"]  # the dense model's units: layers, then the root
    placements = got["moe_placements"]
    assert set(placements) == {n for n, _ in upcycle_model(dense, num_experts=3).named_parameters()}
    assert set(placements.values()) == {(("S(0)",), (2,))}  # every parameter a DTensor on the 2-rank mesh
    for name, where in got["dense_placements"].items():
        if ".mlp." not in name:
            assert placements[name] == where, name


def test_each_rank_allocates_only_its_own_shards(run, tiny_llama):
    """3 experts over 2 ranks: each rank holds torch.chunk's share of every parameter, nothing more."""
    dense, _ = load(tiny_llama)
    one = upcycle_model(dense, num_experts=3, experts_per_token=2, seed=3)
    first = sum(math.ceil(p.shape[0] / 2) * p[0].numel() * p.element_size() for p in one.parameters())
    total = sum(p.numel() * p.element_size() for p in one.parameters())
    assert run[0]["copy_llama"]["total_bytes"] == total
    assert (run[0]["copy_llama"]["local_bytes"], run[1]["copy_llama"]["local_bytes"]) == (first, total - first)


def test_the_whole_parameters_are_the_one_process_upcycle(run, tiny_llama):
    dense, _ = load(tiny_llama)
    assert_same_parameters(run[0]["copy_llama"]["full"], upcycle_model(dense, num_experts=3, experts_per_token=2,
                                                                       seed=3))


def test_a_seed_gives_the_same_random_experts_on_two_ranks_as_in_one_process(run, tiny_llama):
    dense, _ = load(tiny_llama)
    drop = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init={"method": "drop", "ratio": 0.5},
                         seed=7, gate="uniform_random")
    assert_same_parameters(run[0]["random_llama"]["full"], drop)
    noise = upcycle_model(dense, num_experts=4, experts_per_token=1, expert_init={"method": "noise", "scale": 0.01},
                          seed=7, architecture="qwen2_moe")
    assert_same_parameters(run[1]["random_llama"]["noise_full"], noise)
    split = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=7,
                          expert_init={"method": "split", "granularity": 2, "shuffle": True})
    assert_same_parameters(run[0]["random_llama"]["split_full"], split)


def test_the_published_copy_is_the_file_build_byte_for_byte(run, tiny_llama, tmp_path):
    built = upcycle({"base_model": str(tiny_llama), "num_experts": 3, "experts_per_token": 2, "gate_mode": "random",
                     "seed": 3, "report_init_drift": False}, tmp_path / "moe").output
    published = run["out"] / "copy_llama_hf"
    expected, got = tensors(built), tensors(published)
    assert sorted(got) == sorted(expected)  # per-expert names: ...block_sparse_moe.experts.{e}.w1.weight
    assert not [k for k in got if not torch.equal(got[k], expected[k])]
    assert json.loads((published / "config.json").read_text()) == json.loads((built / "config.json").read_text())
    manifest = json.loads((published / "moe_upcycle.json").read_text())
    assert manifest["tool"] == "moe-upcycle" and manifest["exported"]["world_size"] == 2
    assert set(manifest["sha256"]) == {p.name for p in published.iterdir()} - {"moe_upcycle.json"}
    dense, tok = load(tiny_llama)
    assert_close_rel(logits(load(published)[0], tok), logits(dense, tok))


def test_a_tied_qwen2_keeps_its_tie_and_publishes_the_builds_tensors(run, tiny_qwen2_tied, tmp_path):
    got = run[0]["tied_qwen2"]
    assert got["tied"] and run[1]["tied_qwen2"]["tied"]
    dense, tok = load(tiny_qwen2_tied)
    assert_close_rel(got["logits"], logits(dense, tok, PROMPTS[1]))
    one = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=5)
    assert_same_parameters(got["full"], one)
    built = upcycle({"base_model": str(tiny_qwen2_tied), "num_experts": 4, "experts_per_token": 2,
                     "gate_mode": "random", "seed": 5, "report_init_drift": False}, tmp_path / "moe").output
    expected, published = tensors(built), tensors(run["out"] / "tied_qwen2_hf")
    assert "lm_head.weight" in published  # llama.cpp's qwen2moe needs the tied head written, as a build does
    assert sorted(published) == sorted(expected)
    assert not [k for k in published if not torch.equal(published[k], expected[k])]


BF16_REL = 3e-2  # bf16 keeps 8 bits of mantissa (eps 7.8e-3): a few roundings of the largest logit


def test_no_storage_is_gathered_twice_on_a_tied_qwen2(run, tiny_qwen2_tied):
    """A spy on DTensor.full_tensor in every rank: upcycle_model and save_hf_folder gather each storage at most
    once (the tied embedding was gathered twice in each), and the MoE still computes the dense logits."""
    from collections import Counter

    for rank in (0, 1):
        calls = run[rank]["ties"]["gathers"]
        phases = {phase for phase, _, _ in calls}
        assert phases == {"fp32 upcycle_model", "fp32 save_hf_folder", "bf16 upcycle_model", "bf16 save_hf_folder",
                          "unwrapped root upcycle_model"}
        twice = {key: n for key, n in Counter((phase, ptr) for phase, ptr, _ in calls).items() if n > 1}
        assert not twice, twice
        # the embedding (300 x 64, tied to the head) is gathered exactly once to be written, lm_head.weight with it
        assert [shape for phase, _, shape in calls if phase == "fp32 save_hf_folder"].count((300, 64)) == 1
        assert run[rank]["ties"]["fp32"]["tied"] and run[rank]["ties"]["bf16"]["tied"]
    dense, tok = load(tiny_qwen2_tied)
    for rank in (0, 1):
        assert_close_rel(run[rank]["ties"]["fp32"]["logits"], logits(dense, tok, PROMPTS[1]))
    uneven = run["out"] / "qwen2_uneven"
    from transformers import AutoModelForCausalLM

    dense16 = AutoModelForCausalLM.from_pretrained(str(uneven), dtype=torch.bfloat16).eval()
    expected = logits(dense16, load(uneven)[1], PROMPTS[1]).float()
    assert run[0]["ties"]["bf16"]["dtypes"] == ["torch.bfloat16"]
    assert_close_rel(run[0]["ties"]["bf16"]["logits"], expected, rel=BF16_REL)


@pytest.mark.parametrize("case", ["fp32", "bf16"])
def test_save_hf_folder_writes_the_builds_dtypes_and_bytes(run, tiny_qwen2_tied, case, tmp_path):
    """bf16 and a vocabulary (301) and expert count (3) that 2 ranks do not divide: every tensor written is the file
    build's, same dtype, same bytes (the bf16 build casts the fp32 files as transformers cast the dense model)."""
    base = tiny_qwen2_tied if case == "fp32" else run["out"] / "qwen2_uneven"
    recipe = {"base_model": str(base), "num_experts": 4 if case == "fp32" else 3, "experts_per_token": 2,
              "gate_mode": "random", "seed": 5, "report_init_drift": False,
              **({"dtype": "bfloat16"} if case == "bf16" else {})}
    built = tensors(upcycle(recipe, tmp_path / "moe").output)
    published = tensors(run["out"] / f"ties_{case}_hf")
    assert sorted(published) == sorted(built) and "lm_head.weight" in published
    want = torch.float32 if case == "fp32" else torch.bfloat16
    assert {str(t.dtype) for t in published.values()} == {str(want)}
    assert published["model.embed_tokens.weight"].shape == ((300, 64) if case == "fp32" else (301, 64))
    different = [k for k in published if published[k].dtype != built[k].dtype
                 or not torch.equal(published[k].view(torch.uint8), built[k].view(torch.uint8))]
    assert not different, different
    config = json.loads((run["out"] / f"ties_{case}_hf" / "config.json").read_text())
    assert config["torch_dtype"] == str(want).removeprefix("torch.")


def test_buffers_are_computed_on_the_mesh_device_after_allocation(run):
    """Layers wrapped, root not (FSDP moves no root buffer): every buffer is a new tensor, on the parameters'
    device, holding the rotary formula inv_freq[i] = 1 / theta ** (2i / d) — not the tensors the MoE was
    constructed with, restored after to_empty."""
    for rank in (0, 1):
        got = run[rank]["ties"]["buffers"]
        rope = run[rank]["ties"]["rope"]
        params = got.pop("params")
        assert set(got) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
        d = rope["head_dim"]
        formula = 1.0 / (rope["theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        for name, buf in got.items():
            assert not buf["constructed"], name
            assert {buf["device"]} == params == {"cpu"}
            assert buf["values"].dtype == torch.float32
            torch.testing.assert_close(buf["values"].double(), formula, rtol=2 * torch.finfo(torch.float32).eps,
                                       atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_buffers_of_a_sharded_moe_are_on_the_gpu_when_the_root_is_not_wrapped(tiny_llama):
    """One NCCL rank, layers wrapped, root not: the rotary buffers are on the GPU, as every parameter is, and the MoE
    computes the dense logits there. Not run on the CPU machine this was written on."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        dense, tok = load(tiny_llama)
        dense = dense.to(device)
        ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"].to(device)
        with torch.no_grad():
            expected = dense(input_ids=ids).logits.float().cpu()
        for layer in dense.model.layers:
            fully_shard(layer)
        moe = upcycle_model(dense, num_experts=2, experts_per_token=1)
        assert {str(b.device) for b in moe.buffers()} == {"cuda:0"}
        assert {str(p.device) for p in moe.parameters()} == {"cuda:0"}
        with torch.no_grad():
            assert_close_rel(moe.eval()(input_ids=ids).logits.float().cpu(), expected)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_hsdp_is_mirrored_with_the_dense_settings(run, tiny_llama, shape):
    got = run[0]["hsdp_llama"][shape]
    dense, tok = load(tiny_llama)
    assert_close_rel(got["logits"], logits(dense, tok))
    assert set(got["placements"].values()) == {(("R", "S(0)"), shape)}  # replicated over dim 0, sharded over 1
    assert got["frozen"] == ["model.embed_tokens.weight"]  # frozen in the dense model, frozen in the MoE
    assert got["reshard_after_forward"] is False  # as the dense model's layers were given
    assert "param_dtype=torch.float32, reduce_dtype=torch.float32" in got["mp_policy"]


def test_other_wrappings_are_mirrored(run, tiny_llama):
    dense, tok = load(tiny_llama)
    expected = logits(dense, tok)
    got = run[0]["wrappings"]
    for case in got.values():
        assert_close_rel(case["logits"], expected)
        assert case["grads"] == sorted([*case["placements"], *case["plain"]])  # every parameter got a gradient
    assert got["layers_only"]["units"] == ["model.layers.0", "model.layers.1"]
    assert got["layers_only"]["plain"] == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    # each projection was a unit: the MoE block that replaces them is one
    assert got["per_projection"]["units"] == ["", "model.layers.0", "model.layers.0.mlp", "model.layers.1",
                                               "model.layers.1.mlp"]
    grouped = got["grouped_ignored_offloaded"]
    assert grouped["units"] == ["", "model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert grouped["plain"] == ["lm_head.weight"]  # ignored by FSDP in the dense model, so in the MoE
    assert grouped["checkpointing"] and grouped["offloaded"] == "CPUOffloadPolicy"
    assert not got["layers_only"]["checkpointing"]
    dim_one = got["dim_one"]
    assert dim_one["placements"]["model.layers.0.self_attn.q_proj.weight"] == (("S(1)",), (2,))
    assert all(dim_one["placements"][n] == p for n, p in dim_one["dense_placements"].items() if ".mlp." not in n)


def test_adamw_trains_the_sharded_moe_and_gradients_reach_routers_and_experts(run):
    got = run[0]["train_qwen3"]
    assert got["losses"] == run[1]["train_qwen3"]["losses"]  # all-reduced: one number per step
    assert got["losses"][-1] < 0.7 * got["losses"][0] and all(map(math.isfinite, got["losses"]))
    for layer in (0, 1):
        for name in ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            assert got["grads"][f"model.layers.{layer}.{name}"] > 0, name


def test_dcp_save_then_load_into_a_fresh_moe_is_bit_exact(run):
    for rank in (0, 1):
        got = run[rank]["train_qwen3"]
        assert got["dcp_differed_before"] and got["dcp_restored"]
    assert (run["out"] / "dcp" / ".metadata").is_file()


def test_the_trained_moe_publishes_a_folder_transformers_loads_with_the_same_logits(run, tiny_qwen3):
    folder = run["out"] / "trained_qwen3_hf"
    model, tok = load(folder)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert_close_rel(logits(model, tok), run[0]["train_qwen3"]["trained_logits"])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # max_shard_size="40KB": several shards
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]


def test_tensor_parallelism_is_refused_with_the_parameter_and_the_fix(run):
    for rank in (0, 1):
        kind, message = run[rank]["refusals"]["tp"]
        assert kind == "ConfigError"
        assert "'model.layers.0.mlp.gate_proj.weight'" in message and "tensor parallelism" in message
        assert "upcycle the model before applying tensor parallelism, then apply your TP plan to the MoE" in message
        kind, message = run[rank]["refusals"]["fsdp_tp"]  # FSDP over TP (2-D mesh): refused the same way
        assert kind == "ConfigError" and "self_attn.q_proj.weight' is sharded by tensor parallelism and FSDP" in message
        assert "upcycle the model before applying tensor parallelism" in message


def test_one_ranks_failure_is_raised_on_every_rank(run):
    assert run[1]["refusals"]["one_rank_fails"] == ("ConfigError", "rank-local problem")
    kind, message = run[0]["refusals"]["one_rank_fails"]
    assert kind == "ConfigError" and message.startswith("rank 1 of 2 (host ")
    assert message.endswith("): a test step failed, so every rank stops: rank-local problem")


def test_publishing_over_a_users_folder_is_refused_on_every_rank_and_nothing_is_touched(run):
    for rank in (0, 1):
        kind, message = run[rank]["refusals"]["users_folder"]
        assert kind == "OutputError" and "not written by moe-upcycle" in message and "notes.txt" in message
        assert run[rank]["refusals"]["users_folder_kept"] == ["notes.txt"]
        assert run[rank]["refusals"]["bad_size"][0] == "ConfigError"
    assert (run["out"] / "users_folder" / "notes.txt").read_text() == "mine"
    assert not (run["out"] / "x").exists()


def test_the_example_training_script_runs_under_torchrun(tmp_path, stories):
    """scripts/train_fsdp_example.py, as the README shows it: 2 gloo ranks on the CPU."""
    done = torchrun([REPO / "scripts" / "train_fsdp_example.py", "--model", stories, "--out", tmp_path, "--steps", 4])
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["checkpoint_round_trip"] is True
    assert report["losses"][-1] < report["losses"][0]
    # the published folder is the DCP checkpoint's model: both give the same logits
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    published, tok = load(tmp_path / "hf")
    from_dcp = AutoModelForCausalLM.from_config(published.config, dtype=torch.float32).eval()
    from_dcp.load_state_dict(state)
    assert_close_rel(logits(published, tok), logits(from_dcp, tok))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_example_training_script_runs_with_nccl_on_gpus(tmp_path, stories):
    """The same job on the GPUs with NCCL (one rank per GPU). Not run on the CPU machine this was written on."""
    gpus = torch.cuda.device_count()
    done = torchrun([REPO / "scripts" / "train_fsdp_example.py", "--model", stories, "--out", tmp_path, "--steps", 4,
                     "--device", "cuda"], nproc=min(gpus, 2))
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["checkpoint_round_trip"] is True and report["losses"][-1] < report["losses"][0]
    load(tmp_path / "hf")


def test_save_hf_folder_in_one_process_writes_the_build_and_replaces_only_its_own(tiny_llama, tmp_path):
    """The world-size-1 case: a model holding no DTensor is published the same way, with no process group."""
    from moe_upcycle.distributed.dcp_export import save_hf_folder
    from moe_upcycle.errors import ConfigError, OutputError

    dense, tok = load(tiny_llama)
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=3,
                        expert_init={"method": "drop", "ratio": 0.5})
    built = upcycle({"base_model": str(tiny_llama), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                     "seed": 3, "expert_init": {"method": "drop", "ratio": 0.5}, "report_init_drift": False},
                    tmp_path / "built").output
    out = save_hf_folder(moe, tmp_path / "nested" / "moe", tokenizer=tiny_llama, max_shard_size="100KB")
    expected, got = tensors(built), tensors(out)
    assert sorted(got) == sorted(expected) and not [k for k in got if not torch.equal(got[k], expected[k])]
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert_close_rel(logits(load(out)[0], tok), logits(moe.eval(), tok))
    with pytest.raises(OutputError, match="already exists and is not empty"):
        save_hf_folder(moe, out)
    save_hf_folder(moe, out, force=True, tokenizer=tok)  # ours: replaced; a loaded tokenizer is saved
    assert (out / "tokenizer.json").is_file() and (out / "moe_upcycle.json").is_file()
    (tmp_path / "file").write_text("mine")
    with pytest.raises(OutputError):
        save_hf_folder(moe, tmp_path / "file", force=True)
    assert (tmp_path / "file").read_text() == "mine"
    with pytest.raises(ConfigError, match="tokenizer: .* is not a folder"):
        save_hf_folder(moe, tmp_path / "x", tokenizer=tmp_path / "missing")
    with pytest.raises(ConfigError, match="tokenizer: expected a folder or a tokenizer"):
        save_hf_folder(moe, tmp_path / "x", tokenizer=123)
    with pytest.raises(ConfigError, match="max_shard_size"):
        save_hf_folder(moe, tmp_path / "x", max_shard_size=0)
    with pytest.raises(ConfigError) as caught:
        save_hf_folder(dense.config, None, force="yes", checksums=1)
    assert [p.split(":")[0] for p in caught.value.problems] == ["force", "checksums", "output", "model"]
    assert not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["built", "file", "nested"]
