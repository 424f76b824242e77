"""Upcycle a loaded dense `transformers` model into an in-memory MoE model, for training scripts.

`upcycle_model(dense_model, num_experts=8, ...)` runs the same machinery as a build — config
validation, `plan.make_plan`, `gates.compute_gates`, `execute.iter_tensors` with the `inits`
transforms — but reads tensors from the model's state dict and places them into a freshly built
``MixtralForCausalLM`` instead of writing files. Every output parameter gets its own storage:
nothing aliases the dense model or another expert, so training one expert never moves another.

The MoE is built where the dense model is: same dtype, each parameter on the device of the dense
module it comes from (a model on a GPU stays there; one spread by accelerate's ``device_map`` is
spread and dispatched the same way, see `placement`), and every random draw is made on that
device with a generator seeded per (seed, tensor). The same seed gives the same experts on every
run on one device type (on CUDA: one GPU model); CPU and CUDA generators differ, so a CUDA model
gets other (equally distributed) random neurons and routers than a CPU one. ``copy`` and
unshuffled ``split`` involve no randomness in the experts and are identical everywhere. Its config carries the
``experts_implementation`` that `planning.model_config.experts_implementation_for` picks for its shapes (in its dtype and in bf16, as
fp32 master weights are often cast before saving), so ``save_pretrained`` → ``from_pretrained``
runs the same kernel.

A dense model sharded with FSDP2's ``fully_shard`` (its parameters DTensors: FSDP or HSDP) gives an MoE sharded the
same way, each rank making only its own shards (`moe_upcycle.distributed`, docs/fsdp.md); tensor parallelism is
refused with what to do instead.

It does not load or save checkpoints (use `build.upcycle` for files), and it holds the whole MoE
in memory (that is its purpose; sharded: each rank its part). Prompt-based gate modes need a tokenizer and files, so only
``random``, ``uniform_random`` and ``uniform`` are offered here.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from moe_upcycle.recipe.resolve import gate_params, router_fields
from moe_upcycle.recipe.schema import ExpertInit, load_config
from moe_upcycle.errors import ConfigError
from moe_upcycle.planning.execute import iter_tensors
from moe_upcycle.gates.router import compute_gates
from moe_upcycle.planning.model_config import moe_config
from moe_upcycle.planning.guards import check_tied_head, refuse_non_float
from moe_upcycle.planning.plan import Plan, make_plan
from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.dense_config import dense_config
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.checkpoint.headers import TensorInfo
from moe_upcycle.checkpoint.writer import TensorParts
from moe_upcycle.checkpoint.placement import DensePlacement, dense_placement, dispatch_like, move_buffers
from moe_upcycle.planning.model_config import experts_implementation_for
from moe_upcycle.distributed.fsdp_layout import fsdp_layout
from moe_upcycle.distributed.local_fill import ShardedSource
from moe_upcycle.distributed.sharded_model import build_sharded_moe

IN_MEMORY_REF = "<in-memory dense model>"
GATE_MODES = ("random", "uniform_random", "uniform")
_FUSED_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<w>w[123]|gate_proj|up_proj|down_proj)\.weight$")
_PROJ_AS_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # Qwen MoE names -> Mixtral's


@dataclass
class StateDictSource(Checkpoint):
    """A `Checkpoint` whose tensors come from an in-memory state dict instead of files."""

    state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def read(self, key: str) -> torch.Tensor:
        return self.state[key].detach()


def state_dict_source(model: torch.nn.Module) -> StateDictSource:
    """Wrap a dense transformers model (Llama, Mistral) as a plan source, without copying tensors."""
    state = model.state_dict()
    config = model.config.to_dict()
    # the weights' real dtype wins over whatever config.json said when the model was saved
    config["dtype"] = str(model_dtype(model)).removeprefix("torch.")
    config.pop("torch_dtype", None)
    infos = {k: TensorInfo(k, tuple(t.shape), t.dtype, "") for k, t in state.items()}
    # checked as a config.json is: a field set by hand (model.config.head_dim = "64") is named, not a traceback;
    # a family no output takes is named as such first (a GPT-2 config has none of the fields checked)
    names.input_family(config.get("model_type", ""), "dense_model")
    return StateDictSource(ref=IN_MEMORY_REF, path=None, config=dense_config(config, "dense_model.config"),
                           tensors=infos, state=state)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of most of `model`'s floating-point parameters (by element count).

    A model is not always of one dtype: peft's ``prepare_model_for_kbit_training`` and many training scripts keep
    norms or the head in float32 beside bfloat16 weights; the first parameter's dtype would then decide by accident.
    """
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _dtype_warnings(dense_model: torch.nn.Module, dtype: Optional[str]) -> None:
    """Say which dtype the MoE gets when the dense model mixes dtypes (and `dtype` does not choose), and refuse
    float64, which no MoE output takes."""
    import warnings

    from moe_upcycle.errors import UpcycleWarning

    chosen = model_dtype(dense_model)
    if dtype is None and chosen == torch.float64:
        raise ConfigError("dense_model: its parameters are float64, which upcycle_model does not make; pass "
                          "dtype=\"float32\" (or convert the model first: model.float())")
    others: dict[torch.dtype, str] = {}
    for name, param in dense_model.named_parameters():
        if param.is_floating_point() and param.dtype != chosen:
            others.setdefault(param.dtype, name)
    if others and dtype is None:
        shown = ", ".join(f"{str(d).removeprefix('torch.')} (e.g. {n})" for d, n in others.items())
        warnings.warn(UpcycleWarning(
            f"dense_model holds parameters of several dtypes: most are {str(chosen).removeprefix('torch.')}, some "
            f"{shown}; the MoE is {str(chosen).removeprefix('torch.')} throughout — pass dtype= to choose"),
            stacklevel=3)


