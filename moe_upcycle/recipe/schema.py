"""The YAML config schema (pydantic) and its loader.

Accepts mergekit-moe configs unchanged (`base_model`, `architecture`, `gate_mode`, `dtype`,
`experts_per_token`, `experts[]`, `shared_experts`) plus moe-upcycle's own keys (`num_experts`,
`tensor_policy`, `seed`, `output`, `max_shard_size`, ...). Every problem is reported at once with
its YAML path, e.g. ``experts[2].positve_prompts: unknown key — did you mean positive_prompts?``.
mergekit's spellings (null or empty prompts, ``Mixtral``/``qwen``/``Qwen3 MoE``, ``torch.bfloat16``)
are normalised here; which unknown keys are errors and which may be ignored is `unknown_keys`' rule.

This module checks the config on its own; checks against the checkpoints live in `plan`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from moe_upcycle.recipe import prompt_sets
from moe_upcycle.recipe.gate_keys import unread_gate_keys
from moe_upcycle.recipe.layer_choice import LayerChoice, check_value
from moe_upcycle.recipe.mergekit_names import MERGE_CONFIG_KEYS, drop_base_tokenizer
from moe_upcycle.recipe.strict_model import StrictModel
from moe_upcycle.recipe.params import PROMPT_MODES, mode_said
from moe_upcycle.errors import ConfigError
from moe_upcycle.recipe.unknown_keys import drop_repeated_keys, drop_unknown_keys, intended_key, key_elsewhere, model_in
from moe_upcycle.recipe.yaml_load import load_recipe_yaml
from moe_upcycle.recipe.values import device_problem, not_whole, short_repr
from moe_upcycle.inputs.paths import denied
from moe_upcycle.inputs.text import unicode_problem

GateMode = Literal[
    "hidden", "hidden_avg", "hidden_last", "kmeans", "cheap_embed", "random", "uniform_random", "uniform"
]
DType = Literal["float32", "float16", "bfloat16"]
TensorPolicy = Literal["share", "clone"]
InitMethod = Literal["copy", "noise", "drop", "split"]
Quantize = Literal["4bit", "8bit"]
# mergekit-moe's names ("qwen", "deepseek") are accepted so its configs parse; `arch` says what it supports.
# Spellings (any case, "Qwen MoE", "qwen3", ...) are mapped onto these by `mergekit_names.architecture_name`.
Architecture = Literal["mixtral", "qwen", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "granitemoeshared",
                       "ernie4_5_moe", "deepseek", "glm4_moe"]
# "native": our router inputs (hidden_gates); "mergekit": mergekit-moe 0.1.5's computation (mergekit_gates)
GateSource = Literal["native", "mergekit"]
Layout = Literal["per_expert", "fused"]
AttentionFrom = Literal["base", "average"]
SharedExpertGate = Literal["constant", "prompts"]

_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                  "single": "float32"}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
MAX_SHARD_BYTES_LIMIT = 2**40  # 1 TiB: anything larger is certainly a typo
MIN_SHARD_BYTES = 1000  # a bare "5" meant 5GB, not 5 bytes
# Bounds on scales: beyond them the weights overflow (router_init_std: 1e39 wrote Inf routers in
# float32, noise scale 1e6 Inf experts in float16) or every router logit saturates; no recipe needs more.
MAX_NOISE = 10.0  # noise std, relative to a matrix's std (10x the weights themselves) or absolute
MAX_SCALE = 100.0  # router_init_std, gate_scale (default 16/sqrt(hidden)), |residual_scale|
# output_router_logits: true would be written into config.json, which transformers reads at inference too
# (`planning.model_config.TRAINING_SWITCHES`): a published model must carry false
ROUTER_LOGITS_REFUSAL = (
    "output_router_logits: true would be written into the output's config.json, which transformers reads at "
    "inference too: it then adds the router aux loss in every forward pass, and generate fails on a batch of "
    "prompts of different lengths (in transformers 4.57 on any prompt), so the model could not be published as "
    "built. It is a training switch: remove the key (the output says false) and ask for router logits where you "
    "train: model(**batch, labels=..., output_router_logits=True), or "
    "AutoModelForCausalLM.from_pretrained(OUT, output_router_logits=True) for a training run (set "
    "model.config.output_router_logits = False before save_pretrained)")


def parse_size(value: Union[int, str]) -> int:
    """Parse a byte size such as ``5GB``, ``500MiB`` or ``1000000``.

    Example:
        >>> parse_size("5GB")
        5000000000

    Raises:
        ValueError: the value is not a whole number of bytes from 1000 to 1 TiB.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size such as 5GB or a number of bytes")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} is not a size; write e.g. 5GB, 500MB or a number of bytes")
    if isinstance(value, (int, float)):
        if value != int(value):  # a bare 1.9 is no number of bytes (1.9GB was meant?)
            raise ValueError(f"{value!r} is not a whole number of bytes; write a size with its unit, e.g. "
                             f"{value}GB or 500MB")
        size = int(value)
    else:
        # 1e9 too: YAML 1.1 reads an exponent without a dot as text, and a shell passes it as text
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:E[+]?[0-9]{1,2})?)\s*([KMGT]?I?B?)\s*", str(value).upper())
        if not m:
            raise ValueError(f"{value!r} is not a size; write e.g. 5GB, 500MB or a number of bytes")
        if m.group(2) in ("", "B") and not float(m.group(1)).is_integer():
            raise ValueError(f"{value!r} is not a whole number of bytes; write a size with its unit, e.g. "
                             f"{m.group(1)}GB or 500MB")
        size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if size <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    if size < MIN_SHARD_BYTES:
        number = re.match(r"\s*[0-9.]*", str(value)).group().strip() or "5"  # 1B (one byte) meant as 1GB
        raise ValueError(f"{value!r} is {size} bytes, smaller than any weight matrix; write a size with its "
                         f"unit, e.g. {number}GB")
    if size > MAX_SHARD_BYTES_LIMIT:
        raise ValueError(f"{value!r} is larger than 1 TiB; write e.g. 5GB")
    return size


