"""Fold the base model's router inputs (each layer's ``post_attention_layernorm`` output) into per-layer sums.

`capture_router_inputs` runs texts through the streamed base (`stream.StreamedModel.run`: one decoder layer at a time,
batches padded as `batches` pads them, position ids from the attention mask so padding never changes a result) and
reduces each router input as it passes: per layer and group, the sum over texts of each text's masked mean over its
real tokens (no pad, no special tokens) or its last real token; or, for k-means, every real token's vector. Hidden
states of all texts are never kept, and only the layers asked for (the MoE layers) are reduced: a dense layer's
router input is never summed, and the stream stops after the last layer asked for.

Sums stay on the device the layers run on, in fp32, reduced straight from the model-dtype activations, and come to
the CPU once, at the end. What a reduction derives from a batch alone (its real-token counts, last positions, token
indices) is made once per batch and reused by every layer: the stream hands out every batch of layer l, then every
batch of layer l + 1, so it is kept per batch (`_PerBatch`), not for the last batch only.

It computes no gate rows (`hidden_gates` does) and loads no model (`stream` streams it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

import torch

from moe_upcycle.gates.batches import Batch, Encoded
from moe_upcycle.gates.stream import StreamedModel

Reduce = Literal["mean", "last", "tokens"]


@dataclass
class RouterInputs:
    """Per-layer running sums of router inputs, for the layers asked for.

    Attributes:
        layers: the layers reduced, in order; index i of every tensor below is layer ``layers[i]``.
        sums: (L', G, H) fp32, per group the sum over its texts of each text's reduced router input
            (masked token mean, last real token) — or, for ``tokens``, unused (empty).
        counts: (G,) texts per group.
        token_norm: (L',) mean L2 norm of a real token's router input.
        points: for ``tokens``: per layer the captured token vectors (N, H), fp32 on CPU.
    """

    layers: list[int]
    sums: torch.Tensor
    counts: torch.Tensor
    token_norm: torch.Tensor
    points: Optional[list[torch.Tensor]] = None
    kept: Optional[list[torch.Tensor]] = None  # with `keep`: per layer of `layers` the kept texts' vectors (N, H), CPU
    kept_text: Optional[torch.Tensor] = None  # (N,) the text of each kept vector, the same in every layer
    kept_tokens: bool = True  # `kept` holds tokens (else one reduced vector per text)

    def means(self) -> torch.Tensor:
        """(L', G, H) mean over each group's texts."""
        return self.sums / self.counts.clamp_min(1)[None, :, None]


def token_counts(real: torch.Tensor) -> torch.Tensor:
    """(B, 1) real tokens per text of a batch (`real`: (B, T) bool)."""
    return real.sum(dim=1, keepdim=True)


def last_positions(real: torch.Tensor) -> torch.Tensor:
    """(B,) position of each text's last real token."""
    return real.shape[1] - 1 - real.flip(1).int().argmax(dim=1)


def real_positions(real: torch.Tensor) -> torch.Tensor:
    """(N,) flat indices of a batch's real tokens in its (B·T) positions (one device sync)."""
    return real.flatten().nonzero().squeeze(1)


class _PerBatch:
    """Values derived from a batch alone, made once per batch whichever layer asks first.

    Keyed by the `Batch` object the stream hands out (the same object for every layer); the batch is kept with its
    values, so its id cannot be reused by another batch while this cache lives.
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[Batch, dict[str, torch.Tensor]]] = {}

    def get(self, batch: Batch, what: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        _, values = self._held.setdefault(id(batch), (batch, {}))
        if what not in values:
            values[what] = make(batch.real)
        return values[what]


def capture_router_inputs(streamed: StreamedModel, encoded: list[Encoded], groups: list[int], num_groups: int,
                          reduce: Reduce = "mean", batch_size: int = 8, padding_side: Optional[str] = None,
                          layers: Optional[Sequence[int]] = None, keep: Optional[torch.Tensor] = None,
                          keep_tokens: bool = True) -> RouterInputs:
    """Sum, per layer and group, each text's router input reduced over its real tokens.

    Args:
        streamed: the base (`stream.open_streamed`).
        encoded: the texts (from `encode` / `encode_windows`).
        groups: group index of each text (e.g. its expert); ignored for ``tokens``.
        num_groups: number of groups.
        reduce: ``mean`` (masked mean over real tokens), ``last`` (last real token) or ``tokens``
            (keep every real token's vector: only for bounded k-means samples).
        batch_size: texts per forward pass.
        padding_side: override the tokenizer's (``left``/``right``).
        layers: the layers to reduce (default every layer); the others' router inputs are never summed, and no
            layer after the last of them runs.
        keep: (texts,) bool: also keep these texts' router inputs (``mean``/``last``), for the routing self-check
            (`self_check`): every real token's vector (`keep_tokens`), else each text's reduced one.
        keep_tokens: keep tokens rather than each text's reduced vector.

    Returns:
        The running sums (moved to CPU) of `layers`, text counts per group and mean token norms.
    """
    wanted = sorted(set(range(len(streamed.norms)) if layers is None else layers))
    slot = {layer: i for i, layer in enumerate(wanted)}  # layer -> index in the returned tensors
    group_of = torch.tensor(groups, dtype=torch.long) if groups else torch.zeros(0, dtype=torch.long)
    acc: dict[torch.device, torch.Tensor] = {}  # device -> (L', G, H) fp32
    norm_acc: dict[torch.device, torch.Tensor] = {}  # device -> (L',) fp64
    points: list[list[torch.Tensor]] = [[] for _ in wanted]
    n_tokens = sum(sum(e.real) for e in encoded)  # counted on the host, from the tokenizer's output
    per_batch = _PerBatch()
    kept: list[list[torch.Tensor]] = [[] for _ in wanted]  # with `keep`, on the device until the end
    kept_text: list[torch.Tensor] = []

    def on_output(layer: int, x: torch.Tensor, batch: Batch) -> None:
        # x: (B, T, H) in the model dtype; pad rows may hold garbage, so select, never multiply.
        # Nothing here reads a value back to the host: every reduction stays queued on x's device.
        i = slot[layer]
        real, dev = batch.real, x.device
        xm = torch.where(real[..., None], x, 0)  # (B, T, H) model dtype
        if dev not in norm_acc:
            norm_acc[dev] = torch.zeros(len(wanted), dtype=torch.float64, device=dev)
        norm_acc[dev][i] += torch.linalg.vector_norm(xm, dim=-1, dtype=torch.float32).sum()  # fp32 accumulation
        if reduce == "tokens":  # bounded k-means samples, kept on the device until the end
            points[i].append(xm.flatten(0, 1).index_select(0, per_batch.get(batch, "flat", real_positions)).float())
            return
        if reduce == "mean":
            per = xm.sum(dim=1, dtype=torch.float32) / per_batch.get(batch, "count", token_counts)  # (B, H) fp32
        else:  # last real token of each row
            last = per_batch.get(batch, "last", last_positions)
            per = xm[torch.arange(x.shape[0], device=dev), last].float()
        if dev not in acc:
            acc[dev] = torch.zeros(len(wanted), num_groups, x.shape[-1], dtype=torch.float32, device=dev)
        acc[dev][i].index_add_(0, batch.values, per)
        if keep is not None:
            keep_layer(i, batch, xm, per)

    def keep_layer(i: int, batch: Batch, xm: torch.Tensor, per: torch.Tensor) -> None:
        # the rows of the batch that are kept texts, then their real tokens (or their reduced vectors)
        rows = torch.tensor([r for r, t in enumerate(batch.rows) if keep[t]], dtype=torch.long)
        if not len(rows):
            return
        texts = torch.tensor(batch.rows)[rows]
        if keep_tokens:
            real = batch.real.cpu()[rows]  # (b, T)
            flat = real.flatten().nonzero().squeeze(1).to(xm.device)
            picked = xm.index_select(0, rows.to(xm.device)).flatten(0, 1).index_select(0, flat)  # (N, H)
            text_of = texts[:, None].expand(real.shape)[real]
        else:
            picked, text_of = per.index_select(0, rows.to(per.device)), texts
        kept[i].append(picked)
        if i == 0:
            kept_text.append(text_of)

    if wanted:
        streamed.run(encoded, batch_size, on_output, padding_side,
                     row_values=group_of if reduce != "tokens" else None, layers=wanted)
    counts = torch.bincount(group_of, minlength=num_groups) if reduce != "tokens" else torch.zeros(num_groups)
    sums = sum(t.cpu() for t in acc.values()) if acc else torch.zeros(0)
    norms = sum(t.cpu() for t in norm_acc.values()) if norm_acc else torch.zeros(len(wanted), dtype=torch.float64)
    token_norm = (norms / max(n_tokens, 1)).float()
    pts = [torch.cat(p).cpu() if p else torch.zeros(0) for p in points] if reduce == "tokens" else None
    if keep is None:
        return RouterInputs(wanted, sums, counts, token_norm, pts)
    kept_cpu = [torch.cat(k).cpu() if k else torch.zeros(0, streamed.hidden_size) for k in kept]
    text = torch.cat(kept_text) if kept_text else torch.zeros(0, dtype=torch.long)
    return RouterInputs(wanted, sums, counts, token_norm, pts, kept_cpu, text, keep_tokens)