def _python_values(**given: Any) -> None:
    """Refuse None for an argument that has no None meaning, and a non-bool flag, in Python's words (the recipe's
    messages speak YAML: "nothing after 'seed:'", "write true or false")."""
    defaults = {name: p.default for name, p in inspect.signature(upcycle_model).parameters.items()}
    for name, value in given.items():
        if value is None:
            raise ConfigError(f"upcycle_model: {name}=None is not a value it takes; pass {defaults[name]!r} (its "
                              f"default), or leave the argument out")
    flag = given.get("output_router_logits")
    if not isinstance(flag, bool):
        raise ConfigError(f"upcycle_model: output_router_logits={flag!r} is not a bool; pass True or False")


def refuse_unused_parameters(plan: Plan, dense_model: torch.nn.Module) -> None:
    """Refuse a dense model whose forward uses a parameter the MoE has no place for (``lm_head.bias`` added to a
    Llama): from files a loader drops it too, but this model computes with it, so the MoE would not."""
    used = [key for key in plan.not_copied if key in dict(dense_model.named_parameters())]
    if used:
        shown = ", ".join(repr(k) for k in used[:5]) + (f" and {len(used) - 5} more" if len(used) > 5 else "")
        raise ConfigError(f"dense_model: parameter(s) {shown} have no place in a {plan.architecture} model, so the "
                          f"MoE would compute other logits than dense_model; remove them from the model (or fold "
                          f"them into a tensor it keeps) before upcycling")


def check_installed_runtime(plan: Plan) -> None:
    """Refuse, or warn, when the installed transformers (4.x) cannot make or run this MoE exactly: the in-memory
    model is that runtime's class (`runtimes`' transformers 4.x verdict, measured on 4.57)."""
    import warnings

    import transformers

    from moe_upcycle.errors import UpcycleWarning
    from moe_upcycle.planning.runtimes import NO_LOAD, RUNS, compatibility

    installed = transformers.__version__
    if int(installed.split(".")[0]) >= 5:
        return
    verdict = next(v for v in compatibility(plan) if v.runtime == "transformers 4.x")
    where = f"transformers {installed} (installed here) and its {names.output_layout(plan.architecture).class_name}"
    if verdict.status == NO_LOAD:
        raise ConfigError(f"architecture: {plan.architecture} cannot hold this dense model in {where}: {verdict.why}; "
                          f"install transformers>=5, or pass another architecture=")
    if verdict.status == RUNS:
        warnings.warn(UpcycleWarning(f"{where} run this MoE, but not as the dense model computes: {verdict.why}; "
                                     f"transformers>=5 runs it exactly"), stacklevel=3)


