"""Capture each layer's router input (the output of ``post_attention_layernorm``) from a base model.

Loads the base model once with transformers (GPU when present, accelerate's ``device_map="auto"``
for models larger than one GPU, optional 4/8-bit through bitsandbytes), batches the tokenized prompts or
calibration windows (`batches`: position ids from the attention mask, so padding never changes a result) and
runs forward passes whose hooks fold each batch into per-layer running sums over real tokens (no pad, no special
tokens). The forward pass stops after the last router input. Hidden states of all prompts are never kept. The hooks never wait for the device:
sums stay on the device the layer runs on, in fp32, reduced straight from the model-dtype
activations (no fp32 copy of a layer's output), and come to the CPU once, at the end. On a GPU the
router inputs of consecutive layers (up to 64 MiB) are reduced together: a few kernel launches per
batch instead of per layer, which at small batches cost as much as the layers themselves; and a
batch's inputs (ids, masks, positions, group indices) go to the device in one copy from pinned memory.

Hidden-state gates no longer load the base whole: they stream it one layer at a time (`stream.StreamedModel`,
whose ``run`` hands out the same router inputs from the same batches); `capture_router_inputs` reduces what either
hands out. The whole-model path stays for `route`'s batching and as the reference the streamed one is tested against.
It computes no gate rows: `hidden_gates` does.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import torch

from moe_upcycle.checkpoint.lora import Adapter, merge_into_model
from moe_upcycle.errors import (ConfigError, DependencyError, SourceError, UpcycleWarning,
                                reraise_if_out_of_memory)
from moe_upcycle.gates.batches import (Batch, Encoded, batch_on, context_length, load_tokenizer, on_device, pad_batch,
                                       padding_id)
from moe_upcycle.gates.skeleton import ROUTER_INPUT
from moe_upcycle.inputs.text import check_token_ids
from moe_upcycle.recipe.calibration import HELD_ROUTER_INPUTS_BYTES
from moe_upcycle.recipe.values import device_problem
from moe_upcycle.terminal.hints import install_hint
from moe_upcycle.terminal.progress import stage

Reduce = Literal["mean", "last", "tokens"]


class _StopForward(Exception):
    """Raised by the last layer's hook: nothing after the last router input is needed."""


@dataclass
class LoadedModel:
    """A base model loaded for capturing router inputs."""

    model: torch.nn.Module
    tokenizer: object
    norms: list[torch.nn.Module]  # each layer's post_attention_layernorm
    input_device: torch.device
    max_length: int
    consecutive_layers = True  # a batch's router inputs come layer after layer (`capture_router_inputs` holds them)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def run(self, encoded: list["Encoded"], batch_size: int, on_output: Callable, padding_side: Optional[str] = None,
            row_values: Optional[torch.Tensor] = None) -> None:
        """`run_batches` on this model."""
        run_batches(self, encoded, batch_size, on_output, padding_side, row_values)


@dataclass
class RouterInputs:
    """Per-layer running sums of router inputs.

    Attributes:
        sums: (L, G, H) fp32, per group the sum over its texts of each text's reduced router input
            (masked token mean, last real token) — or, for ``tokens``, unused (empty).
        counts: (G,) texts per group.
        token_norm: (L,) mean L2 norm of a real token's router input.
        points: for ``tokens``: per layer the captured token vectors (N, H), fp32 on CPU.
    """

    sums: torch.Tensor
    counts: torch.Tensor
    token_norm: torch.Tensor
    points: Optional[list[torch.Tensor]] = None
    kept: Optional[list[torch.Tensor]] = None  # with `keep`: per layer the kept texts' vectors (N, H), CPU
    kept_text: Optional[torch.Tensor] = None  # (N,) the text of each kept vector, the same in every layer
    kept_tokens: bool = True  # `kept` holds tokens (else one reduced vector per text)

    def means(self) -> torch.Tensor:
        """(L, G, H) mean over each group's texts."""
        return self.sums / self.counts.clamp_min(1)[None, :, None]


