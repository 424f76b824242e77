"""Plan-time checks of each source's config.json against its tensors, and of experts against the base.

- `shape_problems`: the sizes in config.json against the tensor shapes in the weights' headers
  (vocab, hidden, intermediate, attention heads / key-value heads / head_dim).
- `expert_problems`: an expert whose ``hidden_act`` differs from the base's — the MoE's config.json
  has one activation for all experts, so its FFN would run with one it was not trained with. Rope
  settings and ``rms_norm_eps`` act in attention and the norms, which the MoE takes from the base
  (as mergekit-moe does: Mistral v0.1 and v0.2 fine-tunes, rope_theta 1e4 and 1e6, are mixed in
  published frankenMoEs), so a difference there is a note (`expert_setting_notes`) — and a problem
  only with ``attention_from: average``, which would average attention trained with other settings.

Every function returns all the problems it finds (empty when there are none); it reads config
values and header shapes only, never tensor bytes.
"""

from __future__ import annotations

from typing import Any, Sequence

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.config_checks import is_number
from moe_upcycle.checkpoint.dense_config import DenseConfig
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.planning import rope


GATED_QUERY = ("qwen3_5_text",)  # families whose q_proj is (2 x heads x head_dim, hidden)


def _expected_shapes(config: DenseConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Layer-template (or top-level key) -> (shape config.json implies, the fields it comes from)."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, head_dim, kv = config.num_attention_heads, config.head_dim, config.num_key_value_heads
    attn, kv_dim = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
    shapes = {
        names.EMBED: ((vocab, hidden), "vocab_size, hidden_size"),
        names.LM_HEAD: ((vocab, hidden), "vocab_size, hidden_size"),
        "model.norm.weight": ((hidden,), "hidden_size"),
        "model.layers.{layer}.mlp.gate_proj.weight": ((inter, hidden), "intermediate_size, hidden_size"),
        "model.layers.{layer}.mlp.up_proj.weight": ((inter, hidden), "intermediate_size, hidden_size"),
        "model.layers.{layer}.mlp.down_proj.weight": ((hidden, inter), "hidden_size, intermediate_size"),
        "model.layers.{layer}.input_layernorm.weight": ((hidden,), "hidden_size"),
        "model.layers.{layer}.post_attention_layernorm.weight": ((hidden,), "hidden_size"),
    }
    # Qwen3.5's gated attention: q_proj holds each head's query and its output gate
    q_rows, q_fields = (2, f"2 x {attn}") if config.model_type in GATED_QUERY else (1, attn)
    shapes.update({
        "model.layers.{layer}.self_attn.q_proj.weight": ((q_rows * heads * head_dim, hidden),
                                                         f"{q_fields}, hidden_size"),
        "model.layers.{layer}.self_attn.k_proj.weight": ((kv * head_dim, hidden), f"{kv_dim}, hidden_size"),
        "model.layers.{layer}.self_attn.v_proj.weight": ((kv * head_dim, hidden), f"{kv_dim}, hidden_size"),
        "model.layers.{layer}.self_attn.o_proj.weight": ((hidden, heads * head_dim), f"hidden_size, {attn}"),
    })
    return shapes


def shape_problems(ckpt: Checkpoint, label: str) -> list[str]:
    """Every tensor kind whose shape contradicts config.json (one message per kind, first key named); for an
    in-memory model (no folder), its ``model.config``."""
    if ckpt.from_config:  # meta checkpoints are made from config.json: nothing to contradict
        return []
    expected = _expected_shapes(ckpt.fields)
    wrong: dict[str, list[str]] = {}
    for key, info in ckpt.tensors.items():
        template = names.split_layer(key)[0]
        if template in expected and tuple(info.shape) != expected[template][0]:
            wrong.setdefault(template, []).append(key)
    out = []
    for template, keys in wrong.items():
        shape, fields = expected[template]
        info = ckpt.tensors[keys[0]]
        more = f" (and {len(keys) - 1} more like it)" if len(keys) > 1 else ""
        if ckpt.path is None:
            out.append(f"{label}: parameter {keys[0]!r} has shape {list(info.shape)}{more} but model.config implies "
                       f"{list(shape)} ({fields}); the config does not describe the model's weights (a module "
                       f"replaced without updating model.config?) — make them agree")
        else:
            out.append(f"{label}: tensor {keys[0]!r} has shape {list(info.shape)}{more} but config.json implies "
                       f"{list(shape)} ({fields}); config.json does not describe these weights — fix it or "
                       f"re-download the model")
    return out


def _rope(config: dict) -> tuple:
    """Rope settings as one comparable value: theta and the scaling (type and its parameters)."""
    # as transformers 5 reads it: `type` or `rope_type`, rope_scaling or rope_parameters, yarn's implied
    # original_max_position_embeddings — one setting however a base and its fine-tunes spell it
    theta = rope.rope_theta(config)
    merged = rope.base_rope(config)
    if merged["rope_type"] == "default":
        merged = {}
    return float(theta) if is_number(theta) else theta, tuple(sorted((k, repr(v)) for k, v in merged.items()))


def expert_problems(base_ref: str, used: Sequence[tuple[str, str]], sources: dict[str, Checkpoint],
                    attention_average: bool = False) -> list[str]:
    """Experts (routed or shared) whose activation differs from the base's (and, when attention is averaged
    over the sources, whose rope settings or norm eps do).

    Args:
        base_ref: the recipe's ``base_model``.
        used: (YAML path, model reference) of every routed and shared expert, e.g. ("experts[0]", "./ft0").
        sources: the opened checkpoints, keyed by reference.
        attention_average: the recipe has ``attention_from: average``.
    """
    out = []
    for label, key, mine, theirs in _differences(base_ref, used, sources):
        if key == "hidden_act":
            out.append(f"{label}: {key} is {_show(mine)} but base_model {base_ref} has {_show(theirs)}; "
                       f"the MoE has one value for all experts, so this expert would run with settings it was "
                       f"not trained with — use experts fine-tuned from the same base")
        elif attention_average:
            out.append(f"{label}: {key} is {_show(mine)} but base_model {base_ref} has {_show(theirs)}; "
                       f"attention_from: average would run this model's attention with the base's settings, "
                       f"which it was not trained with — use attention_from: base")
    return list(dict.fromkeys(out))


def expert_setting_notes(base_ref: str, used: Sequence[tuple[str, str]], sources: dict[str, Checkpoint]) -> list[str]:
    """One note per expert whose rope settings or norm eps differ from the base's (which the MoE keeps)."""
    out = []
    for label, key, mine, theirs in _differences(base_ref, used, sources):
        if key != "hidden_act":
            out.append(f"{label}: {key} is {_show(mine)}, base_model {base_ref} has {_show(theirs)}; the MoE "
                       f"runs base_model's attention and norms with the base's value and takes only this "
                       f"expert's FFN, as mergekit-moe does")
    return list(dict.fromkeys(out))


def _differences(base_ref: str, used: Sequence[tuple[str, str]], sources: dict[str, Checkpoint]):
    """(label, setting, expert's value, base's value) for every setting an expert has other than the base."""
    base = sources[base_ref]
    for path, ref in used:
        src = sources[ref]
        if src is base:
            continue
        label = f"{path} ({ref})"
        act = ("hidden_act", _act(src.fields), _act(base.fields))
        for key, mine, theirs in (act,
                                  ("rms_norm_eps", src.fields.rms_norm_eps, base.fields.rms_norm_eps),
                                  ("rope settings", _rope(src.config), _rope(base.config))):
            if mine != theirs:
                yield label, key, mine, theirs


def _act(config: DenseConfig) -> str:
    """The activation's name, with transformers' aliases of one function made one (swish is silu)."""
    return "silu" if config.hidden_act == "swish" else config.hidden_act


def _show(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], tuple):
        scaling = ", ".join(f"{k}={v}" for k, v in value[1]) or "none"
        return f"rope_theta={value[0]}, scaling: {scaling}"
    return repr(value)