def warn_inexact(plan: Plan) -> None:
    """Warn, as an `UpcycleWarning`, each reason the MoE will not start as the dense model (`Plan.inexact`; a
    file build prints them as notes)."""
    import warnings

    from moe_upcycle.errors import UpcycleWarning

    for caution in plan.inexact:
        warnings.warn(UpcycleWarning(caution), stacklevel=3)  # at the caller of upcycle_model


def upcycle_model(
    dense_model: torch.nn.Module,
    num_experts: int = 8,
    experts_per_token: int = 2,
    expert_init: Union[str, dict, ExpertInit] = "copy",
    gate: str = "random",
    *,
    seed: int = 0,
    router_init_std: float = 0.02,
    router_jitter_noise: float = 0.0,
    router_aux_loss_coef: Optional[float] = None,
    output_router_logits: bool = False,
    dtype: Union[str, torch.dtype, None] = None,
    architecture: Optional[str] = None,
    moe_layers: Union[Sequence[int], dict, None] = None,
) -> torch.nn.Module:
    """Turn a dense model into an MoE model in memory (Mixtral by default), ready for continued training.

    Args:
        dense_model: a loaded ``LlamaForCausalLM`` / ``MistralForCausalLM`` / Qwen2 / Qwen3 (left
            untouched), on any device(s), or sharded with FSDP2's ``fully_shard`` (then call this on every rank).
        num_experts: routed experts per layer.
        experts_per_token: top-k.
        expert_init: "copy", or a mapping such as ``{"method": "drop", "ratio": 0.5}`` (the YAML
            ``expert_init:`` key).
        gate: router init: "random" (std `router_init_std`), "uniform_random" or "uniform".
        seed: seeds routers and every random init.
        router_init_std: std of the random router rows.
        router_jitter_noise, router_aux_loss_coef: MoE training knobs written into the model's config.
        output_router_logits: return router logits and add the load-balancing aux loss to ``loss`` in the
            forward passes that train (model in training mode, gradients on), as transformers' own
            ``output_router_logits`` does. It is passed to those calls, not written into the config:
            ``config.output_router_logits`` stays False, so ``save_pretrained`` publishes a model whose
            ``generate`` works (with the field true, transformers computes the aux loss at every
            decoding step, and a batch of prompts of different lengths fails).
        dtype: "float32", "bfloat16" or "float16" (or the torch.dtype); default (or "auto"): the dense model's parameter dtype.
        architecture: the output architecture ("mixtral", "qwen2_moe", "qwen3_moe"...); default:
            the one a build picks for the dense family.
        moe_layers: which layers become MoE layers, as the recipe's ``moe_layers:`` — a list such as
            ``[1, 3, 5]`` or ``{"every": 2}`` (layers 1, 3, 5, ...); the others keep the dense MLP (a
            Qwen-MoE output: a Llama or Mistral becomes ``qwen2_moe``). Default: every layer.

    Returns:
        A ``MixtralForCausalLM`` (or the `architecture`'s class) in training mode whose every
        parameter has its own storage, on the dense model's device(s); for a sharded dense model, sharded
        the same way (same mesh, placements and FSDP settings).

    Raises:
        ConfigError: an invalid option (reported with the option's name), a `dense_model` that is
            not a loaded transformers causal LM, one whose weights are offloaded (on the meta device), or one
            spread with tensor parallelism.
        PlanError: the dense model cannot be upcycled (e.g. an unsupported architecture).

    Example:
        >>> moe = upcycle_model(dense, num_experts=8, experts_per_token=2,
        ...                     expert_init={"method": "drop", "ratio": 0.5})  # doctest: +SKIP
    """
    if isinstance(dense_model, torch.nn.Module) and isinstance(getattr(dense_model, "_orig_mod", None), torch.nn.Module):
        dense_model = dense_model._orig_mod  # torch.compile's wrapper: the model itself holds the weights
    check_dense_model(dense_model)
    if not isinstance(gate, str) or gate not in GATE_MODES:
        raise ConfigError(f"gate: {gate!r} is not available in memory; use one of {', '.join(GATE_MODES)} "
                          f"(prompt-based modes need model files: use moe_upcycle.upcycle)")
    if isinstance(expert_init, ExpertInit):
        expert_init = expert_init.model_dump(exclude_unset=True)
    if isinstance(dtype, torch.dtype):  # torch.bfloat16 as well as "bfloat16"
        dtype = str(dtype).removeprefix("torch.")
    if dtype == "auto":  # from_pretrained's word for "as stored": here, the dense model's dtype
        dtype = None
    _python_values(num_experts=num_experts, experts_per_token=experts_per_token, expert_init=expert_init, seed=seed,
                   router_init_std=router_init_std, router_jitter_noise=router_jitter_noise,
                   output_router_logits=output_router_logits)
    # output_router_logits is this call's training switch, never the recipe's: a recipe's would be written into
    # config.json, which the recipe refuses (see `router_logits_while_training`)
    _dtype_warnings(dense_model, dtype)
    config = load_config({
        "base_model": IN_MEMORY_REF, "num_experts": num_experts, "experts_per_token": experts_per_token,
        "expert_init": expert_init, "gate_mode": gate, "seed": seed, "router_init_std": router_init_std,
        "router_jitter_noise": router_jitter_noise, "router_aux_loss_coef": router_aux_loss_coef, "dtype": dtype,
        **({"architecture": architecture} if architecture else {}),
        **({"moe_layers": moe_layers} if moe_layers is not None else {}),
    }, unknown_option=None, name="upcycle_model")
    # called under torch.inference_mode, the MoE's parameters and buffers would be inference tensors,
    # which autograd refuses: the model could never be trained. It is built as ordinary tensors.
    with torch.inference_mode(False):
        layout = fsdp_layout(dense_model)  # None unless sharded with FSDP2 (DTensors): then so is the MoE
        placement = dense_placement(dense_model)
        source = state_dict_source(dense_model)
        if layout is not None:
            source = ShardedSource.of(source, source.state)
        sources = {IN_MEMORY_REF: source}
        plan = make_plan(config, sources)
        refuse_unused_parameters(plan, dense_model)  # a head bias the MoE has no place for
        warn_inexact(plan)  # a split whose top-k cannot hold whole groups, ties deciding uniform gates
        check_installed_runtime(plan)  # the MoE is made by, and runs in, the transformers installed here
        refuse_non_float(plan, sources)  # an integer parameter would be copied into float experts as numbers
        check_tied_head(plan, source, IN_MEMORY_REF)  # a head untied in memory under a config that ties it
        gates = compute_gates(gate_params(config), plan, source, device=placement.main)
        router = router_fields(config)
        cfg = moe_config(plan, router.aux_loss_coef, router.jitter_noise)  # output_router_logits: false
        model = empty_moe_model(cfg, plan, getattr(dense_model.config, "_attn_implementation", None))
        if layout is not None:  # each rank makes its own shards (moe_upcycle.distributed)
            build_sharded_moe(model, plan, source, gates, config.seed, layout, _place)
        else:
            fill_model(model, plan, iter_tensors(plan, sources, gates, "clone", config.seed), placement)
            move_buffers(model, placement)
        keep_frozen(model, plan, dense_model)
        keep_checkpointing(model, dense_model)
        keep_generation_config(model, dense_model)
        model = model if layout is not None else dispatch_like(model, placement)
        if output_router_logits:
            router_logits_while_training(model)
        return model.train()


