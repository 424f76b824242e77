"""Router rows computed exactly as mergekit-moe 0.1.5 computes them (``gate_source: mergekit``).

Restated from mergekit's ``get_gate_params`` / ``get_hidden_states`` / ``get_cheap_embedding``
(mergekit/moe/router.py) and its tokenizer set-up (mergekit/scripts/moe.py):

- Tokenizer: left padding, the pad id is BOS (EOS when there is none); each prompt is
  ``bos_token + prompt`` tokenized without special tokens; each expert's positive prompts form one
  padded batch, its negative prompts another. Batches are mergekit's, because with left padding
  and default position ids the padding shifts positions, so a prompt's vector depends on its batch.
- ``hidden`` and ``hidden_last``: the base model in bfloat16 (or `gate_dtype`),
  ``output.hidden_states[:-1]`` — each layer's **input** residual stream, before its attention
  block and norms — at the **last position** of each row (the prompt's last token, thanks to the
  left padding), averaged over the prompts.
- ``hidden_avg``: the mean over **all** positions of the padded batch, pads included (sum / T).
- Negative prompts: their vector is subtracted; then each layer's row is scaled to unit length and
  nothing else (no logit scale). ``gate_scale``, when set, multiplies the unit rows.
- ``cheap_embed``: the masked sum of token embeddings over every token (BOS included) of every
  prompt, unit length, minus the negatives' (unit) sum, unit length again; the same in every layer.
- ``random``: standard normal rows (std 1.0); ``uniform_random``: U(-1/sqrt(H), 1/sqrt(H)).

Arithmetic runs in the model dtype, as in mergekit, so rows agree with mergekit's to bf16
rounding. Our default (`hidden_gates`, ``gate_source: native``) instead scores the router's true
input (each layer's ``post_attention_layernorm`` output), takes a masked mean over real tokens
(``hidden``/``hidden_avg``) or the last real token (``hidden_last``), and scales the rows.

Shared-expert gates (qwen2_moe, one shared expert with prompts): mergekit computes the shared
expert's row like a routed expert's and writes it as ``shared_expert_gate``; `compute_mergekit_gates`
does the same, in the same stream of the base as the routers' rows (``hidden*`` modes). With several
shared experts (mergekit allows one) the native gate is kept.

The ``hidden*`` modes never load the base whole: it is streamed one layer at a time, once
(`stream.StreamedModel.layer_inputs`), every prompt batch's input to each MoE layer reduced as it passes,
through transformers' own layer modules on the same batches, so the rows are those of a whole-model forward
with ``output_hidden_states``. Rows of dense layers are never made. It writes nothing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch

from moe_upcycle.checkpoint import names
from moe_upcycle.planning import inits
from moe_upcycle.gates.batches import Batch, open_tokenizer, to_device
from moe_upcycle.gates.stream import BatchInputs, open_streamed
from moe_upcycle.inputs.text import check_token_ids
from moe_upcycle.recipe.params import ExpertPrompts, GateParams
from moe_upcycle.errors import ConfigError
from moe_upcycle.planning.steps import Plan
from moe_upcycle.checkpoint.source import Checkpoint

MERGEKIT_MODES = ("hidden", "hidden_avg", "hidden_last", "cheap_embed", "random", "uniform_random")


def mergekit_tokenizer(path: Path):
    """The base tokenizer set up as mergekit-moe does: left padding, BOS as the pad token."""
    tokenizer = open_tokenizer(path, lambda exc: ConfigError(
        f"gate_source: mergekit needs the base model's tokenizer, which failed to load from {path} ({exc}); add "
        f"tokenizer files or use gate_mode: random"))
    tokenizer.padding_side = "left"
    tokenizer.pad_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenize_prompts(prompts: Sequence[str], tokenizer) -> dict[str, torch.Tensor]:
    """One left-padded batch of ``bos_token + prompt`` (input_ids, attention_mask), as mergekit does.

    Raises:
        ConfigError: the batch has no token at all (empty prompts and no BOS token).
    """
    batch = tokenizer([(tokenizer.bos_token or "") + p for p in prompts], return_tensors="pt", padding=True,
                      add_special_tokens=False)
    if batch["input_ids"].shape[-1] == 0:
        raise ConfigError(f"prompts {prompts!r} give no tokens: they are empty and the tokenizer has no BOS token; "
                          f"write a prompt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def _expert_rows(experts: Sequence[ExpertPrompts], vector_of) -> list[torch.Tensor]:
    """Each expert's unit row: its positive prompts' vector minus its negatives', as mergekit does."""
    rows = []
    for expert in experts:
        vec = vector_of(expert.positive)
        if expert.negative:
            vec = vec - vector_of(expert.negative)
        rows.append(_unit(vec))
    return rows


