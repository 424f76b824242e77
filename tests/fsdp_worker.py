"""Run by tests/test_fsdp.py under torchrun (gloo, CPU): upcycle FSDP2-sharded dense models and record what came out.

Usage: python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_worker.py OUT LLAMA QWEN3 QWEN2_TIED [SCENARIOS]

Every rank writes ``OUT/rank{r}.pt`` (a dict of results; tensors on the CPU) and rank 0 writes the gathered whole
MoE parameters, the published folders and the DCP checkpoint under OUT. The test process compares them with a
one-process `upcycle_model` and with transformers loading the published folders. Each scenario is one function.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from moe_upcycle import save_hf_folder, upcycle_model
from moe_upcycle.distributed.fsdp_layout import reshard
from moe_upcycle.distributed.rank_failures import all_or_none
from moe_upcycle.errors import ConfigError, UpcycleError

PROMPTS = ["Once upon a time there was a little dragon.", "def add(a, b):\n    return a + b",
           "The cat sat on the mat.", "What is 12 times 7?"]
RANDOM_INIT = {"method": "drop", "ratio": 0.5}


def load_dense(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def shard(model, mesh=None, **kwargs):
    """FSDP2 as torchtitan applies it: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def ids_of(path: Path, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))(text, return_tensors="pt")["input_ids"]


def logits(model, ids):
    """Logits of a sharded model; its root's parameters are sharded again after (FSDP keeps them gathered after a
    forward without backward)."""
    with torch.no_grad():
        out = model(input_ids=ids).logits
    reshard(model)
    return out


def gathered(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective per parameter)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def local_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())


def total_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def placements(model) -> dict[str, tuple]:
    return {n: (tuple(map(str, p.placements)), tuple(p.device_mesh.shape)) for n, p in model.named_parameters()
            if hasattr(p, "placements")}


def copy_llama(out: Path, llama: Path, rank: int) -> dict:
    """FSDP on 2 ranks, copy init: logits, placements, per-rank bytes, the untrained folder a build would write."""
    dense = shard(load_dense(llama))
    ids = ids_of(llama, PROMPTS[0])
    with torch.no_grad():  # a forward before upcycling leaves the root's parameters gathered
        dense_logits = dense(input_ids=ids).logits
    moe = upcycle_model(dense, num_experts=3, experts_per_token=2, seed=3)  # 3 experts: uneven over 2 ranks
    training = moe.training
    result = {"logits": logits(moe.eval(), ids), "dense_logits": dense_logits, "moe_placements": placements(moe),
              "dense_placements": placements(dense), "local_bytes": local_bytes(moe), "total_bytes": total_bytes(moe),
              "moe_class": type(moe).__mro__[1].__name__, "fsdp": [n for n, m in moe.named_modules()
                                                               if type(m).__name__.startswith("FSDP")],
              "training": training, "full": gathered(moe)}
    save_hf_folder(moe, out / "copy_llama_hf", tokenizer=llama)
    return result


def tied_qwen2(out: Path, qwen2: Path, rank: int) -> dict:
    """Qwen2 with tied embeddings and q/k/v biases -> Qwen2-MoE (shared expert): the tie survives sharding."""
    dense = shard(load_dense(qwen2))
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=5)
    result = {"logits": logits(moe.eval(), ids_of(qwen2, PROMPTS[1])), 
              "tied": moe.lm_head.weight is moe.model.embed_tokens.weight, "full": gathered(moe)}
    save_hf_folder(moe, out / "tied_qwen2_hf", tokenizer=qwen2)
    return result


def random_llama(out: Path, llama: Path, rank: int) -> dict:
    """A random init with seed 7: the whole parameters, to compare with one process."""
    dense = shard(load_dense(llama))
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=RANDOM_INIT, seed=7,
                        gate="uniform_random")
    noise = upcycle_model(dense, num_experts=4, experts_per_token=1, expert_init={"method": "noise", "scale": 0.01},
                          seed=7, architecture="qwen2_moe")
    split = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=7,
                          expert_init={"method": "split", "granularity": 2, "shuffle": True})
    return {"full": gathered(moe), "noise_full": gathered(noise), "split_full": gathered(split)}


