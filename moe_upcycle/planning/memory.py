"""Peak memory of a build and of its gate computation, predicted from the plan (no tensor is read).

A build's resident memory is of two kinds, so there are two figures:

- **private** (anonymous) memory, which only the process can free: the Python/torch runtime, the
  routers, the tensors the executor must create (a dtype cast, a transformed slot's fp32 working
  copies, a clone, an average, zeros), and for hidden-state gates one decoder layer of the base
  (they stream it, `gates.stream`), the prompts' hidden states between layers and one batch of
  activations;
- **mapped input**: `Checkpoint.read` returns copy-on-write memory maps of the input files, so a
  build's RSS also counts every input page it has read (up to the whole input). That is page cache:
  the kernel drops it under memory pressure and re-reads it when touched.

RSS = private + the runtime's mapped libraries + the mapped input. The build's peak is that of its
costliest phase: gates, writing, or the init-drift report (which loads the dense and the MoE model
in fp32; see `check.drift`). ``build`` lints prompts with a sentence embedder first, which stays
loaded (`prompts.embed`); ``build --no-lint`` saves it. ``--verify`` is not counted.

The runtime constants are measured, not fitted to the large cases: `RUNTIME_BYTES` is the peak
RssAnon of ``python -m moe_upcycle build`` of stories260K (its tensors are < 1 MB),
`TRANSFORMERS_BYTES` what the same build adds with ``gate_mode: hidden`` (transformers imported, a
tiny model and tokenizer loaded), `LINT_BYTES` what the prompt lint adds, and the activation rule
was read off `capture_router_inputs` runs at 8 × 32…512 tokens (a SmolLM2-135M shape). Machine:
x86-64 Linux, Python 3.11, torch 2.13 (CPU), transformers 5.23. ``scripts/bench_plan_memory.py``
re-measures every figure against real builds.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Optional

import torch

from moe_upcycle.checkpoint import names, shard_file
from moe_upcycle.checkpoint.writer import TensorSpec, assign_shards
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.planning.steps import Plan, Step
from moe_upcycle.recipe.params import HIDDEN_MODES, PROMPT_MODES, CheckParams, GateParams, WriteParams
from moe_upcycle.dtypes import DTYPES
from moe_upcycle.errors import ConfigError
from moe_upcycle.recipe.calibration import (CALIBRATION_WINDOW, KMEANS_MAX_POINTS, STREAMED_STATES_BYTES,
                                            kmeans_sample_budget, read_documents, streamed_batch_bytes)

RUNTIME_BYTES = 165 * 10**6  # Python + torch + moe_upcycle imported, CLI running
TRANSFORMERS_BYTES = 155 * 10**6  # transformers imported, a model class built, a tokenizer loaded
LINT_BYTES = 70 * 10**6  # the prompt lint's all-MiniLM-L6-v2 and sentence-transformers
RUNTIME_FILE_BYTES = 90 * 10**6  # mapped libraries (RssFile) of the CLI runtime
TRANSFORMERS_FILE_BYTES = 40 * 10**6  # ... and what transformers/tokenizers add
MB = 10**6


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peaks, in bytes (see the module docstring for what each figure means).

    Attributes:
        build_private_bytes: peak private memory of ``moe-upcycle build`` (its costliest phase).
        build_rss_bytes: peak RSS of the build: private + mapped libraries + mapped input.
        build_phase: the phase that sets the build's peak: "gates", "writing" or "init drift".
        gate_private_bytes, gate_rss_bytes: the same for computing the routers alone.
        mapped_input_bytes: input bytes the writing phase maps (reclaimable page cache).
        lint_bytes: the prompt lint's share of `build_private_bytes` (0 when ``build`` lints nothing).
        gpu_bytes: GPU memory of hidden-state gates run on a GPU (0 on the CPU; not measured).
        assumptions: short lines saying what the figures assume.
    """

    build_private_bytes: int
    build_rss_bytes: int
    build_phase: str
    gate_private_bytes: int
    gate_rss_bytes: int
    mapped_input_bytes: int
    lint_bytes: int = 0
    gpu_bytes: int = 0
    assumptions: tuple[str, ...] = ()