_Strict = StrictModel  # the base of every mapping below (`strict_model`)


class ExpertInit(_Strict):
    """How an expert's FFN is initialised from its source (`expert_init:`; the math is in `inits`).

    ``expert_init: copy`` is shorthand for ``{method: copy}``. Fields that a method does not use
    are rejected, so ``{method: drop, scale: 0.1}`` fails instead of being silently ignored.
    """

    method: InitMethod = "copy"
    # noise: std relative to the matrix's std (or absolute); MAX_NOISE bounds it: larger only overflows
    scale: Optional[float] = Field(default=None, gt=0, le=MAX_NOISE)
    absolute: bool = False  # noise: `scale` is the absolute std (mergekit's noise_scale)
    ratio: Optional[float] = Field(default=None, gt=0, le=1)  # drop: fraction of neurons re-initialised
    granularity: Optional[int] = Field(default=None, ge=2, le=64)  # split: slices per FFN
    shuffle: bool = False  # split: seeded permutation of the intermediate dimension first

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"method": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fields_fit_method(self) -> "ExpertInit":
        used = {"noise": {"scale", "absolute"}, "drop": {"ratio"}, "split": {"granularity", "shuffle"}}
        # a key at its default value (as in a recorded recipe) is harmless; a set value is not
        given = {k for k in self.model_fields_set
                 if k != "method" and getattr(self, k) != type(self).model_fields[k].default}
        problems = [f"{k} is not used by method {self.method}; remove it" for k in sorted(given - used.get(self.method, set()))]
        if self.method == "noise" and self.scale is None:
            problems.append("method noise needs scale (e.g. scale: 0.01, relative to each matrix's std)")
        if self.method == "split" and self.granularity is None:
            problems.append("method split needs granularity (e.g. granularity: 2)")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ExpertConfig(_Strict):
    """One expert slot: whose FFN it gets and the prompts that route to it."""

    source_model: str = Field(min_length=1)
    name: Optional[str] = None
    # mergekit accepts `positive_prompts:` left empty (null) and [""] (the empty prompt: the BOS token alone)
    positive_prompts: list[str] = Field(default_factory=list)
    negative_prompts: list[str] = Field(default_factory=list)
    noise_scale: Optional[float] = Field(default=None, ge=0, le=MAX_NOISE)
    residual_scale: Optional[float] = Field(default=None, ge=-MAX_SCALE, le=MAX_SCALE)
    expert_init: Optional[ExpertInit] = None  # overrides the config's expert_init for this expert
    # [start, end): this expert's FFN for output layer l is the source's layer start + l
    layers: Optional[tuple[int, int]] = None

    @field_validator("layers")
    @classmethod
    def _layer_range(cls, layers: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise ValueError(f"{list(layers)} is not a layer range; write [start, end) with 0 <= start < end, "
                             f"e.g. [0, 24]")
        return layers
    # a shipped prompt-set name (gate_configs/prompts) or a prompt file, added to the listed prompts
    positive_prompts_from: Optional[str] = None
    negative_prompts_from: Optional[str] = None

    @field_validator("source_model", mode="before")
    @classmethod
    def _mergekit_reference(cls, value: Any) -> Any:
        from moe_upcycle.recipe.mergekit_names import model_reference

        return model_reference(value)

    @field_validator("positive_prompts", "negative_prompts", mode="before")
    @classmethod
    def _null_is_empty(cls, prompts: Any) -> Any:
        if prompts is None:
            return []
        problems = []
        for i, p in enumerate(prompts if isinstance(prompts, list) else []):
            if p is None:
                problems.append(f"prompt {i} is empty (a bare '-' line, which YAML reads as null); write \"\" for "
                                f"the empty prompt or remove the line; a prompt that starts with # goes in quotes "
                                f"(YAML reads '- #...' as a '-' line and a comment)")
            elif isinstance(p, dict):
                shown = ", ".join(f"{k}: {v}" for k, v in p.items())
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                problems.append(f"prompt {i} is the mapping {{{shown}}}: YAML reads 'word: text' as a key and "
                                f"its value; put the prompt in quotes")
            elif isinstance(p, list):
                problems.append(f"prompt {i} is a list: YAML reads [...] as a list; put the prompt in quotes")
            elif isinstance(p, (bool, int, float)):
                shown, kind = (str(p).lower(), "boolean") if isinstance(p, bool) else (repr(p), "number")
                problems.append(f"prompt {i} is {shown}, which YAML read as a {kind}, not text (unquoted yes, no, "
                                f"on, off, true, false and numbers are not strings); put the prompt in quotes")
            elif isinstance(p, (datetime.date, bytes)):
                problems.append(f"prompt {i} is {short_repr(p)}, not text; put the prompt in quotes")
        problems += _split_curly_quotes(prompts if isinstance(prompts, list) else [])
        if problems:
            raise ValueError("\n".join(problems))
        return prompts

    @field_validator("positive_prompts", "negative_prompts")
    @classmethod
    def _valid_unicode(cls, prompts: list[str]) -> list[str]:
        for i, p in enumerate(prompts):
            if unicode_problem(p):
                raise ValueError(f"prompt {i} {unicode_problem(p)}")
        return prompts

    @field_validator("positive_prompts_from", "negative_prompts_from")
    @classmethod
    def _known_prompt_source(cls, ref: Optional[str]) -> Optional[str]:
        if ref is not None:
            prompt_sets.resolve_reference(ref)
        return ref

    def with_prompt_sets(self, where: str) -> "ExpertConfig":
        """A copy whose prompt lists include the prompts of `*_prompts_from` (listed ones first)."""
        update = {}
        for kind in ("positive", "negative"):
            ref = getattr(self, f"{kind}_prompts_from")
            if ref is not None:
                extra = prompt_sets.load_prompts(ref, f"{where}.{kind}_prompts_from")
                update[f"{kind}_prompts"] = list(getattr(self, f"{kind}_prompts")) + extra
        return self.model_copy(update=update) if update else self


class SharedExpertConfig(ExpertConfig):
    """A shared (always active) expert, as in mergekit-moe's `shared_experts` (qwen2_moe)."""


class UpcycleConfig(_Strict):
    """The whole build recipe. See README "Config reference" for every key."""

    base_model: str = Field(min_length=1)
    experts: list[ExpertConfig] = Field(default_factory=list, max_length=1024)
    num_experts: Optional[int] = Field(default=None, ge=1, le=1024)
    architecture: Optional[Architecture] = None
    gate_mode: GateMode = "hidden"  # left out: chosen by the recipe (`_default_gate_mode`): hidden or random
    gate_source: GateSource = "native"
    dtype: Optional[DType] = None
    experts_per_token: int = Field(default=2, ge=1, le=1024)
    shared_experts: list[SharedExpertConfig] = Field(default_factory=list, max_length=64)
    tensor_policy: TensorPolicy = "share"
    seed: int = Field(default=0, ge=0, le=2**64 - 1)  # torch generators take unsigned 64-bit seeds
    output: Optional[str] = None
    max_shard_size: int = 5 * 10**9
    checksums: bool = True  # sha256 of every output file in moe_upcycle.json (shards hashed while written)
    router_aux_loss_coef: Optional[float] = Field(default=None, ge=0)
    router_init_std: float = Field(default=0.02, gt=0, le=MAX_SCALE)
    gate_scale: Optional[float] = Field(default=None, gt=0, le=MAX_SCALE)
    expert_init: ExpertInit = Field(default_factory=ExpertInit)
    router_jitter_noise: float = Field(default=0.0, ge=0, lt=1)
    output_router_logits: bool = False
    report_init_drift: Optional[bool] = None  # None: measure for non-copy inits of outputs up to 2 GB (drift.py)
    layout: Layout = "per_expert"
    attention_from: AttentionFrom = "base"
    shared_expert_gate: Optional[SharedExpertGate] = None
    # hidden-state gate modes (see hidden_gates)
    gate_center: bool = False
    calibration_text: Optional[str] = None
    batch_size: int = Field(default=8, ge=1, le=65536)
    device: str = "auto"
    gate_dtype: Optional[DType] = None
    quantize: Optional[Quantize] = None
    # which layers become MoE layers (`layer_choice`); None: every layer. The others keep the dense MLP.
    moe_layers: Optional[LayerChoice] = None
    # Qwen-MoE outputs: renormalise the top-k router weights (default true, what keeps copies exact); false is
    # Qwen1.5-MoE's setting and what llama.cpp's qwen2moe always computes
    norm_topk_prob: Optional[bool] = None

    @field_validator("base_model", mode="before")
    @classmethod
    def _mergekit_reference(cls, value: Any) -> Any:
        from moe_upcycle.recipe.mergekit_names import model_reference

        return model_reference(value)

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if device_problem(value):
            raise ValueError(device_problem(value))
        return value

    @field_validator("dtype", "gate_dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        name = value.strip().lower().removeprefix("torch.")  # mergekit also reads "torch.bfloat16"
        if name in ("float64", "double", "fp64"):
            raise ValueError(f"{value!r} is not an output dtype here: mergekit-moe writes float64 at twice "
                             f"float32's size, with nothing gained for a model that runs in 16 or 32 bits; use float32")
        return _DTYPE_ALIASES.get(name, name) if name else None

    @field_validator("architecture", mode="before")
    @classmethod
    def _architecture_name(cls, value: Any) -> Any:
        from moe_upcycle.recipe.mergekit_names import architecture_name

        return architecture_name(value) if isinstance(value, str) else value

    @field_validator("moe_layers", mode="before")
    @classmethod
    def _layer_choice(cls, value: Any) -> Any:
        return check_value(value)

    @field_validator("shared_experts", mode="before")
    @classmethod
    def _null_is_no_shared(cls, value: Any) -> Any:
        return [] if value is None else value

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)

    @model_validator(mode="after")
    def _default_gate_mode(self) -> "UpcycleConfig":
        """A recipe without ``gate_mode`` gets the mode its experts can use: ``hidden`` (mergekit-moe's default)
        when any routed expert has prompts, ``random`` when none has any (``num_experts`` copies, or experts
        listed without prompts): the simplest recipe, ``base_model`` and ``num_experts``, then builds."""
        if "gate_mode" not in self.model_fields_set:  # frozen: set once, here, as pydantic set the given fields
            object.__setattr__(self, "gate_mode", "hidden" if self.experts_have_prompts else "random")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "UpcycleConfig":
        problems = []
        if self.num_experts is not None and self.experts:
            problems.append("num_experts and experts are both given; use num_experts for N copies of "
                            "base_model, or list experts, not both")
        if self.num_experts is None and not self.experts:
            problems.append("no experts: give num_experts: N (N copies of base_model) or an experts: list")
        n = self.expert_count
        if n and self.experts_per_token > n:
            problems.append(f"experts_per_token is {self.experts_per_token} but there are only {n} experts; "
                            f"use a value from 1 to {n}")
        names = [e.name for e in self.experts if e.name]
        dupes = sorted({x for x in names if names.count(x) > 1})
        if dupes:
            problems.append(f"experts: duplicate expert names {dupes}; give each expert its own name")
        # an unnamed expert is called expert_<i> (the card, route, lint): a name given to another one must differ
        for i, e in enumerate(self.experts):
            default = f"expert_{i}"
            if not e.name and default in names:
                problems.append(f"experts[{i}] has no name, so it is called {default}, the name another expert is "
                                f"given; name experts[{i}] (name: ...) or rename the other")
        for i, e in enumerate(self.experts):
            if e.expert_init is not None and e.expert_init.method == "split":
                problems.append(f"experts[{i}].expert_init: split changes every expert's shape, so it is set once "
                                f"for the whole model; move it to the top-level expert_init")
            elif (e.expert_init is not None or e.noise_scale) and self.expert_init.method == "split":
                key = "expert_init" if e.expert_init is not None else "noise_scale"
                problems.append(f"experts[{i}].{key}: cannot be combined with the top-level "
                                f"expert_init: split; remove one of them")
            if e.expert_init is not None and e.noise_scale:
                problems.append(f"experts[{i}]: noise_scale and expert_init are both given; noise_scale: s is "
                                f"expert_init: {{method: noise, scale: s, absolute: true}}, keep one")
        if self.shared_expert_gate == "prompts":
            problems += [f"shared_experts[{i}].positive_prompts: shared_expert_gate: prompts needs at least one "
                         f"prompt; add prompts or use shared_expert_gate: constant"
                         for i, e in enumerate(self.shared_experts) if not e.positive_prompts]
        if self.gate_source == "mergekit" and self.gate_mode in ("kmeans", "uniform"):
            problems.append(f"gate_source: mergekit reproduces mergekit-moe's gate modes, and gate_mode "
                            f"{self.gate_mode} is not one of them; use gate_source: native, or gate_mode hidden, "
                            f"hidden_avg, hidden_last, cheap_embed, random or uniform_random")
        if self.output_router_logits:
            problems.append(ROUTER_LOGITS_REFUSAL)
        problems += unread_gate_keys(self)
        if self.gate_mode == "kmeans" and self.calibration_text is None:
            problems.append("gate_mode kmeans needs calibration_text: a .txt/.jsonl file or a folder of them")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def same_prompts_problem(self) -> Optional[str]:
        """mergekit-moe's refusal of experts that all have the same prompts, for the modes that route on prompts.

        Every expert then gets the same router row, so the router scores them all alike for every token
        and cannot choose between them (published 8x copies with ``[""]`` each do this). Checked by
        `plan` and `build`, not by loading: `prompts grow` is how such a config gets its prompts.
        """
        if self.gate_mode not in PROMPT_MODES or len(self.experts) < 2:
            return None
        first = self.experts[0]
        if not (first.positive_prompts or first.positive_prompts_from):
            return None  # no prompts at all: the gate stage names each expert that needs some
        key = lambda e: (e.positive_prompts, e.negative_prompts, e.positive_prompts_from, e.negative_prompts_from)
        if any(key(e) != key(first) for e in self.experts[1:]):
            return None
        shown = short_repr(first.positive_prompts if len(first.positive_prompts) != 1 else first.positive_prompts[0])
        fix = ("give each expert prompts for the text it should handle (moe-upcycle prompts grow can pick them "
               "from a pool), or use gate_mode: random or uniform_random to train the router")
        if all(e.source_model == first.source_model for e in self.experts):
            fix += (f"; for {len(self.experts)} copies of one model to train, write num_experts: {len(self.experts)} "
                    f"with gate_mode: random instead of the experts list")
        return (f"experts: every expert has the same prompts (positive_prompts: {shown}), so gate_mode "
                f"{self.gate_mode_said} gives every expert the same router row and the router scores them all alike "
                f"for every token: it cannot choose between them (mergekit-moe refuses this too); {fix}")

    @property
    def experts_have_prompts(self) -> bool:
        """Whether any routed expert lists positive prompts (or a set or file of them)."""
        return any(e.positive_prompts or e.positive_prompts_from for e in self.experts)

    @property
    def gate_mode_default(self) -> str:
        """Why `gate_mode` is what it is when the recipe leaves it out ("" when the recipe gives it)."""
        if "gate_mode" in self.model_fields_set:
            return ""
        return ("the default when experts have prompts" if self.gate_mode == "hidden" else
                "the default for copies without prompts" if self.num_experts is not None else
                "the default when no expert has prompts")

    @property
    def gate_mode_said(self) -> str:
        """`gate_mode` as messages name it: ``hidden (the default when experts have prompts)`` when left out."""
        return mode_said(self.gate_mode, self.gate_mode_default)

    @property
    def expert_count(self) -> int:
        """Number of routed experts, whichever way they are given."""
        return self.num_experts if self.num_experts is not None else len(self.experts)

    def expert_list(self) -> list[ExpertConfig]:
        """The routed experts, expanding `num_experts: N` into N copies of `base_model`."""
        if self.num_experts is not None:
            return [ExpertConfig(source_model=self.base_model, name=f"expert_{i}") for i in range(self.num_experts)]
        return [(e if e.name else e.model_copy(update={"name": f"expert_{i}"})).with_prompt_sets(f"experts[{i}]")
                for i, e in enumerate(self.experts)]


# ---------------------------------------------------------------------------------------------
# Loading and error formatting


def load_config(source: Union[str, Path, Mapping], *, overrides: Optional[dict] = None,
                allow_unknown_keys: bool = False, unknown_option: Optional[str] = "--allow-unknown-keys",
                name: str = "config") -> UpcycleConfig:
    """Read and validate a config from a YAML file path or a dict.

    Args:
        source: path to a YAML file, or the already-parsed mapping.
        overrides: keys that replace the file's (CLI options); ``None`` values are ignored. A
            problem with one is reported as ``option KEY: ...``, not under the file's name.
        allow_unknown_keys: ignore genuinely unknown keys with a warning instead of refusing
            them (misspelt keys are errors either way; see `unknown_keys`).
        unknown_option: how the caller turns that on, for the unknown-key message (the CLI flag,
            ``allow_unknown_keys=True`` in Python); None where nothing does (`upcycle_model`).
        name: what a mapping is called in messages ("config", or the function that built it).

    Returns:
        The validated config.

    Raises:
        ConfigError: with every problem, each prefixed by its YAML path.
    """
    where = name
    if isinstance(source, Mapping):
        data = dict(source)
    elif not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config: expected the path of a YAML recipe, a mapping of its keys or an UpcycleConfig, "
                          f"not {type(source).__name__}")
    elif isinstance(source, str) and "\n" in source:
        raise ConfigError("config: got YAML text, not a file path; write it to a file, or pass "
                          "yaml.safe_load(text) (a mapping)")
    else:
        path = Path(source)
        where = str(path)
        if not path.is_file():
            if path.is_dir():
                model = (f" (a model folder: write a recipe that names it, e.g. base_model: {path}, num_experts: 4, "
                         f"gate_mode: random, and give the recipe's path)" if (path / "config.json").is_file() else "")
                raise ConfigError(f"{path}: is a folder, not a config file{model}; give the YAML recipe's path")
            if path.exists():
                raise ConfigError(f"{path}: is not a regular file (a device or a pipe); give the YAML recipe's path")
            if path.is_symlink():
                raise ConfigError(f"{path}: the config is a symbolic link that leads nowhere (a symlink loop or a "
                                  f"broken link); fix it")
            if str(source) == "-":
                raise ConfigError("-: the recipe is read from a file, not from standard input; write it to a file "
                                  "and give its path")
            raise ConfigError(f"{path}: config file not found")
        try:
            data = load_recipe_yaml(path)  # duplicate keys and alias bombs refused here
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark
            pos = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
            raise ConfigError(f"{path}{pos}: YAML syntax error: {exc.problem or exc}") from None
        except PermissionError as exc:  # mode 000, another user's file: theirs to fix, with who and what to check
            raise ConfigError(denied(exc) or str(exc)) from None
        except (yaml.YAMLError, UnicodeDecodeError, OSError, RecursionError) as exc:
            raise ConfigError(f"{path}: not a readable YAML file ({exc})") from None
    if not isinstance(data, dict):
        got = ("it is empty (or holds only comments or null)" if data is None else
               "got a list" if isinstance(data, list) else f"got a single value, {short_repr(data)}")
        raise ConfigError(f"{where}: the config must be a YAML mapping of keys (base_model:, experts:, ...); {got}")
    if "base_model" not in data and ("model_type" in data or "architectures" in data):
        raise ConfigError(f"{where}: this is a model's config.json (model_type {data.get('model_type')!r}), not a "
                          f"recipe; write a recipe that names the model's folder, e.g. base_model: "
                          f"{'FOLDER' if isinstance(source, Mapping) else Path(where).parent}, num_experts: 4, "
                          f"gate_mode: random")
    merge = [key for key in ("merge_method", "slices", "models") if key in data]
    if merge and "experts" not in data:  # a whole mergekit-yaml config: one headline, not a line per key
        method = f" (merge_method: {short_repr(data['merge_method'])})" if "merge_method" in data else ""
        raise ConfigError(f"{where}: this is a mergekit-yaml merge config{method}, with {' and '.join(merge)} but no "
                          f"experts:; it merges models into one dense model, which is mergekit-yaml's job — "
                          f"moe-upcycle builds a MoE from a mergekit-moe recipe: base_model: plus experts: "
                          f"[{{source_model: ..., positive_prompts: [...]}}, ...] (gate_configs/mergekit_style.yaml is one)")
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    data.update(given)
    odd = _non_string_keys(data, "")
    if odd:  # YAML reads `true:`, `null:` and `1:` as a boolean, None and a number; pydantic showed `true` as [1]
        raise ConfigError(*[f"{where}: {at}key {_yaml_key(k)} is not a name; keys are names such as base_model — "
                            f"fix it, or quote it if it is meant" for at, k in odd])
    data = drop_repeated_keys(drop_base_tokenizer(data), UpcycleConfig)
    if allow_unknown_keys:
        data = drop_unknown_keys(data, UpcycleConfig)
    try:
        return UpcycleConfig.model_validate(data)
    except ValidationError as exc:
        # a value from an option is named as the option (the command line's spelling beside the keyword's):
        # the user would not find it in the file
        raise ConfigError(*[_named(line, given, where) for line in _format_errors(exc, unknown_option, data)]) from None