def resolve_device(device: str, where: str = "device:") -> str:
    """``auto`` → ``cuda`` when a GPU is present, else ``cpu``; checks a requested GPU exists. `where` is how
    the user gave it, for messages (the recipe's ``device:``, a command's ``--device``).

    Raises:
        ConfigError: not a device name (``gpu``, ``cuda:x``).
        DependencyError: CUDA requested but not available, or GPU index out of range.
    """
    if device_problem(device):
        raise ConfigError(f"{where} {device_problem(device)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DependencyError(f"{where} {device!r} asks for a GPU but torch sees no CUDA device; "
                                  f"use {where} cpu (or auto)")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise DependencyError(f"{where} {device!r} but only {torch.cuda.device_count()} GPU(s) are visible; "
                                  f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device


# measured on an H100 (issue 16): a random 1B-like model's gate rows against bf16, min cosine
QUANTIZE_4BIT_WARNING = (
    "quantize: 4bit: the base model's hidden states in 4-bit are far from bf16 (gate rows measured at "
    "min cosine 0.756 to the bf16 ones; 8bit: 0.982), so the routers will not be those of the model "
    "you publish; use quantize: 8bit, or no quantize: when the model fits")


def load_base(path: Path, device: str = "auto", dtype: Optional[str] = None,
              quantize: Optional[str] = None, adapter: Optional[Adapter] = None, tokenizer=None) -> LoadedModel:
    """Load the whole base model and its tokenizer once, for router-input capture.

    Args:
        path: the base model folder.
        device: ``auto``, ``cpu``, ``cuda`` (all GPUs, CPU offload beyond them) or ``cuda:N``.
        dtype: compute dtype; default bfloat16 on GPU, float32 on CPU.
        quantize: ``4bit`` or ``8bit`` through bitsandbytes (GPU only).
        adapter: a LoRA adapter (``model+lora`` base) merged into the loaded model.
        tokenizer: its tokenizer, when the caller loaded it already (`load_tokenizer`).

    Returns:
        The model in eval mode, its tokenizer (pad token set in memory only) and its norms.

    Raises:
        DependencyError: bitsandbytes missing for `quantize`, or the device is not available.
        SourceError: the model or tokenizer cannot be loaded, or has no post_attention_layernorm.
    """
    from transformers import AutoModelForCausalLM

    if quantize == "4bit":
        warnings.warn(QUANTIZE_4BIT_WARNING, UpcycleWarning, stacklevel=2)
    if quantize and importlib.util.find_spec("bitsandbytes") is None:
        raise DependencyError(f"quantize: {quantize} loading needs bitsandbytes, which is not installed; "
                              f"{install_hint('quant')}, or remove quantize:")
    dev = resolve_device(device)
    if quantize and dev == "cpu":
        raise DependencyError(f"quantize: {quantize} needs a CUDA GPU (bitsandbytes); use device: cuda or remove "
                              f"quantize:")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(
        dtype or "", torch.bfloat16 if dev != "cpu" else torch.float32)
    kwargs: dict = {"dtype": torch_dtype}
    if dev != "cpu":
        kwargs["device_map"] = "auto"  # one GPU when it fits; else every GPU, then CPU offload
        if ":" in dev:
            import psutil

            index = int(dev.split(":")[1])
            kwargs["max_memory"] = {index: torch.cuda.mem_get_info(index)[0], "cpu": psutil.virtual_memory().available}
    if quantize:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=quantize == "4bit", load_in_8bit=quantize == "8bit", bnb_4bit_compute_dtype=torch_dtype)
    tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
        merge_into_model(model, adapter)
    except SourceError:
        raise
    except Exception as exc:
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        raise SourceError(f"base_model: loading {path} with transformers for hidden-state gates failed "
                          f"({type(exc).__name__}: {exc}); use gate_mode: random or cheap_embed, or fix the model "
                          f"folder") from None
    layers = getattr(model.base_model, "layers", None)
    norms = [getattr(layer, ROUTER_INPUT, None) for layer in (layers or [])]
    if not norms or any(n is None for n in norms):
        raise SourceError(f"base_model: {path} has no {ROUTER_INPUT} in its decoder layers; hidden-state gates "
                          f"need a Llama-style model")
    return LoadedModel(model, tokenizer, norms, model.get_input_embeddings().weight.device, context_length(path))


