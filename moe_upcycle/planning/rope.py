"""Rope scaling: the rope fields the output's config.json carries, and where they compute what transformers does.

Published configs say the same rope scaling several ways: ``rope_scaling`` with the legacy ``type``
key (Qwen2.5's yarn), with ``rope_type`` (Llama-3.1's llama3), with both (what transformers 4.x's
``save_pretrained`` writes), or transformers 5's ``rope_parameters`` (``rope_theta`` inside); yarn
without ``original_max_position_embeddings`` (transformers then uses ``max_position_embeddings``);
longrope with it at the top level (Phi-3 style). The runtimes read fewer spellings than transformers:

- transformers 5 reads ``rope_scaling`` first, else ``rope_parameters``; a top-level
  ``original_max_position_embeddings`` overrides the one inside (llama3, yarn, longrope).
- transformers 4.57 reads ``rope_scaling`` (``type`` or ``rope_type``) and ``rope_theta``; its longrope
  takes ``original_max_position_embeddings`` from the top level only (without it the class fails to
  build: "'<=' not supported between 'NoneType' and 'float'") and then ``factor = max_position_embeddings
  / original_max_position_embeddings``, ignoring an explicit ``factor``.
- llama.cpp's ``convert_hf_to_gguf.py`` reads ``rope_parameters`` first, else ``rope_scaling``; it writes
  nothing for ``dynamic`` (llama.cpp then rotates unscaled) and no short/long factors for longrope on
  llama / qwen2moe / qwen3moe; llama.cpp's context replaces any yarn attention factor by the default
  0.1 ln(factor) + 1 (``llama-context.cpp``), so ``attention_factor`` / ``mscale`` are lost. Linear and
  yarn (``beta_fast``/``beta_slow`` included) convert exactly (measured by ``scripts/check_llamacpp.py``).
- vLLM's ``get_rope`` yarn needs ``original_max_position_embeddings`` and reads ``attn_factor``, not
  transformers' ``attention_factor``; its dynamic NTK scales the base for ``max_position_embeddings x
  factor`` at every position (transformers: only past ``max_position_embeddings``).
- ExLlamaV2's ``config.py`` reads ``rope_scaling`` only: linear, yarn, su/longrope under ``type``,
  llama3 under ``rope_type``; it asserts when both keys are present; its yarn reads ``factor`` and
  ``original_max_position_embeddings`` (KeyError without) and nothing else (betas 32 / 1, attention
  0.1 ln(factor) + 1), and applies only when ``max_seq_len`` (default: ``max_position_embeddings``) exceeds
  ``original_max_position_embeddings`` (Qwen2.5's yarn recipe sets both to 32768); its longrope needs the
  top-level ``original_max_position_embeddings`` and uses the long factors at every position when
  ``max_seq_len`` exceeds it (transformers: the short ones for texts up to it); it has no dynamic NTK.

So `rope_fields` writes one spelling every one of them reads: ``rope_scaling`` with ``type`` (``rope_type``
for llama3, which is the only key ExLlamaV2 reads for it), yarn's ``original_max_position_embeddings``
filled in with the value transformers uses, longrope's at the top level too, ``rope_theta`` beside it,
and ``rope_parameters`` (when the base has it) saying the same. `problem` says, per runtime, what the
written fields still cannot carry. Both read config.json values only.
"""

from __future__ import annotations

from typing import Optional

SCALED = ("linear", "dynamic", "yarn", "longrope", "llama3")  # the types `rope_fields` rewrites
# transformers' yarn keys that ExLlamaV2 ignores and vLLM reads under another name (or not at all)
YARN_TUNING = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "extrapolation_factor")
DEFAULT_THETA = 10000.0


def base_rope(base: dict) -> dict:
    """The dense base's rope settings as transformers 5 reads them: one dict with ``rope_type``.

    Example:
        >>> base_rope({"max_position_embeddings": 16, "rope_scaling": {"type": "yarn", "factor": 4.0}})
        {'factor': 4.0, 'rope_type': 'yarn', 'original_max_position_embeddings': 16}
    """
    params = base.get("rope_parameters") if isinstance(base.get("rope_parameters"), dict) else {}
    scaling = base.get("rope_scaling") if isinstance(base.get("rope_scaling"), dict) else {}
    source = dict(scaling or params)  # transformers 5: rope_scaling, when given, wins
    kind = str(source.pop("rope_type", source.pop("type", "default")))
    source.pop("type", None)
    source.pop("rope_theta", None)
    out = {**source, "rope_type": kind}
    if kind in ("llama3", "yarn", "longrope"):  # transformers 5's standardize_rope_params
        if isinstance(base.get("original_max_position_embeddings"), int):
            out["original_max_position_embeddings"] = base["original_max_position_embeddings"]
        elif "max_position_embeddings" in base:
            out.setdefault("original_max_position_embeddings", base["max_position_embeddings"])
    return out


def rope_theta(base: dict) -> float:
    """The base's rope_theta: the top-level field (4.x), else the one in rope_parameters (5), else the default."""
    params = base.get("rope_parameters") if isinstance(base.get("rope_parameters"), dict) else {}
    scaling = base.get("rope_scaling") if isinstance(base.get("rope_scaling"), dict) else {}
    for value in (base.get("rope_theta"), scaling.get("rope_theta"), params.get("rope_theta")):
        if value is not None:
            return value
    return DEFAULT_THETA