def hsdp_llama(out: Path, llama: Path, rank: int) -> dict:
    """HSDP (2-D mesh: 2 replicas of 1 shard, then 1 replica of 2 shards), frozen embeddings, explicit settings."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    result = {}
    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        dense = load_dense(llama)
        dense.model.embed_tokens.weight.requires_grad_(False)
        dense = shard(dense, mesh=mesh, reshard_after_forward=False,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
        moe = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=3)
        state = moe.model.layers[0]._get_fsdp_state()._fsdp_param_groups[0]
        result[shape] = {"placements": placements(moe), "dense_placements": placements(dense),
                         "logits": logits(moe.eval(), ids_of(llama, PROMPTS[0])),
                         "frozen": sorted(n for n, p in moe.named_parameters() if not p.requires_grad),
                         "reshard_after_forward": state.post_forward_mesh_info is not None,
                         "mp_policy": str(state.mp_policy)}
    return result


def wrappings(out: Path, llama: Path, rank: int) -> dict:
    """Other ways to shard: layers only (the root's parameters stay whole, unmanaged), each MLP projection wrapped
    (mirrored by the MoE block), parameters sharded on dim 1 (shard_placement_fn), grouped modules with an ignored
    head, CPU offload and activation checkpointing."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import Shard

    def layers_only(model):
        for layer in model.model.layers:
            fully_shard(layer)

    def per_projection(model):
        for layer in model.model.layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                fully_shard(getattr(layer.mlp, proj))
        shard(model)

    def dim_one(model):
        shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)

    def grouped_ignored_offloaded(model):  # activation checkpointing on, head ignored, shards offloaded
        model.activation_checkpointing_enable()
        for layer in model.model.layers:
            fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard([model.model.norm, model.model.embed_tokens])
        fully_shard(model, ignored_params={model.lm_head.weight})

    result = {}
    for name, wrap in {"layers_only": layers_only, "per_projection": per_projection, "dim_one": dim_one,
                       "grouped_ignored_offloaded": grouped_ignored_offloaded}.items():
        dense = load_dense(llama)
        wrap(dense)
        moe = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=3)
        result[name] = {"units": [n for n, m in moe.named_modules() if type(m).__name__.startswith("FSDP")],
                        "placements": placements(moe), "dense_placements": placements(dense),
                        "plain": sorted(n for n, p in moe.named_parameters() if not hasattr(p, "placements")),
                        "checkpointing": moe.is_activation_checkpointing,
                        "offloaded": type(moe.model.layers[0]._get_fsdp_state()._fsdp_param_groups[0]
                                          .offload_policy).__name__,
                        "logits": logits(moe.eval(), ids_of(llama, PROMPTS[0]))}
        ids = ids_of(llama, PROMPTS[1])
        moe.train()(input_ids=ids, labels=ids).loss.backward()  # trains as sharded (offloaded, checkpointed)
        result[name]["grads"] = sorted(n for n, p in moe.named_parameters() if p.grad is not None)
    return result


