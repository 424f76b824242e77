"""Choose the output MoE architecture for a base model, and the config.json fields it needs.

Which output can hold which dense tensors is data in `names` (`OutputLayout.holds`, its required
layer tensors, whether it has a shared expert); this module only reads that table. Given
`architecture:` it checks that one; otherwise it tries the base family's natural output first
(Llama/Mistral → Mixtral, Qwen2 → Qwen2-MoE, Qwen3 → Qwen3-MoE), then the others. When nothing
fits, the error says why for every candidate and what to use instead, e.g.::

    mixtral: the base has attention biases (self_attn.q_proj.bias), which Mixtral cannot hold
    → use architecture: qwen2_moe

It reads config.json and tensor names only; it plans and writes nothing.
"""

from __future__ import annotations

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.errors import PlanError
from moe_upcycle.planning import glm4, hybrid, router_statics, windows
from moe_upcycle.planning.steps import Plan
from moe_upcycle.recipe.resolved import resolved
from moe_upcycle.recipe.schema import UpcycleConfig

# mergekit-moe's names for outputs, mapped onto ours
ALIASES = {"qwen": "qwen2_moe", "qwen3_5_moe": "qwen3_5_moe_text"}  # and Qwen3.5-MoE's text model_type
# config.json fields an output derives from the plan beyond `config_fields`' own (dense prefix, shared count)
EXTRA_FIELDS = {"glm4_moe": glm4.config_fields}


def layer_suffixes(model: Checkpoint) -> list[str]:
    """Distinct per-layer tensor suffixes (after ``model.layers.{layer}.``), in file order."""
    found: dict[str, None] = {}
    for key in model.tensors:
        template, layer = names.split_layer(key)
        if layer is not None:
            found[template.removeprefix("model.layers.{layer}.")] = None
    return list(found)


def misfits(layout: names.OutputLayout, config: UpcycleConfig, base: Checkpoint) -> list[tuple[str, str]]:
    """Why `layout` cannot hold this build: a list of (reason, what the reason is about).

    The second item identifies the problem (a tensor suffix, or "shared_experts") so a
    suggestion can name the outputs that do not share it.
    """
    out: list[tuple[str, str]] = []
    suffixes = [s for s in layer_suffixes(base) if not s.endswith(("rotary_emb.inv_freq",))]
    order = list(names.TENSOR_GROUPS)  # name a group by its first member (q_proj before k_proj), not file order
    suffixes.sort(key=lambda s: order.index(s) if s in order else len(order))
    seen_groups: set[str] = set()
    projections = {f"mlp.{p}.weight" for p in names.PROJS}
    for suffix in suffixes:
        if suffix.startswith("mlp."):
            bias = suffix in {f"mlp.{p}.bias" for p in names.PROJS}
            group = "mlp-bias" if bias else "mlp-other"
            if suffix not in projections and group not in seen_groups:
                seen_groups.add(group)
                what = "MLP biases" if bias else "a tensor in its MLP that is not a projection's weight"
                out.append((f"the base has {what} ({names.shown(suffix)}), which {layout.label} experts cannot "
                            f"hold", suffix))
            continue
        if not layout.holds(suffix):
            group = names.TENSOR_GROUPS.get(suffix, "the tensor")
            if group not in seen_groups:
                seen_groups.add(group)
                out.append((f"the base has {group} ({names.shown(suffix)}), which {layout.label} cannot hold", suffix))
    if (family := hybrid.family_misfit(layout, base.model_type)) is not None:
        out.append((family, "family"))
    missing = [s for s in layout.layer_tensors if s not in suffixes]
    if missing:
        what = f"{names.TENSOR_GROUPS[missing[0]]} ({missing[0]})" if missing[0] in names.TENSOR_GROUPS else missing[0]
        out.append((f"the base has no {what}, which {layout.label} needs", "missing:" + missing[0]))
    per_layer = windows.dense_windows(base.config) if "num_hidden_layers" in base.config else []
    if len(set(per_layer)) > 1 and not layout.per_layer_windows:
        sliding = [i for i, w in enumerate(per_layer) if w]
        out.append((f"the base slides its attention window on {len(sliding)} of its {len(per_layer)} layers "
                    f"only (from layer {sliding[0]}), but {layout.label} applies one window to every layer",
                    "mixed-windows"))
    if config.shared_experts and not layout.shared_expert:
        out.append((f"{layout.label} has no shared expert, but shared_experts lists {len(config.shared_experts)}",
                    "shared_experts"))
    chosen, depth = resolved(config).moe_layers, int(base.config.get("num_hidden_layers") or 0)
    dense = chosen.dense_layers(depth) if depth and not chosen.problems(depth, "") else ()
    if dense and not layout.dense_mlp:
        out.append((f"{layout.label} makes every layer an MoE layer (it has no dense-MLP layers), but moe_layers: "
                    f"{chosen.text()} keeps {len(dense)} of the {depth} layers dense ({_listed(dense)})", "moe_layers"))
    out += glm4.misfits(layout, config, tuple(dense), chosen.text())
    if config.norm_topk_prob is False and "norm_topk_prob" not in layout.config:
        out.append((f"{layout.label} always renormalises the top-k router weights (it has no norm_topk_prob), but "
                    f"norm_topk_prob: false is set", "norm_topk_prob"))
    return out