def _unit(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)


def hidden_rows(params: GateParams, experts: Sequence[ExpertPrompts], num_layers: int,
                base: Checkpoint, layers: Optional[Sequence[int]] = None) -> torch.Tensor:
    """(L', E, H) unit rows for ``hidden``, ``hidden_avg`` and ``hidden_last``, in the model dtype, for `layers`
    (default every layer; index i is the i-th of them in order).

    Streams the base model (bfloat16 unless `gate_dtype` is set) one layer at a time on `params.device`, once;
    mergekit's batches (each expert's positive prompts, then its negative prompts) all pass each layer before the
    next is read. A layer not in `layers` is run (its output feeds the next) but not reduced; none after the last
    of them runs.
    """
    wanted = sorted(set(range(num_layers) if layers is None else layers))
    tokenizer = mergekit_tokenizer(base.path)
    streamed = open_streamed(base, params.device, params.dtype or "bfloat16", tokenizer, quantize=params.quantize)
    if len(streamed.norms) != num_layers:
        raise ConfigError(f"base_model: transformers returned {len(streamed.norms)} layer inputs, config.json says "
                          f"{num_layers} layers")
    average = params.mode == "hidden_avg"
    prompt_sets = [p for e in experts for p in ((e.positive, e.negative) if e.negative else (e.positive,))]
    batches, index = [], {}
    for k, prompts in enumerate(prompt_sets):
        batch = tokenize_prompts(prompts, tokenizer)
        ids, attn = batch["input_ids"], batch["attention_mask"]
        check_token_ids(ids, streamed.skeleton.num_embeddings, tokenizer)
        rows = Batch(list(range(len(prompts))), to_device(attn.bool(), streamed.device), None)
        index[id(rows)] = k
        batches.append(BatchInputs(ids, to_device(attn, streamed.device), None, rows))
    # per prompt set and layer, each prompt's vector (B, H): mergekit's `hidden_states[:-1]` of a forward of the
    # whole model, the input of every layer, at its last position (left padding) or averaged over all T positions
    per_prompt: list[list[torch.Tensor]] = [[] for _ in prompt_sets]

    def on_input(layer: int, h: torch.Tensor, batch: Batch) -> None:  # h: (B, T, H) in the model dtype
        per_prompt[index[id(batch)]].append(h.sum(dim=1) / h.shape[1] if average else h[:, -1, :])

    if wanted:
        streamed.layer_inputs(batches, on_input, wanted)

    def vector(k: int) -> torch.Tensor:  # (L', H): the mean over the set's prompts
        stacked = torch.stack(per_prompt[k])  # (L', B, H)
        return stacked.sum(dim=1) / stacked.shape[1]

    if not wanted:
        return torch.zeros(0, len(experts), streamed.hidden_size, dtype=streamed.skeleton.dtype)
    rows, k = [], 0
    for expert in experts:  # as `_expert_rows`: positives minus negatives, unit length
        vec = vector(k)
        k += 1
        if expert.negative:
            vec = vec - vector(k)
            k += 1
        rows.append(_unit(vec))
    return torch.stack(rows, dim=1).cpu()  # (L', E, H)


