"""The base model run one decoder layer at a time, from the checkpoint's own tensors: gates for any model size.

`StreamedModel` is the base model as hidden-state gates run it, never loaded whole: a meta-device skeleton of
transformers' own modules (`skeleton`), the checkpoint (`Checkpoint.read`: memory-mapped, a ``model+lora`` adapter
merged in as read) and the tokenizer. It is the only way the gates run the base. `StreamedModel.run` hands out each
layer's router input for every batch of texts, looping over layers outside and batches inside:

1. the texts are sorted by length, batched and padded (`batches.pad_batch`), position ids taken from the attention
   mask, so a text gives the same numbers alone or padded in a batch;
2. each batch's embeddings are gathered from the mapped embedding matrix (only its rows are read) and the model's own
   forward runs once with recorders for layers (`skeleton.record_layer_kwargs`): the mask, rotary cos/sin and
   positions each layer gets;
3. per layer: its tensors are read (`LayerReader`, which reads the next layer meanwhile), every batch's hidden states
   (B, T, H), kept between layers in the compute dtype, go through it, the hooks on ``post_attention_layernorm``
   hand out the router inputs, and the layer is dropped. The last layer asked for (the last MoE layer) stops at its
   router input: its MLP is never read, nor any layer after it, the final norm or the LM head: no gate needs them.

Memory is one layer of weights plus the batches' hidden states, which are bounded (`STREAMED_STATES_BYTES`): texts
beyond the bound run in further passes, each reading the layers again. `StreamedModel.layer_inputs` hands out each
layer's *input* instead (mergekit-moe's ``hidden_states[:-1]``). It computes no gate row: `hidden_gates` and
`mergekit_gates` do.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.dtypes import DTYPES, dtype_name
from moe_upcycle.errors import SourceError, UpcycleWarning
from moe_upcycle.gates.batches import Batch, Encoded, context_length, on_device, pad_batch, padding_id, to_device
from moe_upcycle.gates.device import resolve_device
from moe_upcycle.gates.layer_reader import LayerReader
from moe_upcycle.gates.skeleton import Skeleton, build_skeleton, layer_keys, move_buffers, record_layer_kwargs
from moe_upcycle.inputs.text import check_token_ids
from moe_upcycle.recipe.calibration import STREAMED_STATES_BYTES, streamed_batch_bytes
from moe_upcycle.terminal.progress import stage

# `quantize:` made a whole base fit a GPU in 4/8 bit; streamed, it always fits, at full precision
QUANTIZE_NOTE = ("quantize: {quantize} is not applied: hidden-state gates stream the base model one layer at a time, "
                 "so its weights never need to fit in memory at once, and the routers are computed at full precision "
                 "({dtype}), as the model you publish computes (4-bit hidden states gave rows at cosine 0.756 to "
                 "bf16's); remove quantize: from the recipe")


class _StopForward(Exception):
    """Raised by the last layer's router-input hook: nothing after it is needed."""


@dataclass
class BatchInputs:
    """One batch on the host, before the stream: token ids (B, T), attention mask (B, T), position ids (B, T) or
    None (the model's default), and the `Batch` the callbacks get (on the compute device)."""

    ids: torch.Tensor
    attn: torch.Tensor
    positions: Optional[torch.Tensor]
    batch: Batch


@dataclass
class _State:
    """A batch between layers: its hidden states (B, T, H) in the compute dtype on the device (the next layer's
    input) and each layer's other arguments, recorded from the model's own forward."""

    batch: Batch
    hidden: torch.Tensor
    layer_args: list[tuple[tuple, dict]]


