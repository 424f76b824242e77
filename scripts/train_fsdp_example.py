"""Upcycle inside an FSDP2 training job: load dense, shard, upcycle, train, checkpoint with DCP, publish.

Run on every rank with torchrun (CPU and gloo here; GPUs and NCCL with ``--device cuda``):

    torchrun --nproc-per-node 2 scripts/train_fsdp_example.py --model tests/data/stories260K --out /tmp/fsdp-run
    torchrun --nproc-per-node 8 scripts/train_fsdp_example.py --model meta-llama/Llama-3.2-1B --device cuda ...

Each rank loads the dense model, shards it with ``fully_shard`` (each decoder layer, then the root: torchtitan's
recipe), and `upcycle_model` makes an MoE sharded the same way, each rank allocating only its own shards. It
trains ``--steps`` AdamW steps (each rank its own batch of the shipped prompts), saves model and optimizer with
``torch.distributed.checkpoint`` into OUT/dcp (any world size can load it), loads the checkpoint back into a
freshly made MoE (a restart), and publishes OUT/hf: the Hugging Face folder a build writes, which loads in
transformers. Rank 0 prints one JSON line: the losses, whether the reloaded checkpoint equals the trained model
bit for bit, and the published folder.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from moe_upcycle import save_hf_folder, upcycle_model
from moe_upcycle.recipe.prompt_sets import load_prompts

SEQ_LEN = 32


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tests/data/stories260K", help="dense model folder or hub id")
    parser.add_argument("--out", required=True, help="folder for the DCP checkpoint (dcp/) and the MoE (hf/)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default=None, help="process group backend (default: gloo on cpu, nccl on cuda)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args()


def sharded_moe(model_ref: str, device: torch.device, experts: int, seed: int = 0) -> torch.nn.Module:
    """Dense model -> FSDP2 (per layer, then the root) -> the MoE, sharded the same way."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(model_ref, dtype=torch.float32).to(device)
    for layer in dense.model.layers:
        fully_shard(layer)
    fully_shard(dense)
    moe = upcycle_model(dense, num_experts=experts, experts_per_token=2,
                        expert_init={"method": "drop", "ratio": 0.5}, seed=seed,
                        output_router_logits=True, router_aux_loss_coef=0.01)
    del dense  # the MoE shares no memory with it
    return moe


def main() -> None:
    args = parse()
    dist.init_process_group(args.backend or ("nccl" if args.device == "cuda" else "gloo"))
    report = train_and_publish(args)
    if dist.get_rank() == 0:
        print(json.dumps(report))
    # FSDP2 modules hold reference cycles (hooks, states, meshes): the models made in train_and_publish outlive its
    # return until the garbage collector runs (measured: alive after the return, gone after gc.collect()). Left to
    # the interpreter's shutdown, their tensors and the backend's objects are freed while Python is torn down, where
    # a C++ thread that needs the GIL is stopped mid-destructor: "terminate called without an active exception"
    # (SIGABRT) after the results were printed. Freed here, while Python is whole and the group still exists; then
    # the ranks leave together.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def train_and_publish(args: argparse.Namespace) -> dict:
    """Everything between joining and leaving the process group; returns rank 0's report (the JSON line)."""
    rank = dist.get_rank()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    out = Path(args.out)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = [i for text in load_prompts("creative", "prompts") for i in tokenizer(text)["input_ids"]]
    windows = torch.tensor(tokens[: len(tokens) // SEQ_LEN * SEQ_LEN]).view(-1, SEQ_LEN)
    ids = windows[rank::dist.get_world_size()][:4].to(device)  # data parallel: each rank its own batch

    moe = sharded_moe(args.model, device, args.experts)
    optimizer = torch.optim.AdamW(moe.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        loss = moe(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(round(float(mean) / dist.get_world_size(), 4))

    model_state, optim_state = get_state_dict(moe, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(out / "dcp"))

    # a restart: a fresh MoE (another seed, so other values) and optimizer, then the checkpoint loaded into them
    restored = sharded_moe(args.model, device, args.experts, seed=1)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=args.lr)
    model_state, optim_state = get_state_dict(restored, restored_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(out / "dcp"))
    set_state_dict(restored, restored_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = torch.tensor(int(all(torch.equal(a.to_local(), b.to_local()) for a, b in
                                zip(moe.parameters(), restored.parameters()))))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)

    folder = save_hf_folder(restored, out / "hf", tokenizer=args.model if Path(args.model).is_dir() else tokenizer)
    return {"world_size": dist.get_world_size(), "losses": losses, "checkpoint_round_trip": bool(same),
            "published": str(folder)}


if __name__ == "__main__":
    main()
