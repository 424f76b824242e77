"""Check every source model against the base before planning (frankenMoE and shared experts).

An MoE built from several dense models takes each expert's FFN from its `source_model` and the
rest (attention, norms, embeddings) from `base_model`, or the mean over all sources
(`attention_from: average`). That only works when the pieces fit, so each source is compared
with the base field by field, and every problem names the model (with its YAML path) and the
field, e.g. ``experts[1] (./math-ft): intermediate_size is 11008 but base_model ./base has 14336``.

An expert's own vocabulary is not part of its FFN: fine-tunes that added a few tokens (ChatML's
``<|im_start|>``, a pad token: 32000 -> 32002) are built, as mergekit-moe builds them, with a note
that the MoE keeps base_model's embeddings and tokenizer. A vocabulary of another size class
(32000 next to 128256) marks a model from another pretraining, whose FFN expects another model's
hidden states, and is refused.

An expert's `layers: [start, end)` takes its FFNs from a slice of a deeper (or shallower) model;
the slice must be exactly as long as the base is deep, and the message says both counts instead
of failing later with "all inputs to a slice must have the same number of layers".

It reads config.json values and tensor headers only.
"""

from __future__ import annotations

from moe_upcycle.checkpoint import names
from moe_upcycle.recipe.schema import ExpertConfig, UpcycleConfig
from moe_upcycle.checkpoint.dense_config import DenseConfig
from moe_upcycle.checkpoint.source import Checkpoint