def router_logits_while_training(model: torch.nn.Module) -> None:
    """Make `model` return router logits (and add the aux loss to its loss) in training forward passes only.

    transformers' MoE classes read ``output_router_logits`` from each call, else from the config. In the
    config it is published by ``save_pretrained`` and read at inference too: transformers then computes the
    aux loss at every decoding step of ``generate``, against an attention mask of the whole sequence, and a
    batch of prompts of different lengths fails ("The size of tensor a (2) must match the size of tensor b
    (16)"; transformers 4.57 fails on any prompt). So the switch is a forward pre-hook: a call made in
    training mode with gradients on gets ``output_router_logits=True`` unless it passes its own; ``eval()``,
    ``torch.no_grad()`` and ``generate`` (which runs without gradients) get the config's false. The hook is
    part of this model object only: ``save_pretrained`` writes false and a reloaded model has no hook.
    """
    import functools

    names = list(inspect.signature(model.forward).parameters)
    position = names.index("output_router_logits") if "output_router_logits" in names else len(names)
    model.register_forward_pre_hook(functools.partial(_ask_router_logits, position=position), with_kwargs=True)


def _ask_router_logits(module: torch.nn.Module, args: tuple, kwargs: dict, *, position: int):
    """The hook of `router_logits_while_training` (module level, so the model stays picklable and deep-copyable)."""
    if module.training and torch.is_grad_enabled() and "output_router_logits" not in kwargs and len(args) <= position:
        return args, {**kwargs, "output_router_logits": True}
    return None