def run_batches(loaded: LoadedModel, encoded: list[Encoded], batch_size: int,
                on_output: Callable[[int, torch.Tensor, "Batch"], None],
                padding_side: Optional[str] = None, row_values: Optional[torch.Tensor] = None) -> None:
    """Run every text through the base model in batches; call ``on_output(layer, x, batch)`` with each
    layer's router input ``x`` (B, T, H) and the `Batch` (its texts, real-token mask and `row_values`,
    on x's device). Texts are batched by length (less padding); the forward pass stops right after the
    last layer's router input.
    """
    tok = loaded.tokenizer
    side = padding_side or getattr(tok, "padding_side", "right")
    pad_id = padding_id(tok, loaded.model.get_input_embeddings().num_embeddings)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    state: dict = {}
    last = len(loaded.norms) - 1

    def hook_for(layer: int):
        def hook(module, args, output):
            x = output[0] if isinstance(output, tuple) else output
            batch = batch_on(state["on"], x.device)
            on_output(layer, x, batch)
            state["stage"].advance(len(batch.rows))
            if layer == last:
                raise _StopForward
        return hook

    handles = [norm.register_forward_hook(hook_for(i)) for i, norm in enumerate(loaded.norms)]
    decoder = loaded.model.base_model
    dev = torch.device(loaded.input_device)
    try:
        with torch.inference_mode(), stage("router inputs", total=len(order) * len(loaded.norms),
                                           unit="prompts×layers") as state["stage"]:
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                ids, attn, real = pad_batch([encoded[i] for i in rows], pad_id, side)
                check_token_ids(ids, loaded.model.get_input_embeddings().num_embeddings, tok)
                # Everything the batch needs on the device goes there in one copy, before the forward pass:
                # a host-to-device copy from inside a hook would wait for every kernel queued before it, and
                # from pinned memory the copy is queued, so the host prepares the next batch meanwhile.
                on = on_device(rows, ids, attn, real, row_values, dev)
                state["on"] = {dev: on.batch}
                try:
                    decoder(input_ids=on.ids, attention_mask=on.attn, position_ids=on.positions, use_cache=False)
                except _StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()