def _listed(layers: tuple[int, ...], limit: int = 12) -> str:
    shown = ", ".join(map(str, layers[:limit]))
    return shown + (f" and {len(layers) - limit} more" if len(layers) > limit else "")


def choice_notes(config: UpcycleConfig, base: Checkpoint, layout: names.OutputLayout) -> list[str]:
    """Say why a build without `architecture:` is not written as its family's natural output, when a setting of
    this feature's (``moe_layers`` keeping dense layers, ``norm_topk_prob: false``) is what Mixtral cannot hold."""
    family = names.INPUT_FAMILIES.get(base.model_type)
    if config.architecture or family is None or layout.model_type == family.default_output:
        return []
    natural = names.OUTPUT_LAYOUTS[family.default_output]
    reasons = [text for text, key in misfits(natural, config, base) if key in ("moe_layers", "norm_topk_prob")]
    if not reasons:
        return []
    return [f"{natural.model_type}: {reasons[0]}, so this {base.model_type} build is written as {layout.model_type}; "
            f"add architecture: {layout.model_type} to the recipe to make the choice explicit"]


def choose_layout(config: UpcycleConfig, base: Checkpoint) -> names.OutputLayout:
    """The output layout for this build: `architecture:` if given and it fits, else the first that fits.

    Raises:
        PlanError: the named architecture cannot hold the base (every reason), or none can
            (every candidate with its reasons and a suggestion).
    """
    where = f"base_model ({config.base_model})"
    family = names.input_family(base.model_type, where)
    if base.path is not None and not layer_suffixes(base):
        raise PlanError(_no_layers(where, base, family))
    if config.architecture == "deepseek":
        raise PlanError(deepseek_refusal(config, family.default_output))
    if config.architecture:
        name = ALIASES.get(config.architecture, config.architecture)
        if config.architecture == "qwen" and base.model_type == "qwen3" and not config.shared_experts:
            name = "qwen3_moe"  # mergekit's "qwen" is whichever Qwen output fits: Qwen3 MoE for Qwen3 models
        layout = names.output_layout(name)
        reasons = misfits(layout, config, base)
        # mergekit's "qwen" names two outputs: say which one it was read as
        label = name if config.architecture == name else f"{config.architecture} (read as {name})"
        if reasons:
            raise PlanError(*[f"architecture: {label}: {text}{_suggest(config, base, key, name)}"
                              for text, key in reasons])
        return layout
    order = [family.default_output] + [n for n, lay in names.OUTPUT_LAYOUTS.items()
                                       if n != family.default_output and lay.automatic
                                       and not hybrid.family_misfit(lay, base.model_type)]
    report = []
    for name in order:
        reasons = misfits(names.OUTPUT_LAYOUTS[name], config, base)
        if not reasons:
            return names.OUTPUT_LAYOUTS[name]
        report += [f"{name}: {text}{_suggest(config, base, key, name)}" for text, key in reasons]
    raise PlanError(f"{where}: no output architecture can hold this {family.class_name} "
                    f"(tried {', '.join(order)}):", *report)


def mergekit_choice_notes(config: UpcycleConfig, base: Checkpoint, layout: names.OutputLayout) -> list[str]:
    """Say so when mergekit-moe 0.1.5 would write another output for the same config, or refuse it.

    Without `architecture:`, mergekit picks DeepSeek MoE for Llama/Mistral experts with a shared
    expert that has no prompts (its Qwen MoE needs prompted shared experts); we write what
    transformers loads natively. Experts that are all one model, unchanged, with routers built from
    prompts, mergekit refuses without a flag; we build them (upcycling is what the tool is for) and
    say what the routers then do.
    """
    notes = _identical_experts_note(config) + _window_note(base, layout)
    if config.architecture or not config.shared_experts or base.model_type not in ("llama", "mistral"):
        return notes
    if any(e.positive_prompts or e.positive_prompts_from for e in config.shared_experts):
        return notes  # mergekit picks its Qwen MoE, as we do
    return notes + [
        f"mergekit-moe 0.1.5 writes DeepSeek MoE for {base.model_type} experts with an unprompted shared expert "
        f"(loadable only with trust_remote_code); this build writes {layout.model_type}, which transformers "
        f"loads natively — add architecture: {layout.model_type} to the YAML to make the choice explicit. "
        f"DeepSeek adds the shared expert ungated, at full weight; here its constant gate is sigmoid = 1/2, so it "
        f"adds half as much: for mergekit's FFN output set {_full_weight_scales(config)}"]