def keep_generation_config(model: torch.nn.Module, dense_model: torch.nn.Module) -> None:
    """Give the MoE a copy of the dense model's generation config (its ``generation_config.json``: the stop
    tokens of a chat model, its sampling defaults), which ``generate`` uses and ``save_pretrained`` writes.

    Without it the MoE gets one derived from config.json: a Llama-3 Instruct MoE would not stop at
    ``<|eot_id|>`` and would forget the model's own temperature and top_p.
    """
    dense_generation = getattr(dense_model, "generation_config", None)
    if dense_generation is not None and hasattr(model, "generation_config"):
        model.generation_config = copy.deepcopy(dense_generation)


def keep_checkpointing(model: torch.nn.Module, dense_model: torch.nn.Module) -> None:
    """Turn activation (gradient) checkpointing on in the MoE when the dense model had it on.

    transformers 5 names it activation checkpointing (the gradient_ names warn), 4.x gradient checkpointing.
    """
    five = hasattr(dense_model, "is_activation_checkpointing")
    if getattr(dense_model, "is_activation_checkpointing" if five else "is_gradient_checkpointing", False):
        getattr(model, "activation_checkpointing_enable" if five else "gradient_checkpointing_enable")()


def keep_frozen(model: torch.nn.Module, plan: Plan, dense_model: torch.nn.Module) -> None:
    """Freeze each MoE parameter whose every source the dense model has frozen (``requires_grad=False``).

    A researcher who froze the embeddings (or attention, or the FFNs) gets them frozen in the MoE too;
    a parameter fed by any trainable source, and every router (new), stays trainable. One fed by frozen and
    trainable sources alike (transformers 5's fused ``gate_up_proj`` of a layer whose ``gate_proj`` alone was
    frozen) cannot be half frozen: it trains, and an `UpcycleWarning` names it and the sources.
    """
    from moe_upcycle.errors import UpcycleWarning

    trainable = {name: p.requires_grad for name, p in dense_model.named_parameters(remove_duplicate=False)}
    if all(trainable.values()):
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    feeds: dict[str, dict[str, bool]] = {}  # MoE parameter -> {dense source: trainable}
    for step in plan.steps:
        leaves = step.parts or (step,)
        target, _ = _place(step.name, params)
        for leaf in leaves:
            name = leaf.source[1] if leaf.source else f"(new) {leaf.name}"
            feeds.setdefault(target, {})[name] = trainable.get(name, True) if leaf.source else True
    mixed = []
    for target, flags in feeds.items():
        if not any(flags.values()):
            params[target].requires_grad_(False)
        elif not all(flags.values()):
            frozen = sorted(n for n, t in flags.items() if not t)
            mixed.append(f"{target} (from {', '.join(frozen)}, frozen, and "
                         f"{', '.join(sorted(n for n, t in flags.items() if t))}, not)")
    if mixed:
        shown = "; ".join(mixed[:3]) + (f"; and {len(mixed) - 3} more" if len(mixed) > 3 else "")
        warnings.warn(UpcycleWarning(
            f"{len(mixed)} MoE parameter(s) hold frozen and trainable dense weights together, and one parameter "
            f"cannot be half frozen, so they train: {shown}. Freeze or unfreeze the whole FFN of those layers "
            f"before upcycling, or set requires_grad on the MoE's parameters after it"), stacklevel=3)