def estimate_memory(plan: Plan, gating: GateParams, writing: WriteParams, checking: CheckParams,
                    sources: dict[str, Checkpoint], base_ref: str) -> MemoryEstimate:
    """Predict the peak memory of a build of `plan` and of its gate computation.

    Example:
        >>> r = resolved(cfg); m = estimate_memory(plan, r.gates, r.writing, r.checking, sources, cfg.base_model)  # doctest: +SKIP
        >>> m.build_private_bytes, m.build_phase  # doctest: +SKIP
        (165722112, 'writing')
    """
    base = sources[base_ref]
    gate_private, gate_files, gpu, gate_notes = gate_phase(plan, gating, base)
    routers = router_bytes(plan)
    write_private = (RUNTIME_BYTES + routers + writing_peak(plan, sources, writing.tensor_policy)
                     + staging_bytes(plan, writing))
    mapped = mapped_input_bytes(plan, sources)
    phases = {"gates": (gate_private, gate_files), "writing": (write_private, RUNTIME_FILE_BYTES + mapped)}
    drift = drift_phase(plan, checking, base)
    if drift:
        phases["init drift"] = drift
    phase = max(phases, key=lambda p: phases[p][0])
    lint = LINT_BYTES if lints_prompts(gating) else 0
    build_private = phases[phase][0] + lint
    build_rss = max(p + f for p, f in phases.values()) + lint
    notes = [f"private = {RUNTIME_BYTES // MB} MB Python+torch runtime (measured, x86-64 Linux, torch 2.13 CPU)"
             + (f" + {TRANSFORMERS_BYTES // MB} MB when transformers runs" if gate_notes or drift else "")
             + f" + routers + tensors the build creates + {staging_bytes(plan, writing) / MB:.0f} MB of write buffers;"
             + " the input is memory-mapped, not copied"]
    notes += gate_notes
    if drift:
        notes.append("init drift report: dense and MoE loaded in fp32 (report_init_drift: false skips it)")
    if lint:
        notes.append(f"prompt lint embedder +{LINT_BYTES // MB} MB (build --no-lint skips it); --verify not counted")
    return MemoryEstimate(build_private, build_rss, phase, gate_private, gate_private + gate_files, mapped, lint, gpu,
                          tuple(notes))


def staging_bytes(plan: Plan, writing: WriteParams) -> int:
    """The writer's page-aligned staging buffers (`shard_file`): `DEPTH` of `BUFFER_BYTES` per shard
    file, touched only as far as the largest shard reaches (one file's buffers are live at a time)."""
    largest = max((sum(s.nbytes for s in shard) for shard in
                   assign_shards([TensorSpec(s.name, s.shape, s.dtype) for s in plan.steps], writing.max_shard_bytes)),
                  default=0)
    return min(shard_file.DEPTH * shard_file.BUFFER_BYTES, largest + (-largest % shard_file.BLOCK))


def router_bytes(plan: Plan) -> int:
    """The router matrices held (fp32) from gate computation until they are written."""
    return len(plan.moe_layers) * len(plan.expert_names) * plan.base_config.hidden_size * 4


def mapped_input_bytes(plan: Plan, sources: dict[str, Checkpoint]) -> int:
    """Bytes of the input tensors the plan reads: what the writing phase maps from page cache."""
    read = {leaf.source for leaf in plan.leaf_steps() if leaf.source is not None}
    return sum(sources[ref].tensors[key].nbytes for ref, key in read)


def lints_prompts(gating: GateParams) -> bool:
    """Whether ``build`` lints the recipe's prompts with a sentence embedder: installed, and a gate mode that
    routes on the prompts, which every expert has (`cli.commands._warn_prompt_lint`)."""
    return (gating.mode in PROMPT_MODES and bool(gating.experts) and all(e.positive for e in gating.experts)
            and importlib.util.find_spec("sentence_transformers") is not None)


# ---------------------------------------------------------------------------------------------
# Gates