@dataclass
class StreamedModel:
    """A base model run one layer at a time (see the module docstring); `open_streamed` makes one.

    Attributes:
        checkpoint: the base checkpoint, read tensor by tensor.
        tokenizer: its tokenizer (pad token set in memory only).
        skeleton: the model on the meta device.
        device: where the layers run.
        max_length: the model's context (config.json's max_position_embeddings).
        prefetch: read the next layer in a thread while one runs.
        states_bytes: bound on the hidden states a pass holds (estimated by `StreamedModel.held_bytes`).
    """

    checkpoint: Checkpoint
    tokenizer: object
    skeleton: Skeleton
    device: torch.device
    max_length: int
    prefetch: bool = True
    states_bytes: int = STREAMED_STATES_BYTES

    @property
    def norms(self) -> list[torch.nn.Module]:
        return self.skeleton.norms

    @property
    def hidden_size(self) -> int:
        return self.skeleton.hidden_size

    def run(self, encoded: list[Encoded], batch_size: int, on_output: Callable[[int, torch.Tensor, Batch], None],
            padding_side: Optional[str] = None, row_values: Optional[torch.Tensor] = None,
            layers: Optional[Sequence[int]] = None) -> None:
        """``on_output(layer, x, batch)`` with each layer's router input ``x`` (B, T, H) of every batch, layer by
        layer (within a layer, batches of texts sorted by length).

        Args:
            encoded: the texts (`batches.encode`).
            batch_size: texts per batch.
            on_output: called per layer in `layers` and batch; ``batch.values`` holds the batch's `row_values`.
            padding_side: override the tokenizer's (``left``/``right``).
            row_values: (texts,) a value per text handed out with its batch (e.g. its group).
            layers: the layers whose router inputs are handed out (default every layer); nothing after the last of
                them runs or is read.
        """
        tok = self.tokenizer
        side = padding_side or getattr(tok, "padding_side", "right")
        pad_id = padding_id(tok, self.skeleton.num_embeddings)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
        batches = []
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            ids, attn, real = pad_batch([encoded[i] for i in rows], pad_id, side)
            check_token_ids(ids, self.skeleton.num_embeddings, tok)
            on = on_device(rows, ids, attn, real, row_values, self.device)  # one copy to the device
            batches.append(BatchInputs(ids, on.attn, on.positions, on.batch))
        wanted = set(range(len(self.norms)) if layers is None else layers)
        last = max(wanted)
        current: dict = {}

        def hook_for(layer: int):
            def hook(module, args, output):
                x = output[0] if isinstance(output, tuple) else output
                if layer in wanted:
                    on_output(layer, x, current["state"].batch)
                if layer == last:
                    raise _StopForward
            return hook

        handles = [norm.register_forward_hook(hook_for(i)) for i, norm in enumerate(self.norms[:last + 1])]
        try:
            self._stream(batches, current, last + 1, router_inputs=True)
        finally:
            for h in handles:
                h.remove()

    def layer_inputs(self, batches: list[BatchInputs], on_input: Callable[[int, torch.Tensor, Batch], None],
                     layers: Optional[Sequence[int]] = None) -> None:
        """``on_input(layer, h, batch)`` with the input hidden states ``h`` (B, T, H) of every layer in `layers`
        (default all; the output of the embedding for layer 0), for every batch, layer by layer; the last layer
        asked for itself never runs, nor any after it."""
        wanted = set(range(len(self.norms)) if layers is None else layers)

        def on_wanted(layer: int, h: torch.Tensor, batch: Batch) -> None:
            if layer in wanted:
                on_input(layer, h, batch)

        self._stream(batches, {}, max(wanted) + 1, router_inputs=False, on_input=on_wanted)

    # ------------------------------------------------------------------------------------------------ the stream

    def _stream(self, batches: list[BatchInputs], current: dict, n: int, router_inputs: bool,
                on_input: Optional[Callable[[int, torch.Tensor, Batch], None]] = None) -> None:
        """Every batch through layers 0..n-1, one layer's weights at a time, in passes of at most `states_bytes`."""
        sk = self.skeleton
        running = n if router_inputs else n - 1  # layers that run; the last only up to its router input
        texts = sum(len(b.batch.rows) for b in batches)
        with torch.inference_mode(), stage("router inputs", total=texts * n, unit="prompts×layers") as st:
            for group in passes(batches, self.states_bytes, self.held_bytes):
                embed = self.checkpoint.read(sk.embed_key)  # a mapped view: gathering reads only its rows
                keys = [layer_keys(sk, layer, router_input_only=layer == n - 1) for layer in range(running)]
                with LayerReader(self.checkpoint, keys, sk.dtype, self.device, self.prefetch) as reader:
                    states = [self._start(b, embed) for b in group]  # while the reader reads layer 0
                    del embed
                    for layer in range(n):
                        if on_input is not None:
                            for state in states:
                                on_input(layer, state.hidden, state.batch)
                                st.advance(len(state.batch.rows))
                        if layer == running:
                            break
                        params = reader.take()
                        for state in states:
                            current["state"] = state
                            args, kwargs = state.layer_args[layer]
                            try:
                                out = torch.func.functional_call(sk.layers[layer], params, (state.hidden, *args),
                                                                 kwargs, strict=False)
                                state.hidden = out[0] if isinstance(out, tuple) else out
                            except _StopForward:  # the last layer, after its router input
                                state.hidden = None
                            if on_input is None:
                                st.advance(len(state.batch.rows))
                        del params
                        reader.release()

    def _start(self, inputs: BatchInputs, embed: torch.Tensor) -> _State:
        """The batch's embeddings (its rows of the mapped matrix, cast as a loaded model's would be) and the
        arguments the model's forward gives each layer."""
        embeds = to_device(embed[inputs.ids], self.device).to(self.skeleton.dtype)  # (B, T, H)
        hidden, layer_args = record_layer_kwargs(self.skeleton, embeds, inputs.attn, inputs.positions)
        return _State(inputs.batch, hidden, layer_args)

    def held_bytes(self, batch: int, tokens: int) -> int:
        """Bytes a batch holds between layers (`calibration.streamed_batch_bytes`)."""
        cfg = self.skeleton.model.config
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // int(cfg.num_attention_heads)
        return streamed_batch_bytes(batch, tokens, self.hidden_size, int(head_dim), self.skeleton.dtype.itemsize)