def train_qwen3(out: Path, qwen3: Path, rank: int) -> dict:
    """Noise init on Qwen3, AdamW over the DTensor parameters, DCP round trip, the folder published after training."""
    import torch.distributed.checkpoint as dcp

    dense = shard(load_dense(qwen3))
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init={"method": "noise", "scale": 0.02},
                        seed=1, output_router_logits=True, router_aux_loss_coef=0.01)
    opt = torch.optim.AdamW(moe.parameters(), lr=3e-3)
    ids = ids_of(qwen3, PROMPTS[rank % len(PROMPTS)])  # data parallel: each rank its own batch
    losses, grads = [], {}
    for step in range(6):
        loss = moe(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:  # whole gradient norms: a collective per parameter
            grads = {n: float(p.grad.full_tensor().norm()) for n, p in moe.named_parameters()
                     if "mlp.gate" in n or "mlp.experts" in n}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    moe.eval()
    trained_logits = logits(moe, ids_of(qwen3, PROMPTS[0]))
    before = {n: p.to_local().detach().clone() for n, p in moe.named_parameters()}
    dcp.save({"model": moe.state_dict()}, checkpoint_id=str(out / "dcp"))
    fresh = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=99)  # other values, same sharding
    differed = any(not torch.equal(before[n], p.to_local()) for n, p in fresh.named_parameters())
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(out / "dcp"))
    fresh.load_state_dict(state["model"])
    restored = all(torch.equal(before[n], p.to_local()) for n, p in fresh.named_parameters())
    save_hf_folder(fresh, out / "trained_qwen3_hf", tokenizer=qwen3, max_shard_size="40KB")
    return {"losses": losses, "grads": grads, "trained_logits": trained_logits, "dcp_differed_before": differed,
            "dcp_restored": restored}


class GatherSpy:
    """Records every ``DTensor.full_tensor`` call as (phase, this rank's storage address, global shape): the test
    asserts no storage is gathered twice in one phase. Patched on the class, so every caller is seen."""

    def __init__(self):
        from torch.distributed.tensor import DTensor

        self.calls: list[tuple[str, int, tuple]] = []
        self.phase = ""
        self._original = DTensor.full_tensor
        spy = self

        def full_tensor(dtensor, *args, **kwargs):
            spy.calls.append((spy.phase, dtensor.to_local().untyped_storage().data_ptr(), tuple(dtensor.shape)))
            return spy._original(dtensor, *args, **kwargs)

        DTensor.full_tensor = full_tensor

    def close(self):
        from torch.distributed.tensor import DTensor

        DTensor.full_tensor = self._original


class MadeBuffers:
    """Records the buffers of every model ``AutoModelForCausalLM.from_config`` makes (the MoE as constructed,
    before its storage is allocated), to tell them from the buffers the MoE ends up with."""

    def __init__(self):
        from transformers import AutoModelForCausalLM

        self.made: list[dict[str, torch.Tensor]] = []
        self._original = AutoModelForCausalLM.from_config.__func__
        recorder = self

        def from_config(cls, *args, **kwargs):
            model = recorder._original(cls, *args, **kwargs)
            recorder.made.append(dict(model.named_buffers()))
            return model

        AutoModelForCausalLM.from_config = classmethod(from_config)

    def close(self):
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config = classmethod(self._original)


def buffers_of(model, made: dict[str, torch.Tensor]) -> dict:
    """Each buffer's values (CPU), device, and whether it is a tensor the constructed model held."""
    params = {str(p.device) for p in model.parameters()}
    constructed = {id(b) for b in made.values()}
    return {"params": params, **{n: {"values": b.detach().cpu().clone(), "device": str(b.device),
                                     "constructed": id(b) in constructed} for n, b in model.named_buffers()}}