def _named(line: str, given: dict, where: str) -> str:
    """``batch_size: 0 is too small`` → ``option batch_size (--batch-size): 0 is too small`` when the value came
    from an option or keyword, ``FILE: batch_size: 0 is too small`` when it came from the file."""
    key = re.match(r"[a-z_]*", line)[0]
    if key not in given:
        return f"{where}: {line}"
    flag = f" ({_BUILD_FLAGS[key]})" if key in _BUILD_FLAGS else ""
    return f"option {key}{flag}{line[len(key):]}"


# the build command's spelling of the keys it overrides (checksums and the policy are switches)
_BUILD_FLAGS = {"max_shard_size": "--max-shard-size", "batch_size": "--batch-size", "device": "--device",
                "checksums": "--checksums", "tensor_policy": "--clone-tensors/--share-tensors", "gate_source": "--mergekit"}


def _yaml_key(key: Any) -> str:
    """A non-string key as the user wrote it, and what YAML made of it."""
    if isinstance(key, bool):
        return f"{str(key).lower()} (YAML reads yes/no/on/off/true/false as a boolean)"
    if key is None:
        return "null (YAML reads an empty key, ~ or null as nothing)"
    kind = "number" if isinstance(key, (int, float)) else type(key).__name__
    return f"{short_repr(key)} (YAML reads it as a {kind})"


