"""The transformers-5 fused expert layout (`layout: fused`), as a regrouping of planned slots.

transformers 5 keeps a layer's experts as two stacked parameters, ``mlp.experts.gate_up_proj``
(E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I), and converts per-expert checkpoints into them
while loading. `fuse_experts` rewrites a per-expert plan into that layout: each fused tensor
becomes one step whose `parts` are the per-expert slots, in byte order (expert 0's gate_proj,
expert 0's up_proj, expert 1's gate_proj, ...). Row-major, those bytes *are* the stacked tensor,
so nothing ever concatenates them in memory.

Memory: the writer streams a fused tensor part by part (see `writer.TensorParts`), so a build
holds one dense FFN matrix (I, H) at a time plus the source tensors still shared by later
slots — the same as the per-expert layout — never the (E, 2I, H) stack, which for
Mixtral-8x7B shapes would be 1.9 GB per layer in bf16. Measured by ``scripts/fused_memory.py``
(8 experts of a hidden-1024 / intermediate-4096 model, fp32, tensor_policy: clone): peak RSS
above baseline is 182.6 MiB for both layouts, less than the 256 MiB one stacked gate_up_proj
would take.

The per-expert layout stays the default: every loader (transformers 4 and 5, llama.cpp's
converter, vLLM) reads it, while fused files need transformers 5. transformers 4.x would load
them *silently wrong* (MixtralForCausalLM reports the fused tensors as unexpected keys and keeps
random experts: max |Δlogit| 4.2 on a tiny model), so fused shards carry `SAFETENSORS_METADATA`:
a ``format`` other than "pt", which 4.x refuses before loading anything ("Incompatible
safetensors file" / "does not contain the valid metadata") and transformers 5 does not read.
Nothing here reads tensors.
"""

from __future__ import annotations

from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

from moe_upcycle.checkpoint import names
from moe_upcycle.planning.steps import Step

# safetensors __metadata__ of fused shards: transformers 4.x accepts only format pt/tf/flax/mlx
SAFETENSORS_METADATA = {"format": "pt-fused-experts: needs transformers>=5"}


def installed_transformers_problem() -> Optional[str]:
    """Why this environment cannot check a fused build (transformers 4.x refuses the files), or None.

    The build itself loads its output (the init-drift check, ``--verify``), and so would the user's
    next step; with transformers 4 installed both fail on the files, after the work is done.
    """
    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return None
    if int(installed.split(".")[0]) >= 5:
        return None
    return (f"layout: fused writes expert tensors only transformers 5 loads, and this environment has transformers "
            f"{installed} (4.x refuses the files); use layout: per_expert (every runtime reads it), or install "
            f"transformers>=5")


def fuse_experts(steps: list["Step"], layout: names.OutputLayout, num_experts: int) -> list["Step"]:
    """Replace each layer's per-expert slots with the fused tensors, and rename its router.

    Args:
        steps: a complete per-expert plan (every expert has every projection).
        layout: the output architecture (its `fused_expert` and `fused_router` templates).
        num_experts: routed experts per layer.

    Returns:
        The steps with each layer's expert slots replaced, at the place of the first one, by
        one step per fused tensor whose `parts` are those slots in byte order.

    Example:
        Two experts with I=128, H=64 give ``model.layers.0.mlp.experts.gate_up_proj`` of shape
        (2, 256, 64) with parts [gate_0, up_0, gate_1, up_1].
    """
    slots: dict[int, dict[tuple[str, int], "Step"]] = {}
    for step in steps:
        if step.kind == "expert":
            slots.setdefault(step.layer, {})[(_proj(step, layout), step.expert)] = step
    out: list["Step"] = []
    done: set[int] = set()
    for step in steps:
        if step.kind == "router":
            out.append(replace(step, name=names.fill(layout.fused_router, layer=step.layer)))
        elif step.kind != "expert":
            out.append(step)
        elif step.layer not in done:
            done.add(step.layer)
            layer_slots = slots[step.layer]
            for template, projs in layout.fused_expert.items():
                parts = tuple(layer_slots[(p, e)] for e in range(num_experts) for p in projs)
                rows = sum(layer_slots[(p, 0)].shape[0] for p in projs)
                out.append(replace(parts[0], name=names.fill(template, layer=step.layer),
                                   shape=(num_experts, rows, parts[0].shape[1]), source=None, expert=None,
                                   transforms=(), parts=parts, part_dim=0))
    return out


def _proj(step: "Step", layout: names.OutputLayout) -> str:
    for proj, template in layout.expert.items():
        if names.fill(template, layer=step.layer, expert=step.expert) == step.name:
            return proj
    raise ValueError(f"{step.name} is not an expert slot of {layout.model_type}")