def gate_phase(plan: Plan, gating: GateParams, base: Checkpoint) -> tuple[int, int, int, list[str]]:
    """(private bytes, mapped-file bytes, GPU bytes, assumption lines) of computing the routers.

    ``random``/``uniform*`` hold only the routers; ``cheap_embed`` (and prompt-initialised shared
    gates) read the embedding and make an fp32 copy of it; hidden-state modes stream the base one
    layer at a time (`gates.stream`): one layer of weights, the prompts' hidden states between layers
    and one batch's activations inside a layer.
    """
    routers = router_bytes(plan)
    hidden = gating.mode in HIDDEN_MODES
    embed = gating.mode == "cheap_embed" or any(s.kind == "shared_gate" for s in plan.steps)
    if not hidden and not embed:
        return RUNTIME_BYTES + routers, RUNTIME_FILE_BYTES, 0, []
    private = RUNTIME_BYTES + TRANSFORMERS_BYTES + routers
    files = RUNTIME_FILE_BYTES + TRANSFORMERS_FILE_BYTES
    notes: list[str] = []
    if embed and names.EMBED in base.tensors:
        info = base.tensors[names.EMBED]
        private += math.prod(info.shape) * 4 if info.dtype != torch.float32 else 0
        files += info.nbytes
        if base.adapter is not None and base.adapter.changes(names.EMBED):  # merged: a new tensor, fp32 work
            private += info.nbytes + 12 * math.prod(info.shape)
    if not hidden:
        return private, files, 0, notes
    dtype = gate_dtype(gating)
    itemsize = DTYPES[dtype].itemsize
    gpu = gate_device(gating) == "gpu"
    stored, cast = layer_bytes(base, DTYPES[dtype], copied=gpu)
    merge = merge_bytes(base, plan, gating, gpu)
    states, passes = streamed_states(plan, gating)
    acts = activation_bytes(plan, gating)
    files += sum(t.nbytes for t in base.tensors.values() if t.key != names.LM_HEAD)  # every layer passes the page cache
    batch, tokens = batch_shape(gating)
    read = f" in {passes} passes, each reading the layers again" if passes > 1 else ""
    if gating.quantize:
        notes.append(f"quantize: {gating.quantize} is not applied: the gates stream the base at full precision ({dtype})")
    if not gpu:
        notes.append(f"hidden gates on the CPU stream the base one layer at a time{read}: one layer in {dtype} "
                     f"({cast // MB} MB; a layer stored in {dtype} runs on the mapped file) + the prompts' hidden "
                     f"states between layers ({states // MB} MB) + activations of {batch} × {tokens} tokens "
                     f"({acts // MB} MB; tokens ≤ UTF-8 bytes of the longest prompt)")
        return private + cast + merge + states + acts, files, 0, notes
    # the layer running and the one arriving, on the GPU and in pinned host memory; one router input reduced
    held = 3 * batch * tokens * plan.base_config.hidden_size * itemsize
    device = 2 * cast + states + acts + held
    notes.append(f"hidden gates on the GPU stream the base one layer at a time{read}: {device // MB} MB of GPU memory "
                 f"(two layers, the prompts' hidden states, one batch; not measured); host memory is the runtime "
                 f"and two layers of pinned staging ({2 * stored // MB} MB)")
    return private + 2 * stored + merge, files, device, notes


