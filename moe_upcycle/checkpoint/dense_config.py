"""The typed view of a dense model's config.json: every field moe-upcycle reads, checked once where it is read.

A config.json is a file anyone may have edited, and any field may hold any JSON type: ``"torch_dtype":
[]`` once stopped the planner with ``TypeError: unhashable type: 'list'``. `dense_config` is built
where a config is read (`source.read_config` for a folder, `in_memory` for a loaded model's
``model.config``) and checks every field the tool reads or copies into the output
(`config_checks.CHECKED_FIELDS`) before any stage sees it; a wrong type or bound is a `SourceError`
naming the file, the field, the value and the fix, every problem of the file at once.

The stages read the typed attributes (``base.hidden_size``, ``base.stated_dtypes`` ...). A field the
output's config.json copies as the base has it (``rms_norm_eps``, ``eos_token_id``, the rope dicts) is
read through the view's mapping interface, which returns the checked JSON value unchanged: the output
stays byte for byte what it was for valid inputs. It does not check config.json against the tensors
(`planning.source_checks`) or the experts against the base (`planning.compat`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional


from moe_upcycle.checkpoint.config_checks import value_problems
from moe_upcycle.dtypes import DTYPES
from moe_upcycle.errors import SourceError

REQUIRED_INT_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")  # a multimodal model's language model


@dataclass(frozen=True, eq=False)
class DenseConfig(Mapping):
    """A dense model's config.json, checked: typed attributes, and the JSON values as a read-only mapping.

    Attributes:
        raw: the JSON object as read (every field the tool reads has passed its check).
        where: names the file (or ``dense_model.config``) in messages.
        num_key_value_heads, head_dim: as transformers derives them when absent or null.
        tie_word_embeddings, attention_bias, mlp_bias: False when absent or null.
        hidden_act: ``silu`` when absent (every supported family's default).
        stated_dtypes: ``torch_dtype`` / ``dtype`` -> the dtype it names, for those naming one the tool writes.
        architectures: the class names config.json lists (empty when none).
    """

    raw: dict = field(repr=False)
    where: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    rms_norm_eps: Optional[float]
    max_position_embeddings: Optional[int]
    stated_dtypes: dict = field(default_factory=dict)
    architectures: tuple = ()

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


def dense_config(raw: Any, where: str) -> DenseConfig:
    """Check a parsed config.json and return its typed view.

    Args:
        raw: the parsed JSON (any type: a list or a string is refused, named).
        where: the file (or ``dense_model.config``), which every message starts with.

    Raises:
        SourceError: every problem found, each naming `where`, the field, its value and the fix.

    Example:
        >>> cfg = dense_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        ...                     "num_hidden_layers": 2, "vocab_size": 300, "num_attention_heads": 4}, "config.json")
        >>> cfg.head_dim, cfg.num_key_value_heads, cfg.tie_word_embeddings, cfg["vocab_size"]
        (16, 4, False, 300)
        >>> dense_config({**cfg, "torch_dtype": []}, "config.json")
        Traceback (most recent call last):
        ...
        moe_upcycle.errors.SourceError: config.json: torch_dtype must be a dtype name such as "bfloat16", got []; \
write the dtype the weights are stored in, or remove the key
    """
    if not isinstance(raw, dict):
        raise SourceError(f"{where}: expected a JSON object")
    missing = [k for k in ("model_type", *REQUIRED_INT_FIELDS) if k not in raw]
    nested = [k for k in NESTED_CONFIGS if isinstance(raw.get(k), dict)]
    if missing and nested:
        raise SourceError(f"{where}: describes a {raw.get('model_type', 'multimodal')!r} model whose language model "
                          f"is under {nested[0]}; moe-upcycle upcycles a dense language model (Llama, Mistral, Qwen2, "
                          f"Qwen3) saved on its own — give that checkpoint")
    if missing:
        raise SourceError(f"{where}: missing required field(s) {', '.join(missing)}; a model's config.json has them "
                          f"(re-download it, or save the model again with save_pretrained)")
    wrong = [f"{k} must be a positive integer, got {raw[k]!r}; write the model's {k} as a JSON integer (its "
             f"original config.json has it)" for k in REQUIRED_INT_FIELDS if not _positive_int(raw[k])]
    if not isinstance(raw["model_type"], str):
        wrong.insert(0, f"model_type must be a string, got {raw['model_type']!r}; write the model's family, e.g. "
                        f"\"llama\"")
    wrong += value_problems(raw)
    if wrong:
        raise SourceError(*[f"{where}: {w}" for w in wrong])
    return _typed(raw, where)


def _typed(raw: dict, where: str) -> DenseConfig:
    """The view of a config whose fields passed their checks."""
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    return DenseConfig(
        raw=raw, where=where, model_type=raw["model_type"], hidden_size=hidden,
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        vocab_size=raw["vocab_size"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings")), attention_bias=bool(raw.get("attention_bias")),
        mlp_bias=bool(raw.get("mlp_bias")), hidden_act=raw.get("hidden_act", "silu"),
        rms_norm_eps=raw.get("rms_norm_eps"), max_position_embeddings=raw.get("max_position_embeddings"),
        stated_dtypes={k: DTYPES[raw[k]] for k in ("torch_dtype", "dtype") if raw.get(k) in DTYPES},
        architectures=tuple(raw.get("architectures") or ()),
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