# fields an FFN must share with the base to sit in its MoE layers
FFN_FIELDS = ("hidden_size", "intermediate_size")
# tokens a fine-tune may add to its base's vocabulary (chat markers, pad tokens, a few hundred domain tokens)
ADDED_TOKENS_LIMIT = 1024
# extra fields that must match when attention and embeddings are averaged over sources
ATTENTION_FIELDS = ("num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def average_sources(config: UpcycleConfig) -> list[str]:
    """The models averaged by `attention_from: average`: every distinct expert source (routed, then shared).

    The base is included only when it is also an expert's source: in Branch-Train-MiX the
    averaged models are the branches, and the base is only the seed they were trained from.
    """
    refs = [e.source_model for e in config.expert_list()] + [e.source_model for e in config.shared_experts]
    return list(dict.fromkeys(refs))


def source_problems(config: UpcycleConfig, sources: dict[str, Checkpoint]) -> list[str]:
    """Every way an expert or shared-expert source does not fit the base (empty when all fit).

    Args:
        config: the validated recipe.
        sources: the opened checkpoints, keyed by reference.

    Returns:
        One message per problem, each naming the model, its YAML path and the field.
    """
    base = sources[config.base_model]
    problems: list[str] = []
    used = [(f"experts[{i}]", e) for i, e in enumerate(config.expert_list())]
    used += [(f"shared_experts[{i}]", e) for i, e in enumerate(config.shared_experts)]
    for path, expert in used:
        src = sources[expert.source_model]
        if src is base and expert.layers is None:
            continue
        problems += _ffn_problems(path, expert, src, base, config.base_model)
    if config.attention_from == "average":
        for ref in average_sources(config):
            if sources[ref] is not base:
                problems += _attention_problems(_label(config, ref), sources[ref], base, config.base_model)
    return list(dict.fromkeys(problems))


def _label(config: UpcycleConfig, ref: str) -> str:
    for i, e in enumerate(config.expert_list()):
        if e.source_model == ref:
            return f"experts[{i}] ({ref})"
    i = next(i for i, e in enumerate(config.shared_experts) if e.source_model == ref)
    return f"shared_experts[{i}] ({ref})"


def _ffn_problems(path: str, expert: ExpertConfig, src: Checkpoint, base: Checkpoint, base_ref: str) -> list[str]:
    label = f"{path} ({expert.source_model})"
    out = []
    if src.model_type not in names.INPUT_FAMILIES:
        out.append(f"{label}: {names.unsupported_input(src.model_type)}")
    elif src.model_type != base.model_type:
        out.append(f"{label}: model_type {src.model_type!r} differs from base_model's {base.model_type!r}; "
                   f"experts must be fine-tunes of the same family as base_model")
    for key in FFN_FIELDS:
        if src.config.get(key) != base.config.get(key):
            out.append(f"{label}: {key} is {src.config.get(key)} but base_model {base_ref} has "
                       f"{base.config.get(key)}; experts must have the base's shape")
    vocab, base_vocab = src.config.get("vocab_size"), base.config.get("vocab_size")
    if vocab != base_vocab and not _added_tokens(vocab, base_vocab):
        if isinstance(vocab, int) and isinstance(base_vocab, int):
            # either way round: a base with added tokens (ChatML's 32002) may have more than its fine-tunes
            gap = (f"the expert has {abs(vocab - base_vocab)} tokens {'more' if vocab > base_vocab else 'fewer'} than "
                   f"the base, where a fine-tune's vocabulary and its base's differ by at most the "
                   f"{ADDED_TOKENS_LIMIT} tokens a fine-tune adds")
        else:
            gap = "one of them gives no vocabulary size"
        out.append(f"{label}: vocab_size is {vocab} but base_model {base_ref} has {base_vocab}: {gap}; it is a "
                   f"model from another pretraining, whose FFN expects that model's hidden states; use experts "
                   f"fine-tuned from the same base")
    n_base, n_src = base.fields.num_hidden_layers, src.fields.num_hidden_layers
    if expert.layers is not None:
        start, end = expert.layers
        if end - start != n_base:
            out.append(f"{path}.layers ({expert.source_model}): [{start}, {end}] selects {end - start} layers but "
                       f"base_model {base_ref} has {n_base} (num_hidden_layers); each MoE layer takes one FFN per "
                       f"expert, so the range must span {n_base} layers, e.g. [{start}, {start + n_base}]")
        if end > n_src:
            out.append(f"{path}.layers ({expert.source_model}): [{start}, {end}] goes past the {n_src} layers of "
                       f"{expert.source_model} (num_hidden_layers); use a range within [0, {n_src}]")
    elif n_src != n_base:
        hint = f"; take {n_base} of its layers with layers: [0, {n_base}]" if n_src > n_base else ""
        out.append(f"{label}: num_hidden_layers is {n_src} but base_model {base_ref} has {n_base}; "
                   f"experts must have the base's layer count{hint}")
    mlp_bias = next((k for k in src.tensors if names.split_layer(k)[0].startswith("model.layers.{layer}.mlp.")
                     and k.endswith(".bias")), None)
    if mlp_bias:
        out.append(f"{label}: tensor {mlp_bias!r} is an MLP bias, which MoE experts cannot hold; "
                   f"it would be silently dropped, so the build stops")
    return out


def _added_tokens(vocab, base_vocab) -> bool:
    """Whether two vocab sizes differ only by the tokens a fine-tune adds."""
    return isinstance(vocab, int) and isinstance(base_vocab, int) and abs(vocab - base_vocab) <= ADDED_TOKENS_LIMIT


def source_notes(config: UpcycleConfig, sources: dict[str, Checkpoint]) -> list[str]:
    """What the plan should say about sources that fit but differ from the base (added tokens)."""
    base = sources[config.base_model]
    used = [(f"experts[{i}]", e) for i, e in enumerate(config.expert_list())]
    used += [(f"shared_experts[{i}]", e) for i, e in enumerate(config.shared_experts)]
    differ = {}
    for path, expert in used:
        vocab = sources[expert.source_model].config.get("vocab_size")
        if vocab != base.config.get("vocab_size") and _added_tokens(vocab, base.config.get("vocab_size")):
            differ.setdefault(expert.source_model, (path, vocab))
    notes = _adapter_notes(used, sources, base)
    if not differ:
        return notes
    base_vocab = base.config.get("vocab_size")
    listed = ", ".join(f"{path} ({ref}): {vocab}" for ref, (path, vocab) in differ.items())
    if any(vocab > base_vocab for _, vocab in differ.values()):
        what = ("tokens added in fine-tuning; the MoE keeps base_model's embeddings and tokenizer (as mergekit-moe "
                "does), so the tokens an expert added are not in its vocabulary")
    else:  # the base added tokens the experts never had: nothing is lost
        what = (f"base_model has tokens these experts were not trained with; the MoE keeps base_model's embeddings "
                f"and tokenizer (as mergekit-moe does), all {base_vocab} tokens")
    return [f"vocab_size differs from base_model's {base_vocab} ({listed}): {what}"] + notes


def _adapter_notes(used: list, sources: dict[str, Checkpoint], base: Checkpoint) -> list[str]:
    """A note per expert whose LoRA adapter changes tensors the MoE takes from base_model (attention, norms...).

    An expert gives the MoE its FFN only; what its adapter changes elsewhere is not in the MoE (as in
    mergekit-moe) unless base_model reads the same bytes (the same adapter on it).
    """
    ffn = tuple(f".mlp.{p}.weight" for p in names.PROJS)
    out = {}
    for path, expert in used:
        src = sources[expert.source_model]
        if src.adapter is None or src is base or expert.source_model in out:
            continue
        changed = sorted(set(src.adapter.pairs) | set(src.adapter.replaced))
        kept = [k for k in changed if k.endswith(ffn)]
        lost = [k for k in changed if not k.endswith(ffn) and base.identity(k) != src.identity(k)]
        if not lost:
            continue
        effect = (f"so only the {len(kept)} FFN tensor(s) it changes are in the MoE" if kept else
                  "so the adapter changes nothing in the MoE (this expert's FFN is the model's own)")
        out[expert.source_model] = (
            f"{path} ({expert.source_model}): its LoRA adapter changes {len(lost)} tensor(s) that the MoE takes "
            f"from base_model, not from experts (e.g. {lost[0]}), {effect}, as mergekit-moe builds it; to keep "
            f"those changes, put the adapter on base_model too")
    return list(out.values())


def _attention_problems(label: str, src: Checkpoint, base: Checkpoint, base_ref: str) -> list[str]:
    out = []
    for key in ("num_hidden_layers",) + ATTENTION_FIELDS:
        mine, theirs = _field(src.fields, key), _field(base.fields, key)
        if mine != theirs:
            out.append(f"{label}: {key} is {mine} but base_model {base_ref} has {theirs}; attention_from: average "
                       f"needs every source to match the base (or use attention_from: base)")
    ffn = tuple(f".mlp.{p}.weight" for p in names.PROJS)
    for key, info in base.tensors.items():
        if key.endswith(ffn) or key.endswith("rotary_emb.inv_freq"):
            continue
        theirs = src.tensors.get(key)
        if theirs is None:
            if not (key == names.LM_HEAD and base.config.get("tie_word_embeddings")):
                out.append(f"{label}: tensor {key!r} is missing, but attention_from: average needs it in every source")
        elif theirs.shape != info.shape:
            out.append(f"{label}: tensor {key!r} has shape {list(theirs.shape)} but base_model {base_ref} has "
                       f"{list(info.shape)}; attention_from: average needs equal shapes")
    extra = [k for k in src.tensors if k not in base.tensors and not k.endswith(ffn) and ".mlp." not in k
             and not (k == names.LM_HEAD and base.config.get("tie_word_embeddings"))]
    if extra:
        suffix = names.split_layer(extra[0])[0].removeprefix("model.layers.{layer}.")
        group = names.TENSOR_GROUPS.get(suffix, "tensors")
        out.append(f"{label}: has {group} ({extra[0]}) that base_model {base_ref} lacks; attention_from: average "
                   f"would drop them, so the build stops (use attention_from: base, or a base with them)")
    return out


def _field(config: DenseConfig, key: str):
    """A field as the model uses it: head_dim, key-value heads and tying as transformers derives them."""
    if key in ("head_dim", "num_key_value_heads", "tie_word_embeddings"):
        return getattr(config, key)
    return config.get(key)
