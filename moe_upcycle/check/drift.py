"""How far an expert init moved the model from its dense source: mean KL and top-1 agreement.

`compare_logits` is the measure (pure tensor maths); `measure_drift` runs two in-memory models
on the same tokens; `measure_drift_folders` loads two saved models with transformers and is the
one `build` calls after writing. Loading means **whole-model memory** (both models, fp32), so
whether a build measures is `CheckParams.measures_drift` (by default only when an expert init
changes weights and the output is small; ``report_init_drift: true`` forces it, ``false`` skips
it), the same rule `plan` predicts its memory by.

The KL/agreement maths is `compare.compare_logits`, shared with `verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from moe_upcycle.check import compare
from moe_upcycle.checkpoint.lora import Adapter, merge_into_model
from moe_upcycle.recipe.params import DRIFT_TEXT, CheckParams
from moe_upcycle.errors import ConfigError
from moe_upcycle.planning.steps import Plan
from moe_upcycle.inputs.text import check_token_ids

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class InitDrift:
    """Distance of an upcycled model's next-token distributions from the dense model's.

    Attributes:
        mean_kl: mean over positions of KL(dense ‖ moe), in nats per token.
        top1_agreement: fraction of positions whose argmax token is the same.
        tokens: positions compared.
    """

    mean_kl: float
    top1_agreement: float
    tokens: int

    def summary(self) -> str:
        return (f"init drift from the dense model: mean KL {self.mean_kl:.3g} nats/token, top-1 agreement "
                f"{100 * self.top1_agreement:.1f}% over {self.tokens} tokens")


def compare_logits(dense: torch.Tensor, moe: torch.Tensor) -> InitDrift:
    """Compare two (..., T, V) logit tensors position by position (`compare.compare_logits`).

    Example:
        >>> x = torch.randn(1, 5, 11)
        >>> d = compare_logits(x, x)
        >>> d.mean_kl, d.top1_agreement, d.tokens
        (0.0, 1.0, 5)
    """
    found = compare.compare_logits([dense.reshape(-1, dense.shape[-1])], [moe.reshape(-1, moe.shape[-1])])
    return InitDrift(found.mean_kl, found.top1_agreement, found.positions)


def measure_drift(dense_model: torch.nn.Module, moe_model: torch.nn.Module, input_ids: torch.Tensor) -> InitDrift:
    """Run both in-memory models on `input_ids` (1, T) and compare their logits."""
    with torch.inference_mode():
        dense_logits = dense_model(input_ids=input_ids).logits.float()
        moe_logits = moe_model(input_ids=input_ids).logits.float()
    return compare_logits(dense_logits, moe_logits)


def measure_drift_folders(dense: Path, moe: Path, text: str = DRIFT_TEXT, adapter: Optional[Adapter] = None) -> InitDrift:
    """Load two saved models (fp32, whole-model memory; `adapter` merged into the dense one) and compare them on `text`.

    Raises:
        ConfigError: the dense folder has no tokenizer to encode `text` with.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not has_tokenizer(dense):
        raise ConfigError(f"report_init_drift: {dense} has no tokenizer files ({', '.join(TOKENIZER_MARKERS)}) to "
                          f"encode the drift text; add them or set report_init_drift: false")
    ids = AutoTokenizer.from_pretrained(str(dense))(text, return_tensors="pt")["input_ids"]
    dense_model = AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    merge_into_model(dense_model, adapter)
    check_token_ids(ids, dense_model.get_input_embeddings().num_embeddings, dense, text)
    # eager experts: the reference loop, which (unlike grouped_mm on CPU) takes any intermediate size
    moe_model = AutoModelForCausalLM.from_pretrained(str(moe), dtype=torch.float32, **compare.eager_experts()).eval()
    return measure_drift(dense_model, moe_model, ids)


def has_tokenizer(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_MARKERS)


def build_drift(check: CheckParams, plan: Plan, dense: Optional[Path], moe: Path,
                adapter: Optional[Adapter] = None) -> Optional[InitDrift]:
    """The drift of a freshly written build, or None when `CheckParams.measures_drift` skips it (or,
    by default, the base has no tokenizer to encode the drift text with)."""
    if dense is None or not check.measures_drift(plan.total_bytes):
        return None
    if check.report_init_drift is None and not has_tokenizer(dense):
        return None
    return measure_drift_folders(dense, moe, check.drift_text, adapter)