def capture_router_inputs(loaded: LoadedModel, encoded: list[Encoded], groups: list[int], num_groups: int,
                          reduce: Reduce = "mean", batch_size: int = 8,
                          padding_side: Optional[str] = None, keep: Optional[torch.Tensor] = None,
                          keep_tokens: bool = True) -> RouterInputs:
    """Sum, per layer and group, each text's router input reduced over its real tokens.

    Args:
        loaded: from `load_base`, or a `stream.StreamedModel` (anything with ``norms`` and ``run``, which hands out
            the router inputs as `run_batches` does).
        encoded: the texts (from `encode` / `encode_windows`).
        groups: group index of each text (e.g. its expert); ignored for ``tokens``.
        num_groups: number of groups.
        reduce: ``mean`` (masked mean over real tokens), ``last`` (last real token) or ``tokens``
            (keep every real token's vector: only for bounded k-means samples).
        batch_size: texts per forward pass.
        padding_side: override the tokenizer's (``left``/``right``).
        keep: (texts,) bool: also keep these texts' router inputs (``mean``/``last``), for the routing self-check
            (`self_check`): every real token's vector (`keep_tokens`), else each text's reduced one.
        keep_tokens: keep tokens rather than each text's reduced vector.

    Returns:
        The running sums (moved to CPU), text counts per group and mean token norms.
    """
    n_layers = len(loaded.norms)
    group_of = torch.tensor(groups, dtype=torch.long) if groups else torch.zeros(0, dtype=torch.long)
    acc: dict[torch.device, torch.Tensor] = {}  # device -> (L, G, H) fp32: the rows of the layers run there
    norm_acc: dict[torch.device, torch.Tensor] = {}  # device -> (L,) fp64
    points: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    kept: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]  # with `keep`, on the device until the end
    kept_text: list[torch.Tensor] = []
    n_tokens = sum(sum(e.real) for e in encoded)  # counted on the host, from the tokenizer's output
    derived: dict = {"batch": None}  # per-batch values derived once per device, reused by every layer
    pending: list[tuple[int, torch.Tensor, Batch]] = []  # (layer, router input, batch) of consecutive layers
    held = 0  # bytes of the router inputs pending
    hold = loaded.consecutive_layers  # a streamed model hands out one layer of every batch, then the next layer

    def per_batch(batch: Batch, what: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if derived["batch"] is not batch:
            derived.clear()
            derived["batch"] = batch
        if what not in derived:
            derived[what] = make()
        return derived[what]

    def on_output(layer: int, x: torch.Tensor, batch: Batch) -> None:
        # On a GPU a layer's reductions are a handful of tiny kernels, as many launches as a small batch's layer
        # costs: the router inputs of consecutive layers are kept (the MLP only reads them) and reduced together.
        nonlocal held
        if pending and pending[0][1].device != x.device:  # a model spread over devices: reduce each one's layers
            reduce_layers()
        pending.append((layer, x, batch))
        held += x.numel() * x.element_size()
        if (x.device.type in _EACH_LAYER_ON or not hold or layer == n_layers - 1 or held >= _PENDING_BYTES):
            reduce_layers()

    def reduce_layers() -> None:
        # x: (L', B, T, H) in the model dtype; pad rows may hold garbage, so select, never multiply.
        # Nothing here reads a value back to the host: every reduction stays queued on x's device.
        nonlocal held
        first, batch = pending[0][0], pending[0][2]
        real = batch.real
        dev, layers = real.device, slice(first, first + len(pending))
        x = torch.stack([t for _, t, _ in pending]) if len(pending) > 1 else pending[0][1][None]
        pending.clear()
        held = 0
        xm = torch.where(real[None, ..., None], x, 0)  # (L', B, T, H) model dtype
        if dev not in norm_acc:
            norm_acc[dev] = torch.zeros(n_layers, dtype=torch.float64, device=dev)
        # fp32 accumulation
        norm_acc[dev][layers] += torch.linalg.vector_norm(xm, dim=-1, dtype=torch.float32).sum(dim=(1, 2))
        if reduce == "tokens":  # bounded k-means samples, kept on the device until the end
            flat = per_batch(batch, "flat", lambda: real.flatten().nonzero().squeeze(1))  # one sync per batch
            for layer, kept in zip(range(first, layers.stop), xm.flatten(1, 2).index_select(1, flat).float()):
                points[layer].append(kept)
            return
        if reduce == "mean":
            count = per_batch(batch, "count", lambda: real.sum(dim=1, keepdim=True))  # (B, 1)
            per = xm.sum(dim=2, dtype=torch.float32) / count  # (L', B, H) fp32
        else:  # last real token of each row
            last = per_batch(batch, "last", lambda: real.shape[1] - 1 - real.flip(1).int().argmax(dim=1))
            per = xm[:, torch.arange(x.shape[1], device=dev), last].float()
        if dev not in acc:
            acc[dev] = torch.zeros(n_layers, num_groups, x.shape[-1], dtype=torch.float32, device=dev)
        acc[dev][layers].index_add_(1, batch.values, per)
        if keep is not None:
            keep_layers(first, batch, xm, per)

    def keep_layers(first: int, batch: Batch, xm: torch.Tensor, per: torch.Tensor) -> None:
        # the rows of the batch that are kept texts, then their real tokens (or their reduced vectors)
        rows = torch.tensor([i for i, t in enumerate(batch.rows) if keep[t]], dtype=torch.long)
        if not len(rows):
            return
        texts = torch.tensor(batch.rows)[rows]
        if keep_tokens:
            real = batch.real.cpu()[rows]  # (b, T)
            flat = real.flatten().nonzero().squeeze(1).to(xm.device)
            picked = xm.index_select(1, rows.to(xm.device)).flatten(1, 2).index_select(1, flat)  # (L', N, H)
            text_of = texts[:, None].expand(real.shape)[real]
        else:
            picked, text_of = per.index_select(1, rows.to(per.device)), texts
        for i, vectors in enumerate(picked):
            kept[first + i].append(vectors)
        if first == 0:
            kept_text.append(text_of)

    loaded.run(encoded, batch_size, on_output, padding_side, row_values=group_of if reduce != "tokens" else None)
    counts = torch.bincount(group_of, minlength=num_groups) if reduce != "tokens" else torch.zeros(num_groups)
    sums = sum(t.cpu() for t in acc.values()) if acc else torch.zeros(0)  # each layer's rows are on one device
    norms = sum(t.cpu() for t in norm_acc.values()) if norm_acc else torch.zeros(n_layers, dtype=torch.float64)
    token_norm = (norms / max(n_tokens, 1)).float()
    pts = [torch.cat(p).cpu() if p else torch.zeros(0) for p in points] if reduce == "tokens" else None
    if keep is None:
        return RouterInputs(sums, counts, token_norm, pts)
    kept_cpu = [torch.cat(k).cpu() if k else torch.zeros(0, loaded.hidden_size) for k in kept]
    text = torch.cat(kept_text) if kept_text else torch.zeros(0, dtype=torch.long)
    return RouterInputs(sums, counts, token_norm, pts, kept_cpu, text, keep_tokens)


# Router inputs held for one reduction on a GPU: enough to make its launches negligible, little beside the model.
# On the CPU an operation costs no launch: each layer is reduced as it comes, holding nothing.
_PENDING_BYTES = HELD_ROUTER_INPUTS_BYTES
_EACH_LAYER_ON = frozenset({"cpu"})
