"""See how a built MoE routes prompts: per-prompt top-1 expert shares, per-layer load and entropy.

`route()` loads the MoE with transformers, runs the prompts through it in batches and records, per
prompt, layer and expert, how many of the prompt's real tokens (not padding, not special tokens)
chose that expert first, plus the top-k assignments per layer. It returns a `RoutingResult`
(plain data, JSON via `to_dict`) that other commands build on; printing lives in the CLI and
`plot_routing` draws a heatmap (matplotlib, the optional ``plot`` extra). It does not change the
model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from moe_upcycle.check.compare import eager_experts
from moe_upcycle.check.moe_folder import require_moe
from moe_upcycle.errors import (ConfigError, DependencyError, OutputError, SourceError, UpcycleError,
                                reraise_if_out_of_memory)
from moe_upcycle.checkpoint.manifest_file import load_manifest
from moe_upcycle.checkpoint.output_file import write_file
from moe_upcycle.gates.batches import batch_on, encode, on_device, pad_batch, padding_id
from moe_upcycle.gates.device import resolve_device
from moe_upcycle.recipe.prompt_sets import read_prompt_file
from moe_upcycle.inputs.text import check_token_ids
from moe_upcycle.planning.model_config import experts_implementation_for
from moe_upcycle.terminal.progress import stage



@dataclass
class RoutingResult:
    """Routing counts of a set of prompts through an MoE.

    Attributes:
        prompts: the prompts, in input order.
        expert_names: one name per expert (from the build recipe, else ``expert_i``).
        top1: (P, L, E) int64, real tokens of prompt p whose top-1 expert at layer l is e.
        topk: (L, E) int64, top-k assignments of all real tokens at layer l to expert e.
        tokens: (P,) real tokens per prompt.
        experts_per_token: k of the model's top-k routing.
        layers: the model layer of each of the L rows: the MoE layers (a layer that keeps the dense MLP,
            ``moe_layers:``, routes nothing); None: 0 to L-1.
    """

    prompts: list[str]
    expert_names: list[str]
    top1: torch.Tensor
    topk: torch.Tensor
    tokens: torch.Tensor
    experts_per_token: int
    layers: Optional[list[int]] = None

    @property
    def layer_indices(self) -> list[int]:
        """The model layer of each routing row."""
        return list(self.layers) if self.layers is not None else list(range(self.topk.shape[0]))

    def shares(self) -> torch.Tensor:
        """(P, L, E) share of each prompt's real tokens whose top-1 expert at layer l is e."""
        return self.top1.double() / self.tokens.clamp_min(1)[:, None, None]

    def prompt_share(self) -> torch.Tensor:
        """(P, E) share of each prompt's (layer, token) top-1 choices that went to each expert."""
        totals = self.top1.sum(dim=(1, 2)).clamp_min(1)
        return self.top1.sum(dim=1).double() / totals[:, None]

    def prompt_expert(self) -> list[int]:
        """The expert each prompt chose most often (top-1 across layers and tokens)."""
        return self.prompt_share().argmax(dim=1).tolist()

    def layer_majority(self) -> torch.Tensor:
        """(P, L) the expert most of the prompt's tokens chose first at each layer."""
        return self.top1.argmax(dim=2)

    def layer_load(self) -> torch.Tensor:
        """(L, E) share of each layer's top-k assignments per expert (sums to 1 per layer)."""
        return self.topk.double() / self.topk.sum(dim=1, keepdim=True).clamp_min(1)

    def layer_entropy(self) -> torch.Tensor:
        """(L,) entropy of each layer's load in bits (log2 E = perfectly balanced)."""
        load = self.layer_load()
        return -(load * torch.log2(load.clamp_min(1e-300))).sum(dim=1)

    def to_dict(self) -> dict:
        """JSON-ready summary (shares rounded to 4 decimals)."""
        share, entropy = self.prompt_share(), self.layer_entropy()
        names = self.expert_names
        return {
            "experts": names,
            "experts_per_token": self.experts_per_token,
            "max_entropy_bits": round(math.log2(len(names)), 4),
            "prompts": [{"prompt": p, "tokens": int(self.tokens[i]), "top_expert": names[int(share[i].argmax())],
                         "top1_share": {n: round(float(share[i, e]), 4) for e, n in enumerate(names)},
                         "layer_top_expert": [names[e] for e in self.layer_majority()[i].tolist()]}
                        for i, p in enumerate(self.prompts)],
            "layers": [{"layer": layer, "load": {n: round(float(v), 4) for n, v in zip(names, row.tolist())},
                        "entropy_bits": round(float(entropy[i]), 4)}
                       for i, (layer, row) in enumerate(zip(self.layer_indices, self.layer_load()))],
        }


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp")  # matplotlib writes these with no extra


def read_prompts(path: Union[str, Path]) -> list[str]:
    """Prompts from a YAML/JSON list (or a mapping with ``prompts:``) or a text file, one per line."""
    return read_prompt_file(Path(path))