def _full_weight_scales(config: UpcycleConfig) -> str:
    """The shared experts' residual_scale that makes a constant (sigmoid = 1/2) qwen2_moe shared-expert gate add
    them at DeepSeek's full weight: twice what each has."""
    from moe_upcycle.recipe.schema import MAX_SCALE

    said = []
    for i, e in enumerate(config.shared_experts):
        scale = 2 * (e.residual_scale if e.residual_scale is not None else 1.0)
        capped = max(-MAX_SCALE, min(MAX_SCALE, scale))  # the recipe takes |residual_scale| <= MAX_SCALE
        said.append(f"shared_experts[{i}].residual_scale: {scale:g}" if capped == scale else
                    f"shared_experts[{i}].residual_scale: {capped:g} — the furthest it goes; DeepSeek's weight "
                    f"would need {scale:g}, so this one stays at {capped / 2:g}x, not {scale / 2:g}x")
    return "; ".join(said)


def _window_note(base: Checkpoint, layout: names.OutputLayout) -> list[str]:
    """A note when the dense base attends within a sliding window, which this MoE keeps and mergekit-moe 0.1.5's
    Mixtral and Qwen2-MoE outputs drop (``sliding_window: null``): the two differ on longer texts."""
    per_layer = windows.dense_windows(base.config)
    window = max((w for w in per_layer if w), default=None)
    if window is None or layout.model_type not in ("mixtral", "qwen2_moe"):
        return []
    where = "" if all(per_layer) else f" in {sum(bool(w) for w in per_layer)} of its {len(per_layer)} layers"
    return [f"{base.model_type} base_model attends within a sliding window of {window} tokens{where}, and so does this MoE "
            f"(its config.json keeps the window); mergekit-moe 0.1.5 writes sliding_window: null, so its MoE "
            f"attends over the whole context and differs from the dense model on texts longer than {window} tokens"]


def _identical_experts_note(config: UpcycleConfig) -> list[str]:
    """A note when every listed expert is the same model, copied unchanged, under prompt-built routers."""
    from moe_upcycle.recipe.params import PROMPT_MODES

    experts = config.experts
    if config.num_experts is not None or len(experts) < 2 or config.gate_mode not in PROMPT_MODES:
        return []
    first = experts[0]
    unchanged = config.expert_init.method == "copy" and all(
        not e.noise_scale and e.residual_scale in (None, 1.0) and (e.expert_init is None or e.expert_init.method == "copy")
        for e in experts)
    if not unchanged or any((e.source_model, e.layers) != (first.source_model, first.layers) for e in experts):
        return []
    return [f"every expert is {first.source_model}, unchanged: the {len(experts)} experts compute the same FFN, so "
            f"the MoE gives the dense model's output whichever experts the gate_mode {config.gate_mode} routers pick, "
            f"until it is trained (mergekit-moe 0.1.5 refuses this without "
            f"--i-understand-this-is-not-useful-without-training)"]


def _no_layers(where: str, base: Checkpoint, family: names.InputFamily) -> str:
    """The message for weights without a single ``model.layers.N.`` tensor (a wrapped or foreign checkpoint)."""
    if not base.tensors:
        return f"{where}: its weight files hold no tensors at all; re-download the model"
    sample = next((k for k in base.tensors if f".{k}".find(".layers.0.") >= 0), next(iter(base.tensors)))
    return (f"{where}: none of its {len(base.tensors)} tensors is named like a {family.class_name} layer "
            f"(model.layers.0.self_attn.q_proj.weight ...); it holds e.g. {sample!r}. The weights are not "
            f"{family.class_name}'s (a multimodal model, or one saved inside a wrapper?): give the checkpoint of "
            f"the language model itself")


def deepseek_refusal(config: UpcycleConfig, natural: str) -> str:
    """Why `architecture: deepseek` is refused, and what to write instead."""
    if config.shared_experts:
        instead = ("architecture: qwen2_moe, which has a shared expert; for DeepSeek's always-on shared expert, "
                   "which it adds ungated at full weight, add shared_expert_gate: constant (sigmoid = 1/2) and "
                   f"{_full_weight_scales(config)} (twice the weight, against the gate's 1/2)")
    else:
        instead = f"architecture: {natural} (or leave architecture: out), which transformers loads natively"
    return (f"architecture: deepseek: mergekit-moe writes DeepSeek-MoE (v1) checkpoints, which transformers can only "
            f"load with trust_remote_code and code from deepseek-ai/deepseek-moe-16b-base; moe-upcycle writes only "
            f"architectures transformers ships ({', '.join(names.OUTPUT_LAYOUTS)}) → use {instead}")


