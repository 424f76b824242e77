"""Router weights from the base model's own router inputs (``hidden``, ``hidden_last``, ``kmeans``).

A Mixtral router at layer *l* scores the output of layer *l*'s ``post_attention_layernorm`` (the
MLP input). We capture exactly that tensor with forward hooks on every MoE layer's norm, in one
streamed pass of the base model over every text the rows need. This is not mergekit-moe 0.1.5's
computation (the last token, or for ``hidden_avg`` a mean including pad positions, of each layer's
input residual stream):
that one is `mergekit_gates`, chosen with ``gate_source: mergekit``.

**The base model is never loaded whole**: it is streamed one decoder layer at a time from its
checkpoint (`stream.StreamedModel`: each layer's tensors read, every prompt's hidden states run
through it, the layer dropped), on the GPU when present, so any model size fits one GPU or the CPU.
Memory is one layer of weights plus the prompts' hidden states between layers; hooks fold each
batch into per-layer running sums (one (H,) vector per expert and MoE layer; a dense layer's rows are
never computed, and no layer after the last MoE layer runs). ``quantize:``
is no longer needed and is not applied (`stream.QUANTIZE_NOTE`). ``kmeans`` keeps a bounded, seeded sample
of calibration tokens (`calibration.kmeans_sample_budget`).

Averages run over *real* tokens only: pad positions and special tokens (BOS/EOS) are excluded —
the BOS position sees only itself, so its router input is the same for every prompt and would
only add a shared component. Position ids are taken from the attention mask, so a prompt gives
the same vector alone or padded (left or right) in a batch.

Default gate scale (when `gate_scale` is not set), per layer: rows are unit vectors times a
scale. By linearity, the mean logit that row *f* gives to expert *e*'s prompt tokens is
``scale · (m_e · r_f)`` where ``m_e`` is the mean router input of *e*'s prompts. We choose the
scale so that, for the median expert, its own row beats the best other row on its own prompts by
`DECISIVE_LOGIT_GAP` = 4 nats (softmax ≈ 0.98 against one rival): decisive, yet far from a
saturated softmax whose gradients vanish when the router is trained. Only logit *differences*
matter to a softmax, so the cap is on those: the scale is limited so that a token of the layer's
measured mean router-input norm can get at most `MAX_TOKEN_LOGIT_GAP` = 16 nats between two
experts (reached only by a token parallel to the difference of their rows). Without the cap,
near-identical experts (tiny gaps) would get huge rows that saturate on noise.

Batching lives in `batches`, the reduction in `capture`, the layer-by-layer run in `stream`. It does not write
anything; `router.compute_gate_rows` calls `compute_hidden_gates`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from moe_upcycle.recipe.calibration import kmeans_sample_budget, read_documents
from moe_upcycle.recipe.params import ExpertPrompts, GateParams
from moe_upcycle.gates.batches import Encoded, context_length, encode, encode_windows, load_tokenizer
from moe_upcycle.gates.capture import Reduce, RouterInputs, capture_router_inputs
from moe_upcycle.checkpoint.source import Checkpoint, open_checkpoint
from moe_upcycle.errors import ConfigError, SourceError
from moe_upcycle.gates.kmeans import RESTARTS, spherical_kmeans
from moe_upcycle.gates.self_check import SELF_CHECK_BYTES, KeptInputs, SelfCheck, check_routing
from moe_upcycle.gates.stream import StreamedModel, open_streamed
from moe_upcycle.terminal.progress import stage

DECISIVE_LOGIT_GAP = 4.0
MAX_TOKEN_LOGIT_GAP = 16.0


def default_scales(unit: torch.Tensor, own_means: torch.Tensor, token_norm: torch.Tensor) -> torch.Tensor:
    """Per-layer length of the gate rows (see the module docstring).

    Args:
        unit: (L, E, H) unit rows.
        own_means: (L, E, H) mean router input of each expert's own prompts (or cluster).
        token_norm: (L,) mean router-input norm of a token.

    Returns:
        (L,) scales.
    """
    n_experts = unit.shape[1]
    if n_experts < 2:  # one expert: routing is moot; give rows a moderate length
        return DECISIVE_LOGIT_GAP / token_norm.clamp_min(1e-6)
    spread = torch.cdist(unit, unit).amax(dim=(1, 2))  # (L,) largest |r_e - r_f| between unit rows
    cap = MAX_TOKEN_LOGIT_GAP / (token_norm * spread).clamp_min(1e-6)
    logits = torch.einsum("leh,lfh->lef", own_means, unit)  # mean logit of e's tokens under row f
    own = logits.diagonal(dim1=1, dim2=2)  # (L, E)
    rivals = logits.masked_fill(torch.eye(n_experts, dtype=torch.bool), float("-inf")).amax(dim=2)
    gap = (own - rivals).median(dim=1).values  # (L,)
    wanted = DECISIVE_LOGIT_GAP / gap.clamp_min(1e-12)
    return torch.where(gap > 0, torch.minimum(wanted, cap), cap)


def gate_rows(direction: torch.Tensor, own_means: torch.Tensor, token_norm: torch.Tensor, *,
              center: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """Turn per-expert directions into router weights.

    Args:
        direction: (L, E, H) where each row should point (positive minus negative mean, centroid).
        own_means: (L, E, H) mean router input of each expert's own prompts, for the default scale.
        token_norm: (L,) mean router-input norm.
        center: subtract the mean over experts first (removes the component all prompts share).
        scale: fixed row length; default per layer from `default_scales`.

    Returns:
        (L, E, H) fp32 rows.
    """
    if center:
        direction = direction - direction.mean(dim=1, keepdim=True)
    unit = torch.nn.functional.normalize(direction.float(), dim=-1)
    scales = torch.full((unit.shape[0],), float(scale)) if scale else default_scales(unit, own_means, token_norm)
    return unit * scales[:, None, None]


def prompt_directions(own: torch.Tensor, negative: torch.Tensor, has_negative: torch.Tensor,
                      center: bool) -> torch.Tensor:
    """Where each expert's row points: its prompts' mean router input minus its negative prompts' mean.

    With `center` (``gate_center``), what all the experts' prompts share — the mean of their positive means,
    ``mu`` — is removed from both means first: ``(own - mu) - (negative - mu)`` for an expert with negative prompts,
    ``own - mu`` for the others. (Centring the directions after the subtraction, as before, took ``mu`` from an
    expert whose negative prompts had already removed it: its row pointed away from what every prompt shares, and
    its own prompts went to the others — the shipped frankenMoE recipe's math expert won 0 of its 30.)

    Args:
        own: (L, E, H) positive means; negative: (L, E, H) negative means (zeros where none);
        has_negative: (E,) bool.

    Returns:
        (L, E, H) directions.
    """
    mask = has_negative.to(own.dtype)[None, :, None]
    if not center:
        return own - negative * mask
    shared = own.mean(dim=1, keepdim=True)  # (L, 1, H)
    return (own - shared) - (negative - shared) * mask


def prompt_texts(experts: Sequence[ExpertPrompts]) -> tuple[list[str], list[int], list[str]]:
    """Every prompt in capture order, its group (expert e's positives: e; its negatives: E + e) and its
    recipe field (``experts[e].positive_prompts``)."""
    texts, groups, fields, n = [], [], [], len(experts)
    for e, expert in enumerate(experts):
        for kind, prompts, group in (("positive", expert.positive, e), ("negative", expert.negative, n + e)):
            texts += prompts
            groups += [group] * len(prompts)
            fields += [f"experts[{e}].{kind}_prompts"] * len(prompts)
    return texts, groups, fields


def prompt_router_inputs(streamed: StreamedModel, experts: Sequence[ExpertPrompts], reduce: Reduce,
                         batch_size: int, padding_side: Optional[str] = None,
                         encoded: Optional[list[Encoded]] = None,
                         layers: Optional[Sequence[int]] = None,
                         keep_positives: bool = False) -> tuple[torch.Tensor, torch.Tensor, RouterInputs]:
    """Mean router input of each expert's positive and negative prompts: ((L', E, H), (L', E, H) or
    zeros where an expert has no negatives, the raw `RouterInputs`), for `layers` (default all).

    `encoded`: the prompts as `encode` tokenized them in `prompt_texts` order, when the caller did it already.
    `keep_positives`: also keep the positive prompts' router inputs, for the routing self-check (`self_check`):
    every token's, or each prompt's mean when the tokens would hold more than `self_check.SELF_CHECK_BYTES`."""
    texts, groups, fields = prompt_texts(experts)
    n = len(experts)
    if encoded is None:
        encoded = encode(streamed.tokenizer, texts, streamed.max_length, fields=fields)
    keep, per_token = None, True
    if keep_positives:
        keep = torch.tensor([g < n for g in groups], dtype=torch.bool)
        tokens = sum(sum(e.real) for e, k in zip(encoded, keep.tolist()) if k)
        n_layers = len(streamed.norms) if layers is None else len(set(layers))
        per_token = tokens * n_layers * streamed.hidden_size * streamed.skeleton.dtype.itemsize <= SELF_CHECK_BYTES
    inputs = capture_router_inputs(streamed, encoded, groups, 2 * n, reduce, batch_size, padding_side, layers,
                                   keep=keep, keep_tokens=per_token)
    means = inputs.means()
    return means[:, :n], means[:, n:], inputs


def kmeans_router_inputs(streamed: StreamedModel, calibration_text: str, num_experts: int, seed: int,
                         batch_size: int, layers: Optional[Sequence[int]] = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cluster the calibration tokens' router inputs of each layer in `layers` (default all) into `num_experts`
    clusters. The token sample is the same whichever layers are asked for (its budget counts every layer).

    Returns:
        (centroids (L', E, H) unit, cluster means (L', E, H), mean token norm (L',)).

    Raises:
        ConfigError: too little calibration text for the number of experts.
    """
    encoded = encode_windows(streamed.tokenizer, read_documents(calibration_text))
    n_layers, hidden = len(streamed.norms), streamed.hidden_size
    total = sum(sum(e.real) for e in encoded)
    budget = kmeans_sample_budget(num_experts, n_layers, hidden)
    if total > budget:  # a seeded sample of token positions, fixed before the forward pass
        gen = torch.Generator().manual_seed(seed)
        keep = torch.zeros(total, dtype=torch.bool)
        keep[torch.randperm(total, generator=gen)[:budget]] = True
        out, pos = [], 0
        for e in encoded:
            flags = list(e.real)
            for i, r in enumerate(flags):
                if r:
                    flags[i] = bool(keep[pos])
                    pos += 1
            if any(flags):
                out.append(Encoded(e.ids, tuple(flags)))
        encoded = out
    inputs = capture_router_inputs(streamed, encoded, [], num_experts, "tokens", batch_size, layers=layers)
    centroids, means = [], []
    with stage("k-means", total=len(inputs.points or []) * RESTARTS, unit="runs") as st:
        for layer, points in zip(inputs.layers, inputs.points or []):
            def on_run(iterations: int, layer: int = layer) -> None:
                st.advance(note=f"layer {layer}: {iterations} iterations, {points.shape[0]} tokens")
            try:
                clusters = spherical_kmeans(points, num_experts, seed, on_run=on_run)
            except ValueError as exc:
                raise ConfigError(f"calibration_text: {calibration_text} gives {points.shape[0]} tokens; layer "
                                  f"{layer}: {exc}; add more text") from None
            sums = torch.nn.functional.one_hot(clusters.assignment, num_experts).T.float() @ points  # (E, H)
            centroids.append(clusters.centroids)
            means.append(sums / clusters.sizes[:, None].float())
    return torch.stack(centroids), torch.stack(means), inputs.token_norm


def compute_hidden_gates(params: GateParams, num_layers: int, base: Union[Checkpoint, Path, str],
                         layers: Optional[Sequence[int]] = None) -> dict[int, torch.Tensor]:
    """`checked_hidden_gates` without the routing self-check."""
    return checked_hidden_gates(params, num_layers, base, layers)[0]


def checked_hidden_gates(params: GateParams, num_layers: int, base: Union[Checkpoint, Path, str],
                         layers: Optional[Sequence[int]] = None, names: Optional[Sequence[str]] = None
                         ) -> tuple[dict[int, torch.Tensor], Optional[SelfCheck]]:
    """Router weights for gate modes ``hidden``, ``hidden_avg``, ``hidden_last`` and ``kmeans``, and with `names`
    (the experts' names, one row each) the routing self-check of the prompt modes (`self_check`): how many of its
    own prompts each expert wins through these rows, in `layers`.

    Streams the base model one layer at a time (see module docstring) on `params.device`, once; a
    ``model+lora`` base's adapter is merged into each tensor as it is read.

    Args:
        num_layers: the base's layers, as config.json says (checked against the model transformers builds).
        base: the opened base checkpoint, or its folder.
        layers: the layers to make rows for (the MoE layers); default every layer.

    Returns:
        layer -> (num_experts, hidden) fp32 rows, for `layers` only; the self-check (None for ``kmeans`` or
        without `names`).

    Raises:
        UpcycleError: the model cannot be built or read, the device is missing, or the
            prompts/calibration text are unusable.
    """
    base = base if isinstance(base, Checkpoint) else open_checkpoint(str(base), "base_model")
    tokenizer, encoded = load_tokenizer(base.path), None
    if params.mode != "kmeans":  # tokenized once, before any weight is read: a prompt of special tokens only is said now
        texts, _, fields = prompt_texts(params.experts)
        encoded = encode(tokenizer, texts, context_length(base.path), fields=fields)
    with stage("open base model", note=f"{base.path}, streamed one layer at a time"):  # config.json: seconds
        streamed = open_streamed(base, params.device, params.dtype, tokenizer, quantize=params.quantize)
    if len(streamed.norms) != num_layers:
        raise SourceError(f"base_model: transformers built {len(streamed.norms)} layers but config.json says {num_layers}")
    wanted = sorted(set(range(num_layers) if layers is None else layers))
    if not wanted:
        return {}, None
    checking = names is not None and params.mode != "kmeans"
    if params.mode == "kmeans":
        direction, own, token_norm = kmeans_router_inputs(streamed, str(params.calibration_text), len(params.experts),
                                                          params.seed, params.batch_size, wanted)
    else:
        experts = params.experts
        reduce: Reduce = "last" if params.mode == "hidden_last" else "mean"
        own, negative, inputs = prompt_router_inputs(streamed, experts, reduce, params.batch_size, encoded=encoded,
                                                     layers=wanted, keep_positives=checking)
        has_negative = torch.tensor([bool(e.negative) for e in experts])
        direction = prompt_directions(own, negative, has_negative, params.center)
        token_norm = inputs.token_norm
    # prompt directions come centred already (`prompt_directions`); k-means centroids are centred here
    rows = gate_rows(direction, own, token_norm, center=params.center and params.mode == "kmeans",
                     scale=params.scale)  # (L', E, H)
    gates = {layer: rows[i].contiguous() for i, layer in enumerate(wanted)}
    if not checking or inputs.kept is None or inputs.kept_text is None:
        return gates, None
    plain = None  # the same rows without any negative prompts (unit rows: a per-layer scale changes no top-1)
    if bool(has_negative.any()):
        unit = gate_rows(prompt_directions(own, negative, torch.zeros_like(has_negative), params.center), own,
                         token_norm, scale=1.0)
        plain = {layer: unit[i] for i, layer in enumerate(wanted)}
    _, groups, _ = prompt_texts(experts)
    kept = KeptInputs(dict(zip(wanted, inputs.kept)), inputs.kept_text, inputs.kept_tokens)
    return gates, check_routing(kept, gates, wanted, [g if g < len(experts) else -1 for g in groups], list(names),
                                plain, has_negative.tolist())
