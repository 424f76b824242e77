"""Router (gate) weights: one (num_experts, hidden) matrix per layer.

Modes handled here need at most one tensor of the base (the embedding matrix):

- ``random``: normal with std `router_init_std` (default 0.02, the usual init of a linear layer
  in these models — mergekit uses 1.0, which saturates the softmax).
- ``uniform_random``: what ``nn.Linear`` does by default, U(-1/sqrt(H), 1/sqrt(H)).
- ``uniform``: zeros, so every expert gets exactly the same score (uniform routing).
- ``cheap_embed``: masked mean of each prompt's token embeddings, averaged over the expert's
  positive prompts, minus the mean of its negative prompts; normalised and scaled.

With ``expert_init: split`` the rows are tied within each virtual group of G experts
(`inits.tie_router_rows`), which is what keeps a split model function-preserving at init.

Hidden-state modes (``hidden``, ``hidden_avg``, ``hidden_last``, ``kmeans``) run the base model
and live in `hidden_gates`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import inits, names
from .config import ExpertConfig, UpcycleConfig
from .errors import ConfigError
from .plan import Plan
from .source import Checkpoint

PROMPT_MODES = ("cheap_embed", "hidden", "hidden_avg", "hidden_last")


def default_gate_scale(hidden_size: int) -> float:
    """Length given to each unit gate row when `gate_scale` is not set.

    The router input is an RMS-normalised hidden state, whose length is about sqrt(H) (times
    the norm weights). With rows of length 16/sqrt(H), a cosine gap of 0.25 between the best
    and second-best expert gives a logit gap of about 4 — decisive (softmax ≈ 0.98 for two
    experts) without saturating it for inputs that match no expert well.
    """
    return 16.0 / math.sqrt(hidden_size)


def compute_gates(config: UpcycleConfig, plan: Plan, base: Checkpoint,
                  device: Optional[torch.device] = None) -> dict[int, torch.Tensor]:
    """Router weights for every layer, fp32, shape (num_experts, hidden).

    `device` (default CPU) is where ``random``/``uniform_random``/``uniform`` rows are drawn, with a
    generator of that device seeded with ``config.seed`` (CPU and CUDA draw different rows).

    Raises:
        ConfigError: prompts missing for a prompt-based mode, or a mode not available.
    """
    experts = config.expert_list()
    num_experts, hidden = len(experts), int(plan.base_config["hidden_size"])
    mode = config.gate_mode
    check_prompts(config)
    gen = torch.Generator(device=device or "cpu").manual_seed(config.seed)
    group_size = inits.granularity(config)  # > 1 for expert_init: split
    gates: dict[int, torch.Tensor] = {}
    if mode == "cheap_embed":
        rows = inits.tie_router_rows(cheap_embed_rows(experts, base), group_size, reduce="mean")
        shared = normalise_rows(rows, config.gate_scale or default_gate_scale(hidden))
        return {layer: shared.clone() for layer in range(plan.num_layers)}
    if mode in ("hidden", "hidden_avg", "hidden_last", "kmeans"):
        from .hidden_gates import compute_hidden_gates

        if base.path is None:
            raise ConfigError(f"gate_mode: {mode} runs the base model, which needs a checkpoint folder")
        return compute_hidden_gates(config, plan.num_layers, base.path)
    for layer in range(plan.num_layers):
        if mode == "random":
            g = torch.randn(num_experts, hidden, generator=gen, device=gen.device) * config.router_init_std
        elif mode == "uniform_random":
            bound = 1.0 / math.sqrt(hidden)
            g = torch.rand(num_experts, hidden, generator=gen, device=gen.device) * (2 * bound) - bound
        else:  # uniform
            g = torch.zeros(num_experts, hidden, device=gen.device)
        gates[layer] = inits.tie_router_rows(g, group_size, reduce="first")
    return gates


def check_prompts(config: UpcycleConfig) -> None:
    """Prompt-based gate modes need positive prompts for every expert."""
    if config.gate_mode not in PROMPT_MODES:
        return
    if config.num_experts is not None:
        raise ConfigError(f"gate_mode: {config.gate_mode} needs prompts, but num_experts gives copies without "
                          f"prompts; use gate_mode: random (or uniform, uniform_random), or list experts with prompts")
    missing = [f"experts[{i}].positive_prompts: gate_mode {config.gate_mode} needs at least one prompt "
               f"(or positive_prompts_from: a prompt set)"
               for i, e in enumerate(config.expert_list()) if not e.positive_prompts]
    if missing:
        raise ConfigError(*missing)


def cheap_embed_rows(experts: list[ExpertConfig], base: Checkpoint) -> torch.Tensor:
    """Mean token embedding of each expert's prompts (positive minus negative), (E, H) fp32."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(base.path))
    except Exception as exc:
        raise ConfigError(f"gate_mode: cheap_embed needs the base model's tokenizer, which failed to load from "
                          f"{base.path} ({exc}); use gate_mode: random or add tokenizer files") from None
    embed = base.read(names.EMBED).float()  # (V, H)

    def mean_embedding(prompts: list[str]) -> Optional[torch.Tensor]:
        if not prompts:
            return None
        vecs = []
        for prompt in prompts:
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ConfigError(f"prompt {prompt!r} has no tokens")
            vecs.append(embed[torch.tensor(ids)].mean(dim=0))  # masked mean: real tokens only
        return torch.stack(vecs).mean(dim=0)

    rows = []
    for expert in experts:
        row = mean_embedding(expert.positive_prompts)
        negative = mean_embedding(expert.negative_prompts)
        rows.append(row - negative if negative is not None else row)
    return torch.stack(rows)


def normalise_rows(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """L2-normalise each row and multiply by `scale`."""
    return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12) * scale
