"""Top-1 routing agreement with mergekit-moe's routers, for `gate_source: native` and `gate_source: mergekit`.

    python scripts/mergekit_agreement.py [--mergekit-moe PATH/TO/mergekit-moe] [--work DIR]

On the real pretrained stories260K (tests/data) with a 4-expert config in the shape of a published
frankenMoE (tests/mergekit_reference.PUBLISHED_4X: keyword prompts), and a 2-expert config with whole
sentences as prompts (SENTENCES_2X: code vs stories), for gate modes hidden, hidden_avg and
cheap_embed it builds the MoE with moe-upcycle twice (native and mergekit router semantics) and
gets mergekit's routers from the re-implementation in tests/mergekit_reference.py — and, with
``--mergekit-moe``, from the real mergekit-moe too. It prints, per mode:

- the smallest cosine between our mergekit-mode rows and mergekit's;
- top-1 agreement with mergekit's routers over every (layer, token) of held-out texts, scored on
  the dense model's router inputs (an MoE of copies of one model routes exactly those);
- "label": the fraction of held-out (layer, token) pairs sent to the expert their text belongs to
  (4x: chat → 0, code → 1, story → 2; 2x: code → 0, story → 1).

Deterministic (no sampling); the numbers in docs/mergekit.md come from this script.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import mergekit_reference as reference  # noqa: E402
from moe_upcycle.build import upcycle  # noqa: E402

MODEL = ROOT / "tests" / "data" / "stories260K"
MODES = ("hidden", "hidden_avg", "cheap_embed")


def routers(folder: Path) -> torch.Tensor:
    """(L, E, H) fp32 Mixtral router weights of a built folder (per-expert or transformers-5 fused names)."""
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    keys = sorted((k for k in state if k.endswith(("block_sparse_moe.gate.weight", ".mlp.gate.weight"))),
                  key=lambda k: int(k.split(".")[2]))
    return torch.stack([state[k].float() for k in keys])


def config_for(experts: list[dict], mode: str, **extra) -> dict:
    return {"base_model": str(MODEL), "gate_mode": mode, "dtype": "float32",
            "experts": [{"source_model": str(MODEL), **e} for e in experts], **extra}


def label_accuracy(rows: torch.Tensor, per_text: list[list[torch.Tensor]], labels: list[int]) -> float:
    hit = total = 0
    for layer in range(rows.shape[0]):
        for x, label in zip(per_text[layer], labels):
            top = (x @ rows[layer].T).argmax(dim=-1)
            hit += int((top == label).sum())
            total += top.numel()
    return hit / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit-moe", help="path to a mergekit-moe 0.1.5 executable, to compare with the real tool")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mergekit-agreement-"))
    for shape, experts, held_out in (("4x keywords", reference.PUBLISHED_4X, reference.HELD_OUT),
                                     ("2x sentences", reference.SENTENCES_2X, reference.HELD_OUT_2X)):
        measure(shape, experts, held_out, work / shape.replace(" ", "-"), args.mergekit_moe)


def measure(shape: str, experts: list[dict], held_out: list[tuple[str, int]], work: Path, mergekit_moe) -> None:
    work.mkdir(parents=True, exist_ok=True)
    texts = [t for t, _ in held_out]
    labels = [label for _, label in held_out]
    per_text = [reference.router_inputs(MODEL, [t]) for t in texts]  # [text][layer] (N, H)
    per_layer_texts = [[per_text[i][layer] for i in range(len(texts))] for layer in range(len(per_text[0]))]
    inputs = [torch.cat(xs) for xs in per_layer_texts]
    print(f"\n{shape}: model {MODEL.name}, {len(experts)} experts, {len(texts)} held-out texts, "
          f"{inputs[0].shape[0]} tokens x {len(inputs)} layers")
    header = "| mode | against | cos min (mergekit mode) | top-1 agree native | top-1 agree mergekit mode | " \
             "label native | label mergekit mode | label mergekit |"
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for mode in MODES:
        native = routers(upcycle(config_for(experts, mode), work / f"{mode}-native", force=True,
                                 checksums=False).output)
        ours_mk = routers(upcycle(config_for(experts, mode, gate_source="mergekit"), work / f"{mode}-mergekit",
                                  force=True, checksums=False).output)
        references = {"re-implementation": reference.gate_params(MODEL, experts, mode).float()}
        if mergekit_moe:
            yaml_path = work / f"{mode}.yaml"
            yaml_path.write_text(yaml.safe_dump(config_for(experts, mode), sort_keys=False))
            out = work / f"{mode}-mergekit-moe"
            subprocess.run([mergekit_moe, str(yaml_path), str(out), "--device", "cpu",
                            "--i-understand-this-is-not-useful-without-training"], check=True, capture_output=True)
            references["mergekit-moe 0.1.5"] = routers(out)
        for name, theirs in references.items():
            cos = torch.nn.functional.cosine_similarity(ours_mk, theirs, dim=-1).min().item()
            print(f"| {mode} | {name} | {cos:.6f} | {reference.top1_agreement(native, theirs, inputs):.1%} | "
                  f"{reference.top1_agreement(ours_mk, theirs, inputs):.1%} | "
                  f"{label_accuracy(native, per_layer_texts, labels):.1%} | "
                  f"{label_accuracy(ours_mk, per_layer_texts, labels):.1%} | "
                  f"{label_accuracy(theirs, per_layer_texts, labels):.1%} |")

if __name__ == "__main__":
    main()