def cheap_embed_rows(experts: Sequence[ExpertPrompts], base: Checkpoint) -> torch.Tensor:
    """(E, H) fp32 unit rows: mergekit's cheap_embed (summed embeddings of every token, BOS included)."""
    tokenizer = mergekit_tokenizer(base.path)
    embed = base.read(names.EMBED).float()  # (V, H)

    def summed(prompts: Sequence[str]) -> torch.Tensor:  # (H,)
        batch = tokenize_prompts(prompts, tokenizer)
        h = embed[batch["input_ids"]]  # (B, T, H): mergekit's one-hot @ embed
        return _unit((h * batch["attention_mask"].unsqueeze(-1)).sum(dim=1).sum(dim=0))

    return torch.stack(_expert_rows(experts, summed))


def compute_mergekit_gates(params: GateParams, plan: Plan, base: Checkpoint,
                           shared: bool = False) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Router weights as mergekit-moe 0.1.5 computes them, and with `shared` the one shared expert's gate: (MoE layer
    -> (E, H) fp32, MoE layer -> (1, H) fp32 or empty). Rows of dense layers are never returned; the ``hidden*``
    modes stream the base once for both.

    Raises:
        ConfigError: the mode has no mergekit counterpart (or no shared-expert gate), or the prompts give no tokens.
        UpcycleError: the base model cannot be loaded (``hidden*`` modes).
    """
    mode = params.mode
    experts = params.experts
    num_experts, hidden = len(experts), plan.base_config.hidden_size
    group_size = params.group_size
    moe_layers = list(plan.moe_layers)
    if mode not in MERGEKIT_MODES:
        raise ConfigError(f"gate_mode: {mode} has no mergekit-moe counterpart; use gate_source: native, or one of "
                          f"{', '.join(MERGEKIT_MODES)}")
    if shared and mode not in ("hidden", "hidden_avg", "hidden_last", "cheap_embed"):
        raise ConfigError(f"shared_experts[0]: gate_source: mergekit computes a prompt gate for gate_mode hidden, "
                          f"hidden_avg, hidden_last or cheap_embed, not {mode}; set shared_expert_gate: constant")
    if mode in ("random", "uniform_random"):
        gen = torch.Generator().manual_seed(params.seed)
        bound = 1.0 / math.sqrt(hidden)
        gates = {}
        for layer in range(plan.num_layers):  # drawn for every layer, so a layer's rows do not depend on moe_layers
            g = (torch.randn(num_experts, hidden, generator=gen) if mode == "random"
                 else torch.rand(num_experts, hidden, generator=gen) * (2 * bound) - bound)
            if layer in plan.moe_layers:
                gates[layer] = inits.tie_router_rows(g, group_size, reduce="first")
        return gates, {}
    if base.path is None:
        raise ConfigError(f"gate_mode: {mode} reads the base model, which needs a checkpoint folder")
    if mode == "cheap_embed":
        rows = inits.tie_router_rows(cheap_embed_rows(experts, base), group_size, reduce="mean")
        rows = rows * params.scale if params.scale else rows
        row = cheap_embed_rows(params.shared_experts, base) if shared else None
        return ({layer: rows.clone() for layer in moe_layers},
                {layer: row.clone() for layer in moe_layers} if shared else {})
    # one stream for every row: the routed experts' and, after them, the shared expert's
    everyone = tuple(experts) + (tuple(params.shared_experts[:1]) if shared else ())
    stacked = hidden_rows(params, everyone, plan.num_layers, base, moe_layers).float()  # (L', E (+1), H)
    routers = stacked[:, :num_experts] * params.scale if params.scale else stacked[:, :num_experts]
    return ({layer: routers[i].contiguous() for i, layer in enumerate(moe_layers)},
            {layer: stacked[i, num_experts:].contiguous() for i, layer in enumerate(moe_layers)} if shared else {})