def ties(out: Path, qwen2: Path, rank: int) -> dict:
    """Tied Qwen2 under FSDP2: which storages upcycle_model and save_hf_folder gather (fp32, then bf16 with a
    vocabulary and an expert count that 2 ranks do not divide), the logits, and the buffers of an MoE whose root is
    not wrapped."""
    from moe_upcycle.checkpoint.tiny import make_dense_model

    uneven = out / "qwen2_uneven"
    if rank == 0:
        make_dense_model(uneven, family="qwen2", seed=8, tie_word_embeddings=True, random_norms_and_biases=True,
                         vocab_size=301)
    dist.barrier()
    result = {}
    spy, made = GatherSpy(), MadeBuffers()
    try:
        for case, path, dtype, experts in (("fp32", qwen2, torch.float32, 4), ("bf16", uneven, torch.bfloat16, 3)):
            dense = shard(load_dense(path, dtype))
            spy.phase = f"{case} upcycle_model"
            moe = upcycle_model(dense, num_experts=experts, experts_per_token=2, seed=5)
            spy.phase = f"{case} save_hf_folder"
            save_hf_folder(moe, out / f"ties_{case}_hf", tokenizer=path)
            spy.phase = ""
            ids = ids_of(path, PROMPTS[1])
            result[case] = {"logits": logits(moe.eval(), ids).float(), "dtypes": sorted({str(p.dtype) for p in
                                                                                       moe.parameters()}),
                            "tied": moe.lm_head.weight is moe.model.embed_tokens.weight}
        from torch.distributed.fsdp import fully_shard

        dense = load_dense(qwen2)
        for layer in dense.model.layers:  # the root is not wrapped: FSDP moves no buffer of it
            fully_shard(layer)
        made.made.clear()
        spy.phase = "unwrapped root upcycle_model"
        moe = upcycle_model(dense, num_experts=2, experts_per_token=1)
        spy.phase = ""
        result["buffers"] = buffers_of(moe, made.made[-1])
        result["rope"] = {"theta": float(moe.config.rope_parameters["rope_theta"]), "head_dim": moe.config.head_dim}
    finally:
        spy.close()
        made.close()
    result["gathers"] = spy.calls
    return result


def refusals(out: Path, llama: Path, rank: int) -> dict:
    """Tensor parallelism is refused, naming the parameter and the fix; failures stop every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    result = {}
    dense = load_dense(llama)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in dense.model.layers:
        parallelize_module(layer, mesh, {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                         "mlp.down_proj": RowwiseParallel()})
    result["tp"] = _error(lambda: upcycle_model(dense, num_experts=2))
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    dense = load_dense(llama)  # FSDP over tensor parallelism (2-D): refused the same way
    for layer in dense.model.layers:
        parallelize_module(layer, mesh["tp"], {"self_attn.q_proj": ColwiseParallel(),
                                               "self_attn.o_proj": RowwiseParallel()})
    result["fsdp_tp"] = _error(lambda: upcycle_model(shard(dense, mesh=mesh["dp"]), num_experts=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result["one_rank_fails"] = _error(lambda: _fail_on(1))
    user = out / "users_folder"
    if rank == 0:
        user.mkdir(exist_ok=True)
        (user / "notes.txt").write_text("mine")
    dist.barrier()
    moe = upcycle_model(shard(load_dense(llama)), num_experts=2)
    result["users_folder"] = _error(lambda: save_hf_folder(moe, user, force=True))
    result["users_folder_kept"] = sorted(p.name for p in user.iterdir())
    result["bad_size"] = _error(lambda: save_hf_folder(moe, out / "x", max_shard_size="huge"))
    return result


def _fail_on(bad: int) -> None:
    with all_or_none("a test step"):
        if dist.get_rank() == bad:
            raise ConfigError("rank-local problem")


def _error(call) -> tuple[str, str]:
    try:
        call()
    except (UpcycleError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return "none", ""


SCENARIOS = {"copy_llama": (copy_llama, "llama"), "tied_qwen2": (tied_qwen2, "qwen2"), "ties": (ties, "qwen2"),
             "random_llama": (random_llama, "llama"),
             "hsdp_llama": (hsdp_llama, "llama"), "wrappings": (wrappings, "llama"), "train_qwen3": (train_qwen3, "qwen3"),
             "refusals": (refusals, "llama")}


def main() -> None:
    out = Path(sys.argv[1])
    models = {"llama": Path(sys.argv[2]), "qwen3": Path(sys.argv[3]), "qwen2": Path(sys.argv[4])}
    chosen = sys.argv[5].split(",") if len(sys.argv) > 5 else list(SCENARIOS)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    results = {}
    try:
        for name in chosen:
            run, model = SCENARIOS[name]
            results[name] = run(out, models[model], rank)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        torch.save(results, out / f"rank{rank}.pt")
        gc.collect()  # the scenarios' FSDP models (reference cycles) freed while Python is whole: see the example
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