def _non_string_keys(value: Any, where: str) -> list[tuple[str, Any]]:
    """(YAML path prefix, key) for every mapping key that is not a string, anywhere in `value`."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                found.append((f"{where}: " if where else "", key))
            else:
                found += _non_string_keys(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _non_string_keys(item, f"{where}[{i}]")
    return found


def _format_errors(exc: ValidationError, unknown_option: Optional[str] = "--allow-unknown-keys",
                   top: Optional[dict] = None) -> list[str]:
    lines = []
    ignore = f", or pass {unknown_option} to ignore it with a warning" if unknown_option else ""
    for err in exc.errors():
        kind = err["type"]
        # drop pydantic's own location tags ("function-after[...]"); an unknown key is the user's, kept as is
        loc = [p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
        if kind == "extra_forbidden":
            loc = [p for p in err["loc"][:-1] if p in loc] + [err["loc"][-1]]
        path = _yaml_path(loc)
        if kind == "extra_forbidden":
            valid = _fields_at(loc[:-1])
            hint = intended_key(loc[-1], valid)
            # `yamlbase_model:`: a Markdown code block's language label copied onto the first key
            label = re.match(r"^(yaml|yml)(\w+)$", str(loc[-1]), re.IGNORECASE)
            label = label if label and label.group(2) in valid else None
            merge_key = MERGE_CONFIG_KEYS.get(str(loc[-1])) if len(loc) == 1 else None
            home = None if hint or merge_key or label else key_elsewhere(loc[-1], UpcycleConfig, loc[:-1])
            suggestion = (f" — the code block's {label.group(1)!r} label is glued to {label.group(2)}; write "
                          f"{label.group(2)}:" if label else
                          f" — did you mean {hint}?" if hint else
                          f" — {merge_key}; remove it{ignore}" if merge_key else
                          f" — the MoE has one {loc[-1]}, and the top level already says {loc[-1]}: "
                          f"{short_repr(top[loc[-1]])}; remove it here" if home == "at the top level" and top
                          and loc[-1] in top else
                          f" — it belongs {home}; move it there" if home else
                          f" — remove it{ignore}{' as mergekit-moe does' if unknown_option else ''}; valid keys: "
                          f"{', '.join(sorted(valid))}")
            lines.append(f"{path if str(loc[-1]).strip() else _yaml_path(loc[:-1] + [repr(loc[-1])])}: "
                         f"unknown key{suggestion}")
        elif err.get("input", 0) is None and loc and not isinstance(loc[-1], int) and kind != "missing":
            # `key:` with nothing after it is null to YAML; pydantic would say "Input should be a valid string"
            fix = (f"one of {err['ctx']['expected']}" if kind == "literal_error" else
                   "the model: org/name (a hub id) or a folder" if loc[-1] in ("base_model", "source_model") else
                   "a value")
            lines.append(f"{path}: empty (nothing after '{loc[-1]}:'); write {fix}"
                         f"{'' if loc[-1] in ('base_model', 'source_model') else ', or delete the line'}")
        elif loc and loc[-1] == "expert_init" and kind in ("model_type", "model_attributes_type", "dict_type"):
            lines.append(f"{path}: {short_repr(err['input'])} is not an init; write a method "
                         f"({', '.join(get_args(InitMethod))}) or a mapping such as {{method: drop, ratio: 0.5}}")
        elif "layers" in loc and kind != "value_error":
            at = loc.index("layers")
            item = (f"item {loc[at + 1]} is {_shown(err['input'])}, so it" if len(loc) > at + 1 and kind != "missing"
                    else _shown(err["input"]))
            line = (f"{_yaml_path(loc[:at + 1])}: {item} is not a layer range; write two whole numbers "
                    f"[start, end), e.g. [0, 24]")
            if line not in lines:
                lines.append(line)
        elif kind == "literal_error":
            guess = _close_choice(err["input"], re.findall(r"'([^']*)'", err["ctx"]["expected"]))
            lines.append(f"{path}: {short_repr(err['input'])} is not allowed; "
                         f"{f'did you mean {guess}? ' if guess else ''}expected {err['ctx']['expected']}")
        elif kind == "model_type" and path.startswith(("experts[", "shared_experts[")):
            value = err["input"]
            glued = re.match(r"^([A-Za-z_]+):(\S.*)$", value) if isinstance(value, str) else None
            if glued and glued.group(1) in ExpertConfig.model_fields:
                fix = (f"{short_repr(value)} has no space after the colon, so YAML reads it as one string, not a "
                       f"key; write - {glued.group(1)}: {glued.group(2)}")
            elif isinstance(value, str):
                fix = f"a bare string; write it as - source_model: {value}"
            elif value is None:
                fix = "empty (a bare '-' line); remove the line or give it source_model:"
            else:
                fix = f"{short_repr(value)}, not an expert; write - source_model: org/name (a mapping)"
            lines.append(f"{path}: {fix}")
        elif kind == "list_type":
            lines.append(f"{path}: {_not_a_list(err['input'], str(loc[-1]) if loc else path)}")
        elif kind == "string_too_short" and not str(err["input"]).strip():
            fix = ("the model: org/name (a hub id) or a folder" if loc and loc[-1] in ("base_model", "source_model")
                   else "a value, or delete the line")
            lines.append(f"{path}: empty text; write {fix}")
        elif kind == "finite_number":
            given = err["input"]  # a float, or text pydantic read as one ("NaN", "inf")
            shown = (repr(given) if isinstance(given, str) else '.nan' if given != given
                     else '.inf' if given > 0 else '-.inf')
            lines.append(f"{path}: {shown} (not a number, or infinity) is not a finite number; write an ordinary "
                         f"number")
        elif kind == "string_type":
            lines.append(f"{path}: {_not_text(err['input'], str(loc[-1]) if loc else path)}")
        elif kind == "missing":
            lines.append(f"{path}: required key is missing")
        elif kind in NUMBER_ERRORS:
            lines.append(f"{path}: {_not_a_number(err['input'], kind)}")
        elif kind in BOUND_WORDS:
            bound = next(iter(err["ctx"].values()))
            lines.append(f"{path}: {short_repr(err['input'])} is {BOUND_WORDS[kind]} {bound!r}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            lines += [f"{path}: {m}" if path else m for m in msg.split("\n")]
    return lines


BOUND_WORDS = {"greater_than": "too small; write more than", "greater_than_equal": "too small; write at least",
               "less_than": "too large; write less than", "less_than_equal": "too large; write at most"}
NUMBER_ERRORS = ("int_parsing", "int_from_float", "int_type", "float_parsing", "float_type")


def _not_a_number(value: Any, kind: str) -> str:
    """What is wrong with a value where a number goes, and what to write (pydantic says "Input should be ...").

    Example:
        >>> _not_a_number("1e3", "int_parsing")
        "'1e3' is text to YAML, which reads an exponent only with a dot (1.0e3); write 1000"
        >>> _not_a_number(2.5, "int_from_float")
        '2.5 is not a whole number; write an integer such as 2'
    """
    whole = kind.startswith("int")
    if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+(\.\d*)?[eE][-+]?\d+\s*", value):
        number = float(value)
        mantissa, exponent = re.split("[eE]", value.strip())
        shown = (f"{int(number)}" if whole and number.is_integer() and abs(number) < 1e18 else
                 f"{mantissa}{'' if '.' in mantissa else '.0'}e{exponent}")
        return f"{short_repr(value)} is text to YAML, which reads an exponent only with a dot (1.0e3); write {shown}"
    if isinstance(value, float) and whole:
        return not_whole(value)
    return f"{short_repr(value)} is not a number; write {'an integer such as 2' if whole else 'a number such as 0.5'}"


def _close_choice(value: Any, choices: list[str]) -> Optional[str]:
    """The allowed value that `value` misspells (``Random``, ``cheap-embed``, ``hidden_state``), if one is close."""
    import difflib

    if not isinstance(value, str) or not choices:
        return None
    norm = re.sub(r"[\s-]+", "_", value.strip().lower())
    if norm in choices:
        return norm
    reordered = [c for c in choices if sorted(c.split("_")) == sorted(norm.split("_"))]  # random_uniform
    prefixed = [c for c in choices if norm.startswith(c + "_")]  # hidden_state, hidden_states
    for found in (reordered, prefixed):
        if len(found) == 1:
            return found[0]
    close = difflib.get_close_matches(norm, choices, n=1, cutoff=0.75)
    return close[0] if close else None


def _not_a_list(value: Any, key: str) -> str:
    """Why a value that should be a list is not, and the list to write instead (mergekit-moe refuses these too)."""
    if isinstance(value, str) and key.endswith("_prompts"):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return (f"a single string {short_repr(value)}, not a list; write it as a one-item list: "
                f"{key}: [{json.dumps(shown, ensure_ascii=False)}] (mergekit-moe refuses a bare string too)")
    if key in ("experts", "shared_experts"):
        return (f"{short_repr(value)} is not a list of experts; write one '- source_model: ...' line per expert "
                f"(each a mapping), e.g. {key}: [{{source_model: org/model}}]")
    return f"{short_repr(value)} is not a list; write a list: one '- item' line each, or [a, b]"


def _shown(value: Any) -> str:
    """A short value as YAML flow text (``[1, "a"]``), a long one as `short_repr` says it."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return short_repr(value)
    return text if len(text) <= 40 else short_repr(value)


