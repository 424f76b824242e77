"""Checks of a source model's ``config.json`` on its own: value types and bounds, and side files.

A config.json edited by hand or half-downloaded must not build a broken model with exit 0:

- `value_problems`: types and bounds (``tie_word_embeddings: "no"`` is not a boolean; sizes are
  positive integers of sane size, so ``num_hidden_layers: 1000000000`` is refused before anything
  loops over it; eps and rope theta are positive finite numbers; heads divide evenly; a rope dict has a type
  transformers knows, with the keys and numbers that type needs).
- `side_file_problems`: tokenizer and generation files that cannot be read, JSON ones that do not
  parse, a tokenizer.json the tokenizers library cannot load (they are copied into the output unchanged).

Checks of config.json against the tensors and of experts against the base are plan-time checks:
see `planning.source_checks`.

Every function returns all the problems it finds (empty when there are none); it reads config
values and header shapes only, never tensor bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moe_upcycle.checkpoint.lfs_pointers import lfs_pointer_problem
from moe_upcycle.checkpoint.names import tokenizer_files
from moe_upcycle.errors import reraise_if_out_of_memory
from moe_upcycle.inputs.paths import broken_link

# largest sane values: far above any released model, far below what makes the planner hang
SIZE_LIMITS = {
    "hidden_size": 2**17, "intermediate_size": 2**20, "num_hidden_layers": 2**12, "vocab_size": 2**24,
    "num_attention_heads": 2**12, "num_key_value_heads": 2**12, "head_dim": 2**12,
    "max_position_embeddings": 2**27,
}
OPTIONAL_INTS = ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_cache")
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")
ROPE_DICTS = ("rope_scaling", "rope_parameters")
# the keys without which transformers cannot compute each rope type's frequencies (its ROPE_INIT_FUNCTIONS plus
# "default"; a test checks every type here is one transformers knows)
ROPE_REQUIRED = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "proportional": (),  # transformers 5 only
}
# the number fields a rope type reads, each a positive finite number when given
ROPE_NUMBERS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "partial_rotary_factor")
# transformers' ACT2FN names (5.x); importing transformers to ask would cost seconds per run, and a
# test checks every name here is one transformers knows
ACTIVATIONS = frozenset({
    "gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
    "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu", "relu",
    "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu",
})
# a null here is copied into the MoE's config.json, which transformers 5 then refuses to load (its configs are typed:
# "Field 'max_position_embeddings' expected int, got NoneType"); the dense base does not load there either
NOT_NULL = ("rms_norm_eps", "hidden_act", "max_position_embeddings", "use_cache", "initializer_range",
            "attention_dropout", "max_window_layers", "use_sliding_window")
# the attention layer types the window logic reads (`planning.windows`), and Qwen3.5's Gated DeltaNet layers
# (`planning.hybrid`); transformers' families here use no other
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


def _token_ids(value: Any) -> bool:
    return _is_int(value) or isinstance(value, list) and all(_is_int(v) for v in value)


def _fraction(value: Any) -> bool:
    return is_number(value) and 0 <= value <= 1


# Fields read or copied into the output that the checks above do not cover, each with what it must be and the
# fix: (accepts a non-null value, what it must be, what to do). null is accepted unless the field is in NOT_NULL.
TYPED_FIELDS: dict[str, tuple[Any, str, str]] = {
    "torch_dtype": (lambda v: isinstance(v, str), 'a dtype name such as "bfloat16"',
                    "write the dtype the weights are stored in, or remove the key"),
    "dtype": (lambda v: isinstance(v, str), 'a dtype name such as "bfloat16"',
              "write the dtype the weights are stored in, or remove the key"),
    "architectures": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                      'a list of class names such as ["LlamaForCausalLM"]', "write the model's class name in a list"),
    # transformers 5 types bos and pad as one id (or null), eos as one or a list
    "pad_token_id": (lambda v: _is_int(v), "a token id (an integer)", "write the id, or null"),
    "bos_token_id": (lambda v: _is_int(v), "a token id (an integer)", "write the id, or null"),
    "eos_token_id": (_token_ids, "a token id (an integer) or a list of them", "write the id(s), or null"),
    "initializer_range": (lambda v: isinstance(v, float) and is_number(v) and v >= 0, "a decimal number >= 0 such "
                          "as 0.02", "write the model's value with its decimal point (transformers 5 refuses an "
                          "integer here), or remove the key"),
    "attention_dropout": (_fraction, "a number from 0 to 1 such as 0.0", "write 0.0 (no dropout), or remove the key"),
    "partial_rotary_factor": (lambda v: is_number(v) and 0 < v <= 1, "a number above 0 and at most 1",
                              "write the fraction of each head the rotary embedding turns, or remove the key"),
    "original_max_position_embeddings": (lambda v: _is_int(v) and v > 0, "a positive integer",
                                         "write the context length the model was pretrained with, or remove the key"),
    "sliding_window": (lambda v: _is_int(v) and v >= 0, "a number of tokens (an integer >= 0)",
                       "write the window the model was trained with, or null for none"),
    "max_window_layers": (lambda v: _is_int(v) and v >= 0, "a layer count (an integer >= 0)",
                          "write the model's value, or remove the key"),
    "use_sliding_window": (lambda v: isinstance(v, bool), "true or false", "write true or false"),
    # which weight file transformers loads; `weight_files.choose_weights` checks the file against the folder
    "transformers_weights": (lambda v: isinstance(v, str), 'a file name such as "model.safetensors"',
                             "fix or remove the field"),
    "layer_types": (lambda v: isinstance(v, list) and all(isinstance(t, str) and t in LAYER_TYPES for t in v),
                    f"a list of {' or '.join(repr(t) for t in LAYER_TYPES)}, one per layer",
                    "write the model's list, or remove the key"),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def value_problems(config: dict) -> list[str]:
    """Types and bounds of the fields moe-upcycle reads (required int fields are checked by `source`)."""
    out = []
    quant = config.get("quantization_config")
    if quant is not None:  # packed integer or fp8 weights, plus scales: not a dense model's tensors
        method = quant.get("quant_method", "a quantization") if isinstance(quant, dict) else "a quantization"
        out.append(f"quantization_config says the weights are quantized ({method}); moe-upcycle reads unquantized "
                   f"weights: upcycle the model's unquantized (bf16, fp16 or fp32) release")
    if config.get("num_attention_heads") is None:  # every supported family needs it (head_dim, attention shapes)
        out.append("num_attention_heads is missing; the attention layout cannot be known without it")
    for key, limit in SIZE_LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if key in OPTIONAL_INTS and not (_is_int(value) and value > 0):
            out.append(f"{key} must be a positive integer, got {value!r}; write the model's {key} as a JSON integer "
                       f"(its original config.json has it)")
        elif _is_int(value) and value > limit:
            out.append(f"{key} is {value}, more than {limit} (the largest this tool accepts); the file is "
                       f"damaged or was edited by mistake")
    for key in BOOL_FIELDS:
        if key in config and config[key] is not None and not isinstance(config[key], bool):
            out.append(f"{key} must be true or false, got {config[key]!r}; write true or false (JSON booleans, not "
                       f"text or numbers)")
    out += [f"{key} is null; give a value or remove the key" for key in NOT_NULL
            if key in config and config[key] is None]
    for key in POSITIVE_FLOATS:
        if key in config and config[key] is not None and not (is_number(config[key]) and config[key] > 0):
            out.append(f"{key} must be a positive finite number, got {config[key]!r}; write the model's value as a "
                       f"JSON number (e.g. {'1e-05' if key == 'rms_norm_eps' else '10000.0'})")
    eps = config.get("rms_norm_eps")
    if is_number(eps) and eps >= 1:
        out.append(f"rms_norm_eps is {eps}; a norm epsilon is a small number such as 1e-5 or 1e-6")
    for key in ROPE_DICTS:
        if config.get(key) is not None and not isinstance(config[key], dict):
            out.append(f"{key} must be an object (or null), got {config[key]!r}; write an object such as "
                       f"{{\"rope_type\": \"linear\", \"factor\": 2.0}}, or null for none")
    out += [problem for key in ROPE_DICTS if isinstance(config.get(key), dict)
            for problem in rope_problems(key, config[key], config)]
    params = config.get("rope_parameters")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is not None and not (is_number(theta) and theta > 0):
        out.append(f"rope_parameters.rope_theta must be a positive finite number, got {theta!r}")
    # one theta spelled in several places must be one value: transformers 4 reads the top-level field, 5 the one
    # in rope_parameters, so a config where they differ computes one model in 4.x and another in 5.x
    thetas = {where: value for where, value in (
        ("rope_theta", config.get("rope_theta")),
        ("rope_scaling.rope_theta", (config.get("rope_scaling") or {}).get("rope_theta")
         if isinstance(config.get("rope_scaling"), dict) else None),
        ("rope_parameters.rope_theta", theta)) if is_number(value)}
    if len({float(v) for v in thetas.values()}) > 1:
        said = ", ".join(f"{where} {value}" for where, value in thetas.items())
        out.append(f"rope_theta is given {len(thetas)} times with different values ({said}); transformers 4 reads "
                   f"rope_theta and transformers 5 rope_parameters, so the model computes differently in each — "
                   f"keep the value it was trained with in every place")
    act = config.get("hidden_act")
    if act is not None and not isinstance(act, str):
        out.append(f"hidden_act must be a string such as \"silu\", got {act!r}; write the activation's name")
    elif isinstance(act, str) and act not in ACTIVATIONS:
        out.append(f"hidden_act {act!r} is not an activation transformers knows; the MoE would not load "
                   f"(known: {', '.join(sorted(ACTIVATIONS))})")
    for key, (accepts, expected, fix) in TYPED_FIELDS.items():
        value = config.get(key)
        if value is not None and not accepts(value):
            out.append(f"{key} must be {expected}, got {_short(value)}; {fix}")
    types, layers = config.get("layer_types"), config.get("num_hidden_layers")
    if isinstance(types, list) and _is_int(layers) and len(types) != layers:
        out.append(f"layer_types lists {len(types)} layers but num_hidden_layers is {layers}; give one type per layer "
                   f"(transformers refuses this config too)")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if _is_int(heads) and heads > 0 and _is_int(kv) and kv > 0 and heads % kv:
        out.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}; write the model's own "
                   f"counts (each key-value head serves the same number of query heads)")
    hidden = config.get("hidden_size")
    if _is_int(heads) and heads > 0 and config.get("head_dim") is None and _is_int(hidden) and hidden % heads:
        out.append(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and there is no "
                   f"head_dim; add the model's head_dim")
    return out


def rope_problems(key: str, rope: dict, config: dict) -> list[str]:
    """A rope dict transformers cannot build the rotary embedding from: an unknown type, a missing key, a number
    that is not one, longrope factors of the wrong length (each one a model that does not load, or crashes at its
    first forward pass)."""
    if not rope:
        return []
    # any key: the dict is copied into the MoE's config.json, where NaN or Infinity is not JSON a loader reads
    endless = [name for name, value in rope.items() if isinstance(value, float) and not math.isfinite(value)]
    if endless:
        return [f"{key}.{name} is {rope[name]}, not a finite number; write the model's value, or remove the key"
                for name in endless]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str):
        return [f"{key}.rope_type must be the name of a rope type such as \"linear\", got {_short(kind)}; write one of "
                f"{', '.join(ROPE_REQUIRED)}"]
    if kind not in ROPE_REQUIRED:
        return [f"{key}.rope_type {kind!r} is not a rope type transformers knows; the MoE would not load "
                f"(known: {', '.join(ROPE_REQUIRED)})"]
    out = [f"{key}: rope_type {kind!r} needs {need!r}, which is missing; the MoE would not load — add the model's "
           f"value" for need in ROPE_REQUIRED[kind] if rope.get(need) is None]
    out += [f"{key}.{name} must be a positive finite number, got {_short(rope[name])}; write the model's value as a "
            f"JSON number" for name in ROPE_NUMBERS
            if rope.get(name) is not None and not (is_number(rope[name]) and rope[name] > 0)]
    if kind == "longrope":
        heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
        head_dim = config.get("head_dim") or (hidden // heads if _is_int(hidden) and _is_int(heads) and heads else None)
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        want = int(head_dim * partial) // 2 if _is_int(head_dim) and is_number(partial) else None
        for name in ("short_factor", "long_factor"):
            value = rope.get(name)
            if value is None:
                continue
            if not (isinstance(value, list) and all(is_number(x) for x in value)):
                out.append(f"{key}.{name} must be a list of numbers, got {_short(value)}; write the model's list")
            elif want is not None and len(value) != want:
                out.append(f"{key}.{name} has {len(value)} numbers; the rotary dimension needs {want} "
                           f"(half the rotated head dimension): write the model's list")
    return out


def _short(value: Any) -> str:
    """A config value as a message shows it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# every config.json field the checks above give a type: what `dense_config` guarantees to the stages
