"""Is a model folder a Mixture-of-Experts at all? (`verify` and `route` ask this before loading it.)

A dense folder (the base model itself, a typo'd path to it) loads fine with transformers and
would match the dense base perfectly, so verifying it would say PASSED about a model that has no
experts. `require_moe` reads only ``config.json`` and refuses such a folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_upcycle.errors import SourceError

# the config.json key that holds the routed-expert count, per MoE family
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEY = "num_experts_per_tok"  # experts per token, in every family above


def require_moe(folder: Path, option: str = "OUT", command: str = "verify") -> int:
    """The folder's routed-expert count, read from its config.json.

    Raises:
        SourceError: config.json is unreadable, describes a dense (non-MoE) model, or gives an expert count or a
            number of experts per token that no model can run with.
    """
    cfg_path = Path(folder) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise SourceError(f"{option}: {cfg_path} cannot be read as JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise SourceError(f"{option}: {cfg_path} is not a JSON object")
    for key in EXPERT_COUNT_KEYS:
        if cfg.get(key) in (None, 0) or cfg.get(key) is False:  # absent, or a dense config's "no experts"
            continue
        value = cfg[key]
        if not _count(value):
            raise SourceError(f"{option}: {cfg_path}: {key} is {value!r}, not a number of experts (a whole number, 1 or "
                              f"more); fix config.json or rebuild the model")
        top_k = cfg.get(TOP_K_KEY, 1)
        if not _count(top_k) or top_k > value:
            raise SourceError(f"{option}: {cfg_path}: {TOP_K_KEY} is {top_k!r}, but each token must go to 1 to {value} "
                              f"experts (the model has {value}); fix config.json or rebuild the model")
        return value
    kind = cfg.get("model_type", "unknown")
    arch = ", ".join(cfg.get("architectures") or []) if isinstance(cfg.get("architectures"), list) else ""
    raise SourceError(f"{option}: {folder} is a dense model (model_type {kind!r}{', ' + arch if arch else ''}; its "
                      f"config.json gives no number of experts: {' / '.join(EXPERT_COUNT_KEYS[:3])}), not a Mixture-of-Experts, so there "
                      f"is nothing to {command}; give the folder that moe-upcycle build wrote")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