def rope_fields(base: dict) -> dict:
    """The rope fields of the output config.json, in the spelling every runtime above reads.

    Unscaled bases keep their fields as they are (``rope_scaling: null`` stays null); a scaling type
    outside `SCALED` is copied unchanged.

    Example:
        >>> rope_fields({"max_position_embeddings": 16, "rope_theta": 1e6,
        ...              "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0}})
        {'rope_theta': 1000000.0, 'rope_scaling': {'factor': 4.0, 'original_max_position_embeddings': 16, 'type': 'yarn'}}
    """
    fields: dict = {"rope_theta": rope_theta(base)}
    rope = base_rope(base)
    kind = rope.pop("rope_type")
    if kind == "default":
        if "rope_scaling" in base:  # {"type": "default", "rope_type": "default"} means none; ExLlamaV2 asserts on it
            fields["rope_scaling"] = None if isinstance(base["rope_scaling"], dict) else base["rope_scaling"]
        if isinstance(base.get("rope_parameters"), dict):
            fields["rope_parameters"] = {**base["rope_parameters"], "rope_theta": fields["rope_theta"]}
        return fields
    if kind not in SCALED:  # not ours to respell: as the base has it
        for key in ("rope_scaling", "rope_parameters"):
            if key in base:
                fields[key] = base[key]
        return fields
    fields["rope_scaling"] = {**rope, ("rope_type" if kind == "llama3" else "type"): kind}
    if isinstance(base.get("rope_parameters"), dict):
        fields["rope_parameters"] = {**rope, "rope_type": kind, "rope_theta": fields["rope_theta"]}
    if kind == "longrope" and rope.get("original_max_position_embeddings") is not None:
        fields["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    elif isinstance(base.get("original_max_position_embeddings"), int):
        fields["original_max_position_embeddings"] = base["original_max_position_embeddings"]
    return fields


def problem(runtime: str, config: dict) -> Optional[str]:
    """Why `runtime` computes other rope positions than transformers 5 for this output config.json, or None.

    Args:
        runtime: "transformers 4.x", "vLLM", "ExLlamaV2" or "llama.cpp".
        config: the config.json the build writes (`model_config.moe_config`).

    Example:
        >>> cfg = {"max_position_embeddings": 32, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
        >>> problem("llama.cpp", cfg).split("; ")[1]
        'identical up to max_position_embeddings (32 tokens), different beyond'
    """
    rope = base_rope(config)  # the written config, read as transformers 5 reads it
    kind = rope["rope_type"]
    if kind == "default":
        return None
    limit = _number(config.get("max_position_embeddings"))
    original = _number(rope.get("original_max_position_embeddings"))
    if runtime == "transformers 4.x":
        if kind == "longrope" and _number(rope.get("factor")) is not None and limit and original and \
                rope["factor"] != limit / original:
            return (f"rope_type longrope: 4.57 takes factor = max_position_embeddings / original_max_position_embeddings "
                    f"({limit} / {original}), not factor {rope['factor']}")
        return None
    if kind == "dynamic":
        beyond = f"identical up to max_position_embeddings ({limit} tokens), different beyond"
        if runtime == "llama.cpp":
            return (f"rope_type dynamic: convert_hf_to_gguf.py writes no dynamic NTK scaling, so llama.cpp rotates "
                    f"unscaled; {beyond}")
        if runtime == "ExLlamaV2":
            return f"rope_type dynamic: it has no dynamic NTK scaling and rotates unscaled; {beyond}"
        if runtime == "vLLM":
            return ("rope_type dynamic: its dynamic NTK scales the base for max_position_embeddings x factor at every "
                    "position; transformers only past max_position_embeddings")
    if kind == "longrope" and runtime == "ExLlamaV2":
        return (f"rope_type longrope: its su rope picks the long factors for every position once max_seq_len (default "
                f"max_position_embeddings, {limit}) exceeds original_max_position_embeddings; transformers uses the "
                f"short ones up to {rope.get('original_max_position_embeddings')} tokens")
    if kind == "longrope" and runtime == "llama.cpp":
        return ("rope_type longrope: convert_hf_to_gguf.py writes no short/long rope factors for llama, qwen2moe or "
                "qwen3moe, so llama.cpp rotates with other frequencies")
    tuned = [k for k in YARN_TUNING if k in rope]
    scale_keys = [k for k in tuned if k in ("attention_factor", "mscale", "mscale_all_dim")]
    if kind == "yarn" and scale_keys and runtime == "llama.cpp":
        return (f"rope_type yarn with {', '.join(scale_keys)}: llama.cpp scales yarn attention by its default "
                f"0.1 ln(factor) + 1 whatever the GGUF says; transformers by the attention factor these give")
    if kind == "yarn" and tuned and runtime in ("vLLM", "ExLlamaV2"):
        reads = "reads factor and original_max_position_embeddings only" if runtime == "ExLlamaV2" else \
            "reads attn_factor, not attention_factor (nor mscale)"
        if runtime == "ExLlamaV2" or scale_keys:
            return f"rope_type yarn with {', '.join(tuned)}: its yarn {reads}, so its rotation or scale differs"
    if kind == "yarn" and runtime == "ExLlamaV2" and limit and original and limit <= original:
        return (f"rope_type yarn: it applies yarn only when max_seq_len (default max_position_embeddings, {limit}) "
                f"exceeds original_max_position_embeddings ({original}), and rotates unscaled otherwise; load it "
                f"with a longer max_seq_len")
    return None


def _number(value) -> Optional[float]:
    """`value` if it is a real number (not a bool), else None: hostile configs are `config_checks`' to report."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