def _peft_types(model: Any) -> str:
    """The adapter types of a PeftModel ("PROMPT_TUNING"), for messages."""
    configs = getattr(model, "peft_config", None)
    kinds = {str(getattr(getattr(c, "peft_type", None), "value", getattr(c, "peft_type", "?")))
             for c in (configs.values() if isinstance(configs, dict) else ())}
    return ", ".join(sorted(kinds)) or "unknown"


def check_dense_model(dense_model: Any) -> None:
    """Refuse what is not a loaded transformers causal LM, naming the argument.

    Raises:
        ConfigError: `dense_model` is not a ``torch.nn.Module`` with a transformers config (a path,
            None, a bare module), is the decoder without its LM head (``LlamaModel``), or carries PEFT
            adapter layers (a ``PeftModel``, or transformers' ``add_adapter``) whose weights are not merged.
    """
    from transformers import PretrainedConfig

    kind = type(dense_model).__name__
    wrapped = getattr(dense_model, "module", None)
    if isinstance(dense_model, torch.nn.Module) and isinstance(getattr(wrapped, "config", None), PretrainedConfig):
        # DistributedDataParallel, DataParallel (and accelerate's wrapping of them): unwrapping here would hand
        # back a bare MoE that a distributed script might train without gradient sync
        raise ConfigError(f"dense_model: a {kind} wrapper; pass the model it wraps (model.module, or accelerate's "
                          f"accelerator.unwrap_model(model)), then wrap the returned MoE again and make the optimizer "
                          f"for its parameters: the MoE's parameters are all new")
    if not isinstance(dense_model, torch.nn.Module) or not isinstance(getattr(dense_model, "config", None),
                                                                       PretrainedConfig):
        hint = (" (a path: load it first with AutoModelForCausalLM.from_pretrained, or build files with "
                "moe_upcycle.upcycle)" if isinstance(dense_model, (str, bytes)) or hasattr(dense_model, "__fspath__")
                else "")
        raise ConfigError(f"dense_model: expected a loaded transformers model, not {kind}{hint}; pass e.g. "
                          f"AutoModelForCausalLM.from_pretrained(...)")
    params = [name for name, _ in dense_model.named_parameters()]
    adapted = next((n for n in params if ".lora_" in n), None) or next((n for n in params if ".base_layer." in n), None)
    if adapted is not None:  # a PeftModel, or transformers' add_adapter: the weights are not where a plan looks
        raise ConfigError(f"dense_model: a {kind} carrying PEFT adapter layers (parameter {adapted!r}); merge the "
                          f"adapter into the weights first (peft: model = peft_model.merge_and_unload(), which "
                          f"changes the model in place) or pass the model without it")
    if hasattr(dense_model, "peft_config") and hasattr(dense_model, "get_base_model"):  # prompt tuning, prefix...
        raise ConfigError(f"dense_model: a {kind} wrapper whose adapter ({_peft_types(dense_model)}) adds no weights "
                          f"an MoE could hold; pass the model it wraps (peft_model.get_base_model()), and add the "
                          f"adapter to the MoE afterwards if you want it")
    layers = getattr(getattr(dense_model, "model", None), "layers", None)
    depth = getattr(dense_model.config, "num_hidden_layers", None)
    if isinstance(layers, torch.nn.ModuleList) and isinstance(depth, int) and len(layers) != depth:
        raise ConfigError(f"dense_model: config.num_hidden_layers is {depth} but the model has {len(layers)} layers "
                          f"(model.model.layers); after adding or removing layers set "
                          f"model.config.num_hidden_layers = len(model.model.layers) (and layer_types, if the config "
                          f"has it), so the MoE gets the layers the model has")
    types = getattr(dense_model.config, "layer_types", None)
    if isinstance(layers, torch.nn.ModuleList) and isinstance(types, (list, tuple)) and len(types) != len(layers):
        raise ConfigError(f"dense_model: config.layer_types lists {len(types)} layers but the model has {len(layers)} "
                          f"(model.model.layers); after adding or removing layers set model.config.layer_types to "
                          f"the types of the layers it has, in order (e.g. [t for i, t in "
                          f"enumerate(model.config.layer_types) if i not in removed])")
    head = dense_model.get_output_embeddings() if hasattr(dense_model, "get_output_embeddings") else None
    if head is None:  # LlamaModel, the decoder alone (an unsupported family with a head gets the plan's message)
        what = ("a ...Model is the decoder alone" if kind.endswith("Model") else
                f"{kind} ends in a task head, not the language-model head an MoE needs")
        raise ConfigError(f"dense_model: a {kind} is not a causal language model (no LM head: {what}); pass the "
                          f"...ForCausalLM, e.g. AutoModelForCausalLM.from_pretrained(...)")