OPENING_QUOTES, CLOSING_QUOTES = "\u201c\u2018\u201e\u00ab", "\u201d\u2019\u00bb"


def _split_curly_quotes(prompts: list) -> list[str]:
    """Prompts that YAML split at a comma inside curly quotes: ``[“Write a poem, then a story”]`` (pasted from a
    web page or a word processor) is two prompts, ``“Write a poem`` and ``then a story”``; one problem per split.

    A whole prompt in curly quotes is left as written (mergekit-moe routes on it the same way).
    """
    out, start = [], None
    for i, p in enumerate(prompts):
        text = p.strip() if isinstance(p, str) else ""
        if start is None and text[:1] in OPENING_QUOTES and text[-1:] not in CLOSING_QUOTES:
            start = i
        elif start is not None and text[-1:] in CLOSING_QUOTES and text[:1] not in OPENING_QUOTES:
            joined = ", ".join(str(q).strip() for q in prompts[start:i + 1])
            shown = joined if len(joined) <= 60 else joined[:57] + "..."
            out.append(f"prompts {start} to {i} are one prompt in curly quotes, {shown}, that YAML split at its "
                       f"comma{'s' if i - start > 1 else ''}: curly quotes are not YAML quotes; write the prompt in "
                       f"straight quotes (\"...\")")
            start = None
    return out