def _suggest(config: UpcycleConfig, base: Checkpoint, key: str, current: str) -> str:
    """" → use architecture: X" naming the outputs that fit; else those that at least avoid this problem."""
    problems = {n: misfits(layout, config, base) for n, layout in names.OUTPUT_LAYOUTS.items()
                if n != current and not hybrid.family_misfit(layout, base.model_type)}  # Qwen3.5-MoE: its bases only
    fits = [n for n, reasons in problems.items() if not reasons]
    named = [n for n in fits if names.OUTPUT_LAYOUTS[n].automatic] or fits  # GLM-4-MoE when nothing else fits
    if fits:
        return " → use architecture: " + " or ".join(named)
    partial = [n for n, reasons in problems.items() if key not in {k for _, k in reasons}]
    partial = [n for n in partial if names.OUTPUT_LAYOUTS[n].automatic] or partial
    if partial:
        return f" (only {' and '.join(partial)} can, and {'it does' if len(partial) == 1 else 'they do'} not fit either)"
    return " → no supported output architecture can hold it"


def config_fields(plan: "Plan") -> dict:
    """The architecture-specific config.json fields of a planned output.

    Sizes are read from the planned tensors (not the base config), so experts whose shape was
    changed by the plan are described as written.
    """
    layout = names.output_layout(plan.architecture)
    base = plan.base_config
    leaves = {s.name: s for s in plan.leaf_steps()}
    first_moe = plan.moe_layers[0] if plan.moe_layers else 0  # layer 0 may be a dense one (``moe_layers:``)
    gate0 = leaves.get(names.fill(layout.expert["gate_proj"], layer=first_moe, expert=0))
    fields = dict(layout.config)
    fields[layout.experts_key] = len(plan.expert_names)
    fields[layout.expert_size_key] = gate0.shape[0] if gate0 else base.intermediate_size
    if layout.shared_expert and layout.shared_size_key:
        top = {s.name: s for s in plan.steps}  # several shared experts are one step made of parts
        shared = top.get(names.fill(layout.shared_expert["gate_proj"], layer=first_moe))
        fields[layout.shared_size_key] = shared.shape[0] if shared else 0
    if "norm_topk_prob" in layout.config:
        fields["norm_topk_prob"] = plan.norm_topk_prob
    if layout.dense_mlp and not layout.leading_dense_only:
        fields.update(sparse_layer_fields(plan.moe_layers, plan.num_layers))
    fields.update(EXTRA_FIELDS[layout.model_type](plan) if layout.model_type in EXTRA_FIELDS else {})
    if layout.bias_config_key:
        fields[layout.bias_config_key] = any(s.name.endswith(names.QKV_BIAS) for s in plan.steps)
    fields.update({k: base[k] for k in layout.inherit if k in base})
    fields.update(hybrid.config_fields(layout, base))
    fields.update(router_statics.config_fields(layout, plan))
    per_layer = windows.dense_windows(base)
    if not any(per_layer):  # a sliding_window the dense model does not apply is not copied
        fields.update(windows.no_window_fields(layout, base.num_hidden_layers))
    elif "layer_types" in layout.inherit and "layer_types" not in base:
        # Mistral slides every layer, a Qwen base the layers from max_window_layers on: Qwen MoE configs say which
        # (transformers 5 reads layer_types; 4.x's flash-attention 2 path, max_window_layers: the first that slides)
        first = next(i for i, w in enumerate(per_layer) if w)
        fields.update(use_sliding_window=True, max_window_layers=first,
                      layer_types=["sliding_attention" if w else "full_attention" for w in per_layer])
    return fields


def sparse_layer_fields(moe: tuple[int, ...], num_layers: int) -> dict:
    """Qwen MoE's ``decoder_sparse_step`` and ``mlp_only_layers`` for MoE layers `moe` of `num_layers`.

    transformers (4.57 and 5), vLLM and Qwen's own code make layer i an MoE layer when
    ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``. ``mlp_only_layers`` lists every
    dense layer, so a loader that reads only it builds the right layers; ``decoder_sparse_step`` is k when the
    MoE layers are exactly k-1, 2k-1, ... (Qwen's own spelling of "every k-th layer"), else 1.

    Example:
        >>> sparse_layer_fields((1, 3), 4), sparse_layer_fields((0, 2), 4)
        ({'decoder_sparse_step': 2, 'mlp_only_layers': [0, 2]}, {'decoder_sparse_step': 1, 'mlp_only_layers': [1, 3]})
    """
    dense = [i for i in range(num_layers) if i not in set(moe)]
    step = next((k for k in range(2, num_layers + 1)
                 if tuple(i for i in range(num_layers) if (i + 1) % k == 0) == tuple(moe)), 1)
    return {"decoder_sparse_step": step, "mlp_only_layers": dense}