CHECKED_FIELDS = frozenset({"model_type", *SIZE_LIMITS, *BOOL_FIELDS, *NOT_NULL, *POSITIVE_FLOATS, *ROPE_DICTS,
                            *TYPED_FIELDS, "quantization_config"})


# JSON files copied byte for byte into the MoE (see `model_files.TOKENIZER_FILES`)
SIDE_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "chat_template.json", "generation_config.json")


def side_file_problems(folder: Path) -> list[str]:
    """Tokenizer and generation files that cannot be read, or JSON ones truncated or not JSON objects.

    They are copied unchanged into the output, so a half-downloaded one would ship a model that
    loads its weights but not its tokenizer; better to say so before building.
    """
    out = []
    for name in tokenizer_files(folder):
        file = folder / name
        link = broken_link(file)
        if link:
            out.append(f"{file}: {link}; the MoE would have no {name} (it is copied from here) — download the "
                       f"model again, or copy the files the links point to")
            continue
        if not file.is_file():
            continue
        pointer = lfs_pointer_problem(file)  # copied unchanged: a pointer would ship a tokenizer that cannot load
        if pointer:
            out.append(pointer)
            continue
        try:
            raw = file.read_bytes() if name in SIDE_JSON_FILES else None
            if raw is None:
                open(file, "rb").close()  # copied at the very end: find out now that it cannot be read
                continue
        except OSError as exc:
            out.append(f"{file}: cannot read it ({exc.strerror or exc}); it is copied into the MoE, so make it "
                       f"readable by you")
            continue
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            out.append(f"{file}: not valid JSON ({str(exc)[:120]}); the file is damaged or truncated — re-download it")
            continue
        if not isinstance(data, dict):
            out.append(f"{file}: expected a JSON object, got {type(data).__name__}; re-download it")
        elif name == "tokenizer.json":
            out += _tokenizer_problems(file, raw)
    return out


def _tokenizer_problems(file: Path, raw: bytes) -> list[str]:
    """tokenizer.json that the tokenizers library (behind AutoTokenizer) cannot build a tokenizer from."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # transformers brings it; without it nothing here could load the output anyway
        return []
    try:
        Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - the Rust library's error types
        reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
        return [f"{file}: not a tokenizer the tokenizers library can read ({str(exc)[:160]}); it is copied into the "
                f"MoE, whose tokenizer would not load — re-download it"]
    return []