def passes(batches: list[BatchInputs], budget: int, size: Callable[[int, int], int]) -> list[list[BatchInputs]]:
    """Consecutive batches grouped so that each group holds at most `budget` bytes (`size(B, T)` each); a batch
    larger than the budget is a group of its own."""
    groups: list[list[BatchInputs]] = []
    held = budget + 1
    for b in batches:
        need = size(*b.ids.shape)
        if held + need > budget:
            groups.append([])
            held = 0
        groups[-1].append(b)
        held += need
    return groups


def tensor_problems(skeleton: Skeleton, checkpoint: Checkpoint) -> list[str]:
    """Every tensor the stream will read that the checkpoint lacks, or holds in another shape than the model
    transformers builds from config.json (which ``from_pretrained`` would start at random, or refuse)."""
    wanted = {skeleton.embed_key: tuple(skeleton.model.get_input_embeddings().weight.shape)}
    for layer, module in enumerate(skeleton.layers):
        for name, param in module.named_parameters():
            wanted[f"{skeleton.layer_prefix}{layer}.{name}"] = tuple(param.shape)
    where = f"base_model: {checkpoint.path}"
    missing = [key for key in wanted if key not in checkpoint.tensors]
    problems = []
    if missing:
        shown = ", ".join(repr(k) for k in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        problems.append(f"{where} has no tensor {shown}, which the {skeleton.model.config.model_type} model its "
                        f"config.json describes has (transformers would start them at random); hidden-state gates run "
                        f"the model as transformers builds it — check config.json (biases, head_dim) against the "
                        f"weights")
    problems += [f"{where}: tensor {key!r} is {list(checkpoint.tensors[key].shape)} but the model its config.json "
                 f"describes has {list(shape)} there; check config.json against the weights"
                 for key, shape in wanted.items() if key in checkpoint.tensors
                 and tuple(checkpoint.tensors[key].shape) != shape]
    return problems


def open_streamed(checkpoint: Checkpoint, device: str = "auto", dtype: Optional[str] = None, tokenizer=None,
                  prefetch: bool = True, quantize: Optional[str] = None) -> StreamedModel:
    """The base model `checkpoint` ready to stream, in seconds whatever its size (nothing is read but config.json).

    Args:
        checkpoint: the opened base checkpoint (with its adapter, for a ``model+lora`` base).
        device: ``auto``, ``cpu``, ``cuda`` (GPU 0) or ``cuda:N``.
        dtype: compute dtype name; default bfloat16 on a GPU, float32 on the CPU.
        tokenizer: the tokenizer to batch with; default the base's (`batches.load_tokenizer`).
        prefetch: read each next layer in a thread while one runs.
        quantize: the recipe's ``quantize:``, said to be unneeded and not applied (`QUANTIZE_NOTE`).

    Raises:
        DependencyError: the device is not available.
        SourceError: the model cannot be built from config.json, or its tokenizer does not load.
    """
    from moe_upcycle.gates.batches import load_tokenizer

    dev = torch.device(resolve_device(device))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch_dtype = DTYPES.get(dtype or "", torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if quantize:
        warnings.warn(QUANTIZE_NOTE.format(quantize=quantize, dtype=dtype_name(torch_dtype)),
                      UpcycleWarning, stacklevel=3)
    tokenizer = load_tokenizer(checkpoint.path) if tokenizer is None else tokenizer
    skeleton = build_skeleton(checkpoint.path, torch_dtype)
    problems = tensor_problems(skeleton, checkpoint)
    if problems:
        raise SourceError(*problems)
    move_buffers(skeleton, dev)
    return StreamedModel(checkpoint, tokenizer, skeleton, dev, context_length(checkpoint.path), prefetch)
