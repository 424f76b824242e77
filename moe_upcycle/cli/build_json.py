"""What ``moe-upcycle build --json`` prints: the finished build as one JSON object.

Keys: ``output`` (the folder), ``shards`` (file names), ``bytes`` (tensor bytes written), ``seconds``, ``gates``
(mode, source, MoE layers, warnings), ``self_check`` (per expert, the own prompts its router wins: see
`gates.self_check`; null when the gates do not come from the prompts' router inputs), ``notes``, ``drift`` and
``verify`` (null unless run). Renders a `build.BuildResult`; computes nothing.
"""

from __future__ import annotations

from typing import Any


def build_dict(result) -> dict[str, Any]:
    """`result` (a `build.BuildResult` of a build that wrote its folder) as plain data for `json_text`."""
    config, plan = result.config, result.plan
    drift = result.drift
    return {
        "output": str(result.output),
        "shards": list(result.shards),
        "bytes": int(plan.total_bytes),
        "seconds": round(result.seconds, 3),
        "experts": list(plan.expert_names),
        "gates": {"mode": config.gate_mode, "source": config.gate_source, "layers": list(plan.moe_layers),
                  "warnings": list(result.gate_warnings)},
        "self_check": result.self_check.to_dict() if result.self_check else None,
        "notes": list(result.notes),
        "sharing": result.sharing_line or None,
        "drift": drift.summary() if drift is not None else None,
        "verify": result.verify.to_dict() if result.verify is not None else None,
    }
