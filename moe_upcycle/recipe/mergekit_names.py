"""mergekit-moe 0.1.5's vocabulary: its config keys and the `architecture:` spellings it accepts.

mergekit-moe picks its output with ``name.lower().startswith(architecture.lower())`` over its
outputs "Mixtral", "DeepSeek MoE", "Qwen MoE" and "Qwen3 MoE", so ``Mixtral``, ``qwen``,
``Qwen3``, ``deepseek`` and ``qwen moe`` are all valid there. `architecture_name` maps every such
spelling (and a few obvious others: ``qwen2``, ``qwen3-moe``) onto our names. ``qwen`` is a
prefix of both Qwen outputs, so it stays ``qwen`` and `arch` picks one from the base model.

`looks_like_mergekit` tells whether a validated config uses mergekit's keys only, so `build`
can say when such a config is built with our (different) router semantics.

It validates nothing else and reads no checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

# mergekit-moe 0.1.5: MoEMergeConfig and Expert (mergekit/moe/config.py)
MERGEKIT_KEYS = frozenset({"base_model", "experts", "gate_mode", "dtype", "experts_per_token", "shared_experts",
                           "architecture"})
MERGEKIT_EXPERT_KEYS = frozenset({"source_model", "positive_prompts", "negative_prompts", "noise_scale",
                                  "residual_scale"})
# keys of mergekit-yaml (merge) configs that people carry into mergekit-moe configs, which ignores them:
# what happens instead, for the unknown-key message
MERGE_CONFIG_KEYS = {
    "tokenizer_source": "the MoE gets base_model's tokenizer, as with mergekit-moe",
    "tokenizer": "the MoE gets base_model's tokenizer, as with mergekit-moe",
    "chat_template": "the MoE gets base_model's chat template, as with mergekit-moe",
    "merge_method": "a MoE has no merge method (that key is mergekit-yaml's)",
    "parameters": "a MoE has no merge parameters (that key is mergekit-yaml's)",
    "models": "mergekit-moe reads experts:, not models: (that key is mergekit-yaml's)",
    "slices": "mergekit-moe reads experts:, not slices: (that key is mergekit-yaml's)",
}
# mergekit's output names (MoEOutputArchitecture.name()), lowercased, and ours for each
_MERGEKIT_OUTPUTS = {"mixtral": "mixtral", "deepseek moe": "deepseek", "qwen moe": "qwen2_moe",
                     "qwen3 moe": "qwen3_moe"}
# spellings people write that are not prefixes of mergekit's names
_EXTRA_SPELLINGS = {"qwen2": "qwen2_moe", "qwen2 moe": "qwen2_moe", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                    "qwen moe": "qwen2_moe", "deepseekmoe": "deepseek", "deepseek v1": "deepseek",
                    "glm4moe": "glm4_moe", "glm4 moe": "glm4_moe", "glm 4 moe": "glm4_moe"}
OUR_ARCHITECTURES = ("mixtral", "qwen", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "granitemoeshared",
                     "ernie4_5_moe", "deepseek", "glm4_moe")
# how and where to run, not what to build: setting these (CLI options) keeps a config mergekit-shaped
RUN_KEYS = frozenset({"device", "batch_size", "checksums", "tensor_policy", "max_shard_size", "output"})


def drop_base_tokenizer(data: dict) -> dict:
    """`data` without ``tokenizer_source: base`` (or ``model:`` and base_model's name, or ``tokenizer: {source:
    base}``): mergekit-yaml keys that ask for exactly what every MoE gets, base_model's tokenizer — so they
    are read, not refused, as mergekit-moe reads them. Any other tokenizer choice stays, for the unknown-key
    message.

    Example:
        >>> drop_base_tokenizer({"base_model": "m", "tokenizer_source": "base", "tokenizer": {"source": "union"}})
        {'base_model': 'm', 'tokenizer': {'source': 'union'}}
        >>> drop_base_tokenizer({"base_model": "./m", "tokenizer_source": "model:./m/"})
        {'base_model': './m'}
    """
    base = data.get("base_model")

    def is_base(value: Any) -> bool:  # `base`, or `model:` naming base_model itself (mergekit's other spelling)
        if not isinstance(value, str):
            return False
        text = value.strip()
        named = text[len("model:"):].strip().rstrip("/") if text.lower().startswith("model:") else None
        return text.lower() == "base" or (isinstance(base, str) and bool(named) and named == base.strip().rstrip("/"))

    out = dict(data)
    if is_base(out.get("tokenizer_source")):
        del out["tokenizer_source"]
    tok = out.get("tokenizer")
    if isinstance(tok, dict) and set(tok) == {"source"} and is_base(tok["source"]):
        del out["tokenizer"]
    return out


def architecture_name(value: str) -> Optional[str]:
    """Our name for an `architecture:` value as mergekit-moe would read it.

    Example:
        >>> [architecture_name(v) for v in ("Mixtral", "qwen", "Qwen3", "QWEN MOE", "deepseek", "qwen2-moe")]
        ['mixtral', 'qwen', 'qwen3_moe', 'qwen2_moe', 'deepseek', 'qwen2_moe']

    Returns:
        ``None`` for an empty value (mergekit then chooses, as we do); the value unchanged when it
        matches nothing, so the schema reports it with the allowed names.
    """
    text = " ".join(value.strip().lower().replace("_", " ").replace("-", " ").split())
    if not text:
        return None
    if text.replace(" ", "_") in OUR_ARCHITECTURES:
        return text.replace(" ", "_")
    if text in _EXTRA_SPELLINGS:
        return _EXTRA_SPELLINGS[text]
    matches = sorted({ours for name, ours in _MERGEKIT_OUTPUTS.items() if name.startswith(text)})
    if matches == ["qwen2_moe", "qwen3_moe"]:
        return "qwen"  # mergekit's "qwen": the Qwen output that fits the models
    if len(matches) == 1:
        return matches[0]
    return value


def model_reference(value: Any) -> Any:
    """mergekit's mapping form of a model reference as the string form we read; other values unchanged.

    mergekit-moe also accepts ``{model: org/name}`` and ``{model: {path: org/name, revision: r},
    lora: ...}`` where a reference goes. A LoRA becomes ``model+lora`` (the adapter is merged in as
    the model is read, `checkpoint.lora`); ``override_architecture`` cannot be honoured and is refused here.

    Example:
        >>> model_reference({"model": {"path": "org/name", "revision": "v1"}})
        'org/name@v1'

    Raises:
        ValueError: a mapping that is not a model reference, or one with override_architecture.
    """
    if not isinstance(value, dict):
        return value
    unknown = sorted(set(map(str, value)) - {"model", "lora", "override_architecture"})
    if unknown or "model" not in value:
        raise ValueError(f"a mapping with {', '.join(unknown or map(str, value)) or 'no keys'} is not a model "
                         f"reference; write org/name, org/name@revision or a folder")
    if value.get("override_architecture"):
        raise ValueError(f"override_architecture: {value['override_architecture']!r} cannot be applied: the "
                         f"model's config.json decides its architecture; remove it or fix that config.json")

    def path(part: Any) -> str:
        if isinstance(part, dict) and isinstance(part.get("path"), str) and set(part) <= {"path", "revision"}:
            return part["path"] + (f"@{part['revision']}" if part.get("revision") else "")
        if isinstance(part, str):
            return part
        raise ValueError(f"{part!r} is not a model path; write {{path: org/name, revision: main}} or org/name")

    lora = value.get("lora")
    return path(value["model"]) + (f"+{path(lora)}" if lora else "")


def looks_like_mergekit(config: Any) -> bool:
    """True when every key the config sets is one of mergekit-moe's (so its author expects mergekit's behaviour)."""
    if not config.experts or not set(config.model_fields_set) <= MERGEKIT_KEYS | RUN_KEYS:
        return False
    return all(set(e.model_fields_set) <= MERGEKIT_EXPERT_KEYS for e in [*config.experts, *config.shared_experts])


def semantics_note(config: Any) -> Optional[str]:
    """What `build` says, once, when a mergekit-shaped config is built with our router semantics.

    ``None`` when the config is not mergekit-shaped, already asks for mergekit's computation, or
    uses a mode whose rows are the same either way (``uniform_random``).
    """
    if config.gate_source == "mergekit" or not looks_like_mergekit(config):
        return None
    how = "add gate_source: mergekit to the YAML, or build with --mergekit"
    mode = config.gate_mode
    if mode in ("hidden", "hidden_avg", "hidden_last"):
        ours = "the last real token's" if mode == "hidden_last" else "a mean over real tokens (no padding, no BOS) of"
        theirs = ("the mean over all positions, padding included, of" if mode == "hidden_avg"
                  else "the last token's")
        return (f"gate_mode: {mode} was built with moe-upcycle's router inputs: {ours} each layer's "
                f"post_attention_layernorm output (what the router scores), rows scaled for a decisive softmax. "
                f"mergekit-moe 0.1.5 uses {theirs} residual stream before each layer (bf16, unit rows), which routes "
                f"differently; for mergekit's routers, {how}")
    if mode == "cheap_embed":
        return (f"gate_mode: cheap_embed was built with moe-upcycle's rows: per-prompt mean embedding of real tokens, "
                f"scaled to 16/sqrt(hidden). mergekit-moe sums every token's embedding (BOS included) into unit rows; "
                f"for mergekit's, {how}")
    if mode == "random":
        return (f"gate_mode: random was built with std {config.router_init_std} rows (router_init_std); mergekit-moe "
                f"draws std 1.0, which saturates the softmax; for mergekit's, {how}")
    return None