def expert_names(model_dir: Path, count: int) -> list[str]:
    """Expert names recorded by the build (moe_upcycle.json), else ``expert_0..``."""
    try:
        experts = ((load_manifest(model_dir) or {}).get("config") or {}).get("experts") or []
        names = [str(e.get("name") or f"expert_{i}") for i, e in enumerate(experts)]
    except (SourceError, AttributeError):  # no readable manifest, or experts not a list of mappings
        names = []
    return names if len(names) == count else [f"expert_{i}" for i in range(count)]


def _routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> router (``mlp.gate`` in transformers 5, ``block_sparse_moe.gate`` in 4.x) of every MoE layer;
    a layer that keeps the dense MLP (``moe_layers:``; Qwen MoE's ``mlp_only_layers``) has none."""
    routers = {}
    for i, layer in enumerate(model.base_model.layers):
        block = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
        if hasattr(block, "experts") and getattr(block, "gate", None) is not None:
            routers[i] = block.gate
    return routers


def route(model_dir: Union[str, Path], prompts: list[str], *, device: str = "auto",
          batch_size: int = 8) -> RoutingResult:
    """Run prompts through a built MoE and count which experts each token is routed to.

    Args:
        model_dir: an MoE folder (e.g. the output of ``moe-upcycle build``).
        prompts: the prompts to route.
        device: auto, cpu, cuda or cuda:N (fp32 on CPU, bf16 on GPU).
        batch_size: prompts per forward pass.

    Returns:
        The routing counts.

    Raises:
        SourceError: the folder is not a loadable MoE with a router in at least one layer (a layer that keeps
            the dense MLP, ``moe_layers:``, has none and is not reported).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(model_dir)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "is not a model folder (no config.json)"
        raise SourceError(f"OUT: {folder} {what}; route a folder written by moe-upcycle build")
    if not prompts:
        raise ConfigError("prompts: there is no prompt to route; give at least one")
    require_moe(folder, command="route")  # from config.json: a dense folder is refused before it is loaded
    kwargs = load_kwargs(folder, resolve_device(device))
    try:
        with stage("load MoE", note=str(folder)):
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
            model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
    except Exception as exc:
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        raise SourceError(f"{folder}: cannot load the MoE with transformers ({type(exc).__name__}: {exc})") from None
    n_experts = int(getattr(model.config, "num_local_experts", 0) or getattr(model.config, "num_experts", 0))
    k = int(getattr(model.config, "num_experts_per_tok", 1))
    routers = _routers(model)
    if not n_experts or not routers:
        raise SourceError(f"{folder}: not an MoE with a router in any layer (model_type "
                          f"{model.config.model_type!r}); route a folder written by moe-upcycle build")
    encoded = encode(tokenizer, prompts, int(getattr(model.config, "max_position_embeddings", 4096)))
    # Counted on each router's device, without a host synchronisation per layer (no masked indexing, no
    # bincount, no copy to the host): one copy of a batch's inputs to the device, one copy of the counts back.
    counts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (P, E) top-1 and (E,) top-k counts
    state: dict = {}

    def hook_for(layer: int):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            batch = batch_on(state["on"], logits.device)
            if layer not in counts:
                counts[layer] = (torch.zeros(len(prompts) * n_experts, dtype=torch.long, device=logits.device),
                                 torch.zeros(n_experts, dtype=torch.long, device=logits.device))
            first, chosen = counts[layer]
            width = batch.real.shape[1]
            weight = batch.real.reshape(-1).long()  # 1 for a token that counts, 0 for padding and special tokens
            logits = logits.reshape(weight.shape[0], -1)
            row = torch.arange(weight.shape[0], device=logits.device) // width + batch.rows[0]
            first.index_add_(0, row * n_experts + logits.argmax(dim=1), weight)
            chosen.index_add_(0, logits.topk(k, dim=1).indices.reshape(-1), weight.repeat_interleave(k))
        return hook

    pad_id = padding_id(tokenizer, model.get_input_embeddings().num_embeddings)
    input_device = model.get_input_embeddings().weight.device
    handles = [r.register_forward_hook(hook_for(i)) for i, r in routers.items()]
    try:
        with torch.inference_mode(), stage("route", total=len(encoded), unit="prompts") as st:
            for start in range(0, len(encoded), batch_size):
                idx = list(range(start, min(start + batch_size, len(encoded))))
                ids, attn, real = pad_batch([encoded[i] for i in idx], pad_id, "right")
                check_token_ids(ids[attn.bool()], model.get_input_embeddings().num_embeddings, tokenizer)
                on = on_device(idx, ids, attn, real, None, input_device)
                state["on"] = {input_device: on.batch}
                model.base_model(input_ids=on.ids, attention_mask=on.attn, use_cache=False)
                st.advance(len(idx))
    finally:
        for h in handles:
            h.remove()
    layers = sorted(routers)
    top1 = torch.stack([counts[layer][0].cpu().view(len(prompts), n_experts) for layer in layers], dim=1)
    topk = torch.stack([counts[layer][1].cpu() for layer in layers])
    tokens = torch.tensor([sum(e.real) for e in encoded])
    return RoutingResult(list(prompts), expert_names(folder, n_experts), top1, topk, tokens, k, layers)


def check_plot_path(path: Union[str, Path], inputs: Sequence[Union[str, Path]] = (), force: bool = False) -> Path:
    """The heatmap's file, checked before any routing: matplotlib present, a known image suffix,
    a folder that exists, not a folder itself, not one of the command's inputs, no file there unless `force`.

    Args:
        path: where the heatmap goes; its suffix picks the format.
        inputs: files and folders the command reads (the prompts file, the model folder): never written.
        force: replace a file that is already at `path` (never one of `inputs`).

    Raises:
        DependencyError: matplotlib (the ``plot`` extra) is not installed.
        ConfigError: the path cannot hold the image.
        OutputError: the path is one of `inputs`, or a file is there and `force` is not given.
    """
    _pyplot()
    out = Path(os.path.expanduser(path))
    if out.is_dir():
        raise ConfigError(f"--plot {out}: is a folder; give an image file name such as {out / 'routing.png'}")
    if str(path) == "-":
        raise ConfigError("--plot -: the heatmap is written to an image file, not to standard output; give a file "
                          "name such as routing.png")
    if out.suffix.lower() not in PLOT_SUFFIXES:
        what = f"{out.suffix} is not an image format" if out.suffix else "the name has no suffix"
        raise ConfigError(f"--plot {out}: {what}; end the name with {', '.join(PLOT_SUFFIXES)}")
    if not out.parent.is_dir():
        raise ConfigError(f"--plot {out}: folder {out.parent} does not exist; create it or choose another path")
    resolved = out.resolve()
    for item in inputs:
        if resolved == Path(os.path.expanduser(item)).resolve():
            raise OutputError(f"--plot {out}: that is an input of this command; it is never overwritten — "
                              f"choose another path")
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputError(f"--plot {out}: file exists; pass --force to replace it or choose another path")
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        reraise_if_out_of_memory(exc)  # installed, but a library of it could not be mapped
        from moe_upcycle.terminal.hints import install_hint

        raise DependencyError(f"--plot needs matplotlib, which is not installed; {install_hint('plot')}, "
                              f"or drop --plot") from None
    return plt


def plot_routing(result: RoutingResult, path: Union[str, Path], title: Optional[str] = None,
                 force: bool = False) -> Path:
    """Save a heatmap of prompts × experts (top-1 share) to `path` (PNG/PDF/SVG by suffix), whole or not at all.

    Args:
        force: replace a file already at `path`; without it such a file is refused, never overwritten.

    Raises:
        DependencyError: matplotlib (the ``plot`` extra) is not installed.
        ConfigError: see `check_plot_path`.
        OutputError: a file is at `path` without `force`, or it cannot be written (permissions, disk full).
    """
    out = check_plot_path(path, force=force)
    plt = _pyplot()
    share = result.prompt_share().numpy()
    labels = [p if len(p) <= 40 else p[:37] + "..." for p in (q.replace("\n", " ") for q in result.prompts)]
    n_experts = len(result.expert_names)
    # labels take ~3.5 in on the left; each expert column gets 0.8 in
    fig, ax = plt.subplots(figsize=(4.5 + 0.8 * n_experts, 1.5 + 0.35 * len(labels)))
    image = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    for i in range(len(labels)):
        for e in range(n_experts):
            ax.text(e, i, f"{share[i, e]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if share[i, e] < 0.6 else "black")
    ax.set_xticks(range(len(result.expert_names)), result.expert_names, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_title(title or "top-1 share per prompt (all layers, real tokens)", fontsize=9)
    fig.colorbar(image, ax=ax, label="top-1 share")
    fig.tight_layout()
    try:  # the format from the target's suffix: the temporary file's is .partial
        write_file(out, lambda tmp: fig.savefig(tmp, dpi=120, format=out.suffix[1:].lower()), replace=force)
    except FileExistsError:
        raise OutputError(f"--plot {out}: file exists; pass --force to replace it or choose another path") from None
    except OSError as exc:
        raise OutputError(f"--plot {out}: cannot write it ({exc.strerror or exc}); nothing was written") from None
    finally:
        plt.close(fig)
    return out


def load_kwargs(folder: Path, device: str) -> dict:
    """`from_pretrained`'s arguments for routing on `device`: fp32 on the CPU; bf16 spread over the GPUs, with
    transformers 5's eager experts where its grouped_mm cannot run the bf16 expert shapes ("strides should be
    multiple of 16 bytes": an fp32 build of rows that are aligned in fp32 only, or a folder built elsewhere)."""
    if device == "cpu":
        return {"dtype": torch.float32}
    kwargs = {"dtype": torch.bfloat16, "device_map": "auto"}
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        misaligned = experts_implementation_for(cfg, torch.bfloat16) is not None
    except (OSError, ValueError, KeyError, TypeError, UpcycleError):  # an MoE this tool does not write (OLMoE...)
        misaligned = False
    return {**kwargs, **eager_experts()} if misaligned else kwargs