def gate_device(gating: GateParams) -> str:
    """"cpu" or "gpu": where hidden-state gates will run (``auto`` picks a visible GPU)."""
    if gating.device == "cpu" or (gating.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return "gpu"


def gate_dtype(gating: GateParams) -> str:
    """The dtype hidden-state gates compute in: `gate_dtype`, else bfloat16 on a GPU and for ``gate_source: mergekit``,
    float32 on the CPU (`gates.stream.open_streamed`). ``quantize:`` no longer changes it: the stream does not apply it."""
    return gating.dtype or ("bfloat16" if gating.source == "mergekit" or gate_device(gating) == "gpu" else "float32")


def layer_bytes(base: Checkpoint, dtype: torch.dtype, copied: bool) -> tuple[int, int]:
    """(stored bytes, bytes made in `dtype`) of the largest decoder layer.

    On the CPU (`copied` False) a tensor stored in `dtype` is used as its mapped view: only the others are cast into
    private memory (`layer_reader.LayerReader`); on a GPU every tensor is copied there.
    """
    stored: dict[int, int] = {}
    made: dict[int, int] = {}
    for key, info in base.tensors.items():
        _, layer = names.split_layer(key)
        if layer is None:
            continue
        stored[layer] = stored.get(layer, 0) + info.nbytes
        if copied or info.dtype != dtype:
            made[layer] = made.get(layer, 0) + math.prod(info.shape) * dtype.itemsize
    return max(stored.values(), default=0), max(made.values(), default=0)


def merge_bytes(base: Checkpoint, plan: Plan, gating: GateParams, gpu: bool = False) -> int:
    """Private bytes that merging a ``model+lora`` adapter holds while the gates stream the base, or 0 without one.

    `Checkpoint.read` merges an adapted tensor as it reads it (`lora.Adapter.merge`), and the layer reader reads a
    whole layer one layer ahead (`gates.layer_reader`). On the CPU two consecutive layers' merged tensors are alive:
    the layer running (its merged tensors are its parameters when stored in the compute dtype; cast, the merged copies
    live until the cast is done, while the next layer is read) and the one read ahead. On a GPU one: a layer's merged
    tensors are dropped once copied to the device. The stream reads layers up to the last MoE layer only: for native
    gates that layer without its MLP (it stops at the router input), for mergekit's not at all (its input is the
    layer before's output). On top, the work of one merge: its fp32 delta (B @ A), and for a tensor not stored in
    fp32 the fp32 copy of W and the fp32 sum besides the merged result. The embedding, when adapted, is merged for
    the batches' embeddings while layer 0 is read ahead; it is dropped before layer 1 is read.
    """
    if base.adapter is None:
        return 0
    adapted = [base.tensors[k] for k in [*base.adapter.pairs, *base.adapter.replaced] if k in base.tensors]
    last = max(plan.moe_layers, default=plan.num_layers - 1)
    full: dict[int, int] = {}
    router_input: dict[int, int] = {}  # a layer read up to its router input: everything but its MLP
    for info in adapted:
        _, layer = names.split_layer(info.key)
        if layer is not None:
            full[layer] = full.get(layer, 0) + info.nbytes
            if ".mlp." not in info.key:
                router_input[layer] = router_input.get(layer, 0) + info.nbytes
    if gating.source == "mergekit":
        read = [full.get(layer, 0) for layer in range(last)]
    else:
        read = [full.get(layer, 0) for layer in range(last)] + [router_input.get(last, 0)]
    pairs = [a + b for a, b in zip(read, read[1:])] or read
    held = max(read, default=0) if gpu else max(pairs, default=0)
    work = max(((4 if t.dtype == torch.float32 else 12) * math.prod(t.shape) for t in adapted), default=0)
    embed = next((t.nbytes for t in adapted if t.key == names.EMBED), 0)
    return max(held, embed + (read[0] if read else 0)) + work


def batch_shape(gating: GateParams) -> tuple[int, int]:
    """(texts, tokens) of the largest forward pass: tokens bounded by the longest prompt's UTF-8 bytes
    (+2 special tokens); k-means runs calibration windows of `CALIBRATION_WINDOW` tokens."""
    shapes = batch_shapes(gating)
    return max(b for b, _ in shapes), max(t for _, t in shapes)


def batch_shapes(gating: GateParams, sample: int = KMEANS_MAX_POINTS) -> list[tuple[int, int]]:
    """(texts, tokens) of every batch the gates run, tokens bounded by UTF-8 bytes (+2 special tokens): the prompts
    sorted by length in batches of `batch_size` (mergekit: each expert's positive, then negative, prompts); k-means
    the calibration windows of `CALIBRATION_WINDOW` tokens holding one of its `sample` tokens."""
    if gating.mode == "kmeans":
        windows = kmeans_windows(gating, sample)
        return [(gating.batch_size, CALIBRATION_WINDOW)] * max(1, -(-windows // gating.batch_size))
    if gating.source == "mergekit":  # one batch per expert's positive (or negative) prompts
        sets = [p for e in gating.experts for p in (e.positive, e.negative) if p] or [("",)]
        return [(len(p), max(len(x.encode()) for x in p) + 2) for p in sets]
    lengths = sorted(len(p.encode()) + 2 for e in gating.experts for p in (*e.positive, *e.negative)) or [2]
    size = gating.batch_size
    return [(len(lengths[i:i + size]), lengths[i:i + size][-1]) for i in range(0, len(lengths), size)]


def kmeans_windows(gating: GateParams, sample: int) -> int:
    """Calibration windows k-means runs: one per `CALIBRATION_WINDOW` tokens of each document (tokens ≤ UTF-8
    bytes), at most one per sampled token (`sample`, from `kmeans_sample_budget`)."""
    try:
        docs = read_documents(gating.calibration_text) if gating.calibration_text else []
    except ConfigError:  # said by the build; the estimate takes the largest case
        docs = []
    windows = sum(-(-(len(d.encode()) + 2) // CALIBRATION_WINDOW) for d in docs)
    return min(windows, sample) if docs else sample


def streamed_states(plan: Plan, gating: GateParams) -> tuple[int, int]:
    """(bytes, passes): the hidden states the stream holds between layers in its largest pass, and how many passes
    the batches need (`gates.stream.passes`: at most `STREAMED_STATES_BYTES` each, a larger batch alone)."""
    cfg = plan.base_config
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    itemsize = DTYPES[gate_dtype(gating)].itemsize
    worst, held, passes = 0, STREAMED_STATES_BYTES + 1, 0
    sample = kmeans_sample_budget(len(plan.expert_names), plan.num_layers, hidden)
    for batch, tokens in batch_shapes(gating, sample):
        need = streamed_batch_bytes(batch, tokens, hidden, head_dim, itemsize)
        if held + need > STREAMED_STATES_BYTES:
            held, passes = 0, passes + 1
        held += need
        worst = max(worst, held)
    return worst, passes


def activation_bytes(plan: Plan, gating: GateParams) -> int:
    """Activations of the largest batch inside one layer: per token about 3 × intermediate + 6 × hidden values
    (the MLP's activation, up projection and their product live at once; residual, norm, attention), read off
    measured runs (a SmolLM2-135M shape in fp32; Llama-3-70B-shaped layers in fp32 and bf16,
    scripts/bench_stream_70b.py). k-means also keeps its sampled tokens."""
    cfg = plan.base_config
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, plan.num_layers
    batch, tokens = batch_shape(gating)
    acts = batch * tokens * (3 * inter + 6 * hidden) * DTYPES[gate_dtype(gating)].itemsize
    if gating.mode == "kmeans":  # the sampled calibration tokens, fp32 per layer (hidden_gates' budget)
        acts += kmeans_sample_budget(len(plan.expert_names), layers, hidden) * 4 * layers * hidden
    return acts


# ---------------------------------------------------------------------------------------------
# Writing


def writing_peak(plan: Plan, sources: dict[str, Checkpoint], policy: str) -> int:
    """Largest private memory the executor holds while making one output tensor (`execute.iter_tensors`).

    While a tensor is made, the previous one is still referenced (by the writer loop), so its private
    bytes count too. Untransformed slots of the output dtype are views of the mapped input (0 bytes).
    """
    worst = previous = 0
    last_source = None
    for step in plan.steps:
        held, out = step_bytes(step, sources, policy)
        if step.source is not None and step.source == last_source and previous == out and not step.transforms:
            previous = 0  # a shared slot: the previous tensor *is* this one (the cached cast)
        worst = max(worst, held + previous)
        previous, last_source = out, step.source
    return worst


def step_bytes(step: Step, sources: dict[str, Checkpoint], policy: str) -> tuple[int, int]:
    """(peak private bytes while making `step`, private bytes of the tensor handed to the writer)."""
    if step.kind in ("router", "shared_gate"):
        return step.nbytes, step.nbytes
    if step.kind in ("zeros", "half_gate"):
        return step.nbytes, step.nbytes
    if step.kind == "average":  # fp32 running sum + one part as fp32 + the mean + its cast
        fp32 = math.prod(step.shape) * 4
        return 3 * fp32 + step.nbytes, step.nbytes
    if step.parts and step.part_dim == 0:  # streamed one part at a time
        return max(leaf_bytes(p, sources, policy)[0] for p in step.parts), 0
    if step.parts:  # torch.cat of the parts
        outs = sum(leaf_bytes(p, sources, policy)[1] for p in step.parts)
        return outs + step.nbytes, step.nbytes
    return leaf_bytes(step, sources, policy)


def leaf_bytes(step: Step, sources: dict[str, Checkpoint], policy: str) -> tuple[int, int]:
    """(peak, output) private bytes of one slot read from a source (`execute.iter_tensors`' ``slot``)."""
    info = sources[step.source[0]].tensors[step.source[1]]
    # `Checkpoint.read` maps safetensors data (and torch.load(mmap=True) maps .bin); it copies only a
    # safetensors tensor whose offset is unknown or not a multiple of its element size
    copied = info.file.endswith(".safetensors") and (info.offset < 0 or info.offset % info.dtype.itemsize)
    read = info.nbytes if copied else 0
    source = sources[step.source[0]]
    # a LoRA-adapted tensor (`lora.Adapter.merge`) is a new tensor: made from an fp32 copy of W,
    # the fp32 delta and their fp32 sum (transient), then cast to W's dtype (kept)
    merging = source.adapter is not None and source.adapter.changes(step.source[1])
    if merging:
        read = info.nbytes
    cast = math.prod(info.shape) * step.dtype.itemsize if info.dtype != step.dtype else 0
    cached = read + cast  # the source tensor in the output dtype, kept until its last slot
    merge = 12 * math.prod(info.shape) if merging else 0  # transient, before `cached` exists
    if step.transforms:
        work = transform_bytes(step, math.prod(info.shape))
        return cached + max(work, merge), step.nbytes
    if policy == "clone" and step.kind in ("expert", "shared"):
        return cached + max(step.nbytes, merge), step.nbytes
    return cached + merge, cached


def transform_bytes(step: Step, n: int) -> int:
    """Peak fp32 working memory of `execute.apply_transforms` on a slot of `n` source elements.

    One fp32 copy of the slot; then per transform: noise draws one fp32 tensor beside it (scaled
    and added in place: 2 copies live); drop draws ``ratio`` of the neurons (1 + ratio); slice
    keeps the 1/g part beside the whole; scale is in place. At the end the fp32 result and its
    cast to the output dtype.
    """
    fp32 = 4 * n
    peak = size = fp32
    for name, value in step.transforms:
        if name in ("noise", "rel_noise"):
            peak = max(peak, 2 * size)
        elif name == "drop":
            peak = max(peak, size + size * float(value.ratio))
        elif name == "slice":
            size //= int(value.granularity)
            peak = max(peak, size * (int(value.granularity) + 1))
    return int(max(peak, size + step.nbytes))


# ---------------------------------------------------------------------------------------------
# Init drift


def drift_phase(plan: Plan, checking: CheckParams, base: Checkpoint) -> Optional[tuple[int, int]]:
    """(private, mapped-file bytes) of the init-drift report, or None when the build skips it
    (`CheckParams.measures_drift`, the rule `check.drift.build_drift` follows).

    Both models are loaded in fp32 and run once on the drift text: weights + activations + the two
    logit matrices (T × vocab, fp32, and their log-softmax). transformers 5 converts per-expert
    tensors into its fused layout while loading, and holds both forms at its peak, so the expert
    weights count twice (measured: SmolLM2-135M ×4, noise)."""
    if base.path is None or not checking.measures_drift(plan.total_bytes):
        return None
    cfg = plan.base_config
    dense = sum(math.prod(t.shape) for t in base.tensors.values())
    moe = sum(math.prod(s.shape) for s in plan.steps if not (plan.tied_embeddings and s.name == "lm_head.weight"))
    experts = sum(math.prod(s.shape) for s in plan.steps if s.kind == "expert")
    tokens, vocab = len(checking.drift_text.encode()), cfg.vocab_size  # UTF-8 bytes: at least its tokens
    acts = tokens * (4 * cfg.intermediate_size + 6 * cfg.hidden_size) * 4 + 4 * tokens * vocab * 4
    private = RUNTIME_BYTES + TRANSFORMERS_BYTES + 4 * (dense + moe + experts) + acts
    files = RUNTIME_FILE_BYTES + TRANSFORMERS_FILE_BYTES + sum(t.nbytes for t in base.tensors.values()) + plan.total_bytes
    return private, files