# config.json fields transformers 4.x reads that transformers 5 does not write (see `keep_legacy_fields`)
LEGACY_FIELDS = ("rope_theta", "rope_scaling", "original_max_position_embeddings", "num_experts")


def empty_moe_model(cfg: dict, plan: Plan, attn_implementation: Optional[str] = None) -> torch.nn.Module:
    """A MoE model from its config.json dict, with parameters on the meta device (buffers real).

    `attn_implementation` is the dense model's (``eager``, ``sdpa``, ``flash_attention_2``...): the MoE
    computes attention the way the dense model the caller loaded does (else transformers' default).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    # a deep copy: transformers 5 standardises the rope dict it is given in place (adding rope_type and
    # rope_theta next to our `type`), and `keep_legacy_fields` must save cfg's rope_scaling as written
    kwargs = copy.deepcopy({k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype",
                                                                       "dtype")})
    hf_config = AutoConfig.for_model(cfg["model_type"], **kwargs)
    # transformers' grouped_mm experts kernel needs 16-byte aligned rows; eager takes any size.
    # Checked for 2-byte dtypes too: fp32 master weights are often cast to bf16 before save_pretrained
    impl = cfg.get("experts_implementation") or experts_implementation_for(cfg, plan.dtype) \
        or experts_implementation_for(cfg, torch.bfloat16)
    # transformers 4.x has per-expert Linear layers and no such option (its from_config refuses the keyword)
    extra = {"experts_implementation": impl} if impl and hasattr(hf_config, "_experts_implementation") else {}
    if attn_implementation:
        extra["attn_implementation"] = attn_implementation
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=plan.dtype, **extra)
    if impl:
        # a plain config attribute is written by save_pretrained (the private one is not), and
        # from_pretrained reads it back: the reloaded model runs the kernel this one runs (in transformers 4.x
        # a field it ignores; a folder saved there and loaded in 5 still runs)
        model.config.experts_implementation = impl
    keep_legacy_fields(model.config, cfg)
    return model


def keep_legacy_fields(hf_config: Any, cfg: dict) -> None:
    """Make ``save_pretrained`` write the config.json fields a build writes for transformers 4.x.

    transformers 5 saves only its own names: ``rope_parameters`` without ``rope_theta`` /
    ``rope_scaling``, and Qwen3-MoE's expert count as ``num_local_experts``. 4.x reads neither, so a
    folder saved from the MoE loaded there with its class defaults (Mixtral's rope_theta 1e6,
    Qwen3-MoE's 128 experts): other logits, or a size mismatch. Fields of `cfg` that the config
    would not write go into its ``__dict__``, which ``save_pretrained`` writes as they are (setting
    them as attributes would go through transformers 5's aliases and rope setters instead).
    """
    written = hf_config.to_dict()
    for key in LEGACY_FIELDS:
        if key in cfg and key not in written:
            hf_config.__dict__[key] = cfg[key]


def fill_model(model: torch.nn.Module, plan: Plan, tensors, placement: Optional[DensePlacement] = None) -> None:
    """Place every planned tensor into `model`, each parameter in storage of its own.

    Each parameter is allocated on ``placement.device_for(name)`` (the CPU without a placement).

    Checkpoint names (``block_sparse_moe.experts.3.w1.weight``) are placed directly when the
    model has them (transformers 4.x), else into the fused 3-D expert parameters of
    transformers ≥ 5 (``mlp.experts.gate_up_proj[e] = cat(w1, w3)``, ``mlp.experts.down_proj[e] = w2``).

    Raises:
        RuntimeError: a planned tensor has no place in the model, or a parameter was left unset
            (a bug: the plan and the model class disagree).
    """
    params = dict(model.named_parameters())
    places = {step.name: _place(step.name, params) for step in plan.steps}
    # allocated before iterating: `iter_tensors` runs under inference_mode, and tensors made
    # there could never become trainable parameters
    fresh = {target: torch.empty(params[target].shape, dtype=plan.dtype,
                                 device=placement.device_for(target) if placement else "cpu")
             for target, _ in places.values()}
    filled = dict.fromkeys(fresh, 0)
    for step, tensor in tensors:
        target, index = places[step.name]
        view = fresh[target][index] if index is not None else fresh[target]
        if isinstance(tensor, TensorParts):  # a fused plan (Qwen3.5-MoE): the parts' bytes in order, one at a time
            flat, offset = view.view(-1), 0
            for part in tensor.parts:
                flat[offset:offset + part.numel()].copy_(part.reshape(-1))
                offset += part.numel()
            filled[target] += offset
            continue
        view.copy_(tensor)
        filled[target] += tensor.numel()
    for name, data in fresh.items():
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, torch.nn.Parameter(data))
    if plan.tied_embeddings:
        model.tie_weights()
    unset = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    partial = [n for n, count in filled.items() if count != fresh[n].numel()]
    if unset or partial:
        raise RuntimeError(f"in-memory upcycle left parameters unset {unset} or partly set {partial}; "
                           f"this is a bug: the plan and {type(model).__name__} disagree")


_RENAMED = ((".input_linear.weight", ".experts.gate_up_proj"), (".output_linear.weight", ".experts.down_proj"),
                  (".router.layer.weight", ".router.weight"),
                  (".mlp.moe_statics.e_score_correction_bias", ".mlp.gate.moe_statics.e_score_correction_bias"))


def _place(name: str, params: dict[str, Any]) -> tuple[str, Optional[tuple]]:
    """(parameter name, index into it) for one output tensor name."""
    if name in params:
        return name, None
    renamed = name.replace(".block_sparse_moe.", ".mlp.")
    if renamed in params:
        return renamed, None
    for old, new in _RENAMED:  # Granite-MoE and ERNIE-4.5-MoE checkpoint names as transformers 5 loads them
        if name.endswith(old) and name[:-len(old)] + new in params:
            return name[:-len(old)] + new, None
    m = _FUSED_EXPERT.match(renamed)
    if m:
        e, w, prefix = int(m["expert"]), _PROJ_AS_W.get(m["w"], m["w"]), m["prefix"]
        if w == "w2":
            return f"{prefix}.down_proj", (e,)
        gate_up = f"{prefix}.gate_up_proj"
        half = params[gate_up].shape[1] // 2
        return gate_up, (e, slice(0, half) if w == "w1" else slice(half, 2 * half))
    raise RuntimeError(f"output tensor {name} has no parameter in the in-memory model; this is a bug")