def _not_text(value: Any, key: str) -> str:
    """Why a value that should be text (a model, a folder, a device) is not, and what to write.

    Example:
        >>> _not_text(0, "device")
        '0 is a number, not text; write a device: auto, cpu, cuda or cuda:N (cuda:0 for GPU 0)'
        >>> _not_text(2024, "output")
        "2024 is a number, not text; write it in quotes, output: '2024' (YAML reads an unquoted 2024 as a number)"
    """
    if isinstance(value, datetime.date):
        return f"{value.isoformat()} is a date to YAML, not text; write it in quotes, {key}: '{value.isoformat()}'"
    if isinstance(value, (bool, int, float)):
        what = "a boolean" if isinstance(value, bool) else "a number"
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        if key == "device":
            gpu = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            return (f"{shown} is {what}, not text; write a device: auto, cpu, cuda or cuda:N"
                    + (f" (cuda:{value} for GPU {value})" if gpu else ""))
        return (f"{shown} is {what}, not text; write it in quotes, {key}: '{shown}' (YAML reads an unquoted "
                f"{shown} as {what})")
    return f"{short_repr(value)}, not text; write one {'device' if key == 'device' else 'name or path'}"


def _yaml_path(loc: list) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(loc: list) -> list[str]:
    """Names of the fields valid at a YAML path (used for did-you-mean)."""
    model: Any = UpcycleConfig
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = model_in(field.annotation) if field else None
    return list(model.model_fields) if model else []
