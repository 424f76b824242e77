"""Reading an MoE checkpoint as the base of a build that grows it (`planning.grow`).

`moe_base(ckpt)` describes an MoE folder — Mixtral, Qwen2-MoE or Qwen3-MoE, one this tool built or a
hub folder saved by transformers (4.x or 5.x: both write one tensor per expert matrix) — from its
config.json and tensor headers: how many routed experts, how many a token goes to, one expert's FFN
size, which layers have a router and which keep a dense MLP, the shared expert, ``norm_topk_prob``.
It cross-checks the config against the tensors and reports every mismatch at once. The names come
from the one table (`names.OUTPUT_LAYOUTS`): an MoE base is read with the names its family writes.

It reads no tensor bytes and decides nothing about the grown model (that is `planning.grow`). A folder
in the transformers-5 fused layout (``mlp.experts.gate_up_proj``: every expert in one tensor) is
refused, named, with what to do; so are MoE families without a layout in the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from moe_upcycle.checkpoint import names
from moe_upcycle.checkpoint.source import Checkpoint
from moe_upcycle.errors import PlanError

# the dense family whose fine-tunes can become new experts of an MoE of each type (same attention, norms); its keys
# are the families grown: softmax routers whose copies split an expert's probability (`planning.grow`). An output
# layout added to `names` later (a sigmoid router with a per-expert score bias, say) is refused until it is added
# here with its own exactness rule.
DENSE_OF = {"mixtral": ("llama", "mistral"), "qwen2_moe": ("qwen2",), "qwen3_moe": ("qwen3",)}
# MoE model types that are not read as a base (yet): the message names them and says what is supported
_OTHER_MOE = ("glm4_moe", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "phimoe", "granitemoe", "olmoe", "qwen3_5_moe")


@dataclass(frozen=True)
class MoeBase:
    """An MoE checkpoint as a base: its routed experts, routers, shared expert and dense layers.

    Attributes:
        model_type: ``mixtral``, ``qwen2_moe`` or ``qwen3_moe`` (the grown model's too).
        layout: its names (`names.OUTPUT_LAYOUTS`).
        num_experts: routed experts per MoE layer (E).
        experts_per_token: the base's top-k (k).
        expert_size: one routed expert's intermediate size.
        moe_layers, dense_layers: the layers with a router and experts, and those with a dense MLP.
        norm_topk_prob: whether the top-k weights are renormalised to sum 1 (Mixtral always).
        shared_expert: the base has a shared expert (Qwen2-MoE), kept as it is.
        experts_key: the config.json field(s) that hold E, as the folder spells them.
    """

    model_type: str
    layout: names.OutputLayout
    num_experts: int
    experts_per_token: int
    expert_size: int
    moe_layers: tuple[int, ...]
    dense_layers: tuple[int, ...]
    norm_topk_prob: bool
    shared_expert: bool
    experts_key: tuple[str, ...]

    def expert_key(self, layer: int, expert: int, proj: str) -> str:
        """The base's tensor for one expert matrix (`proj`: gate_proj, up_proj or down_proj)."""
        return names.fill(self.layout.expert[proj], layer=layer, expert=expert)

    def router_key(self, layer: int) -> str:
        return names.fill(self.layout.router, layer=layer)


def is_moe(ckpt: Checkpoint) -> bool:
    """Whether `ckpt` is an MoE checkpoint (one moe-upcycle can grow, or another it names in its refusal).

    Example:
        >>> from moe_upcycle.checkpoint.source import meta_checkpoint
        >>> mixtral, llama = meta_checkpoint("m", {"model_type": "mixtral"}, {}), meta_checkpoint("d", {"model_type": "llama"}, {})
        >>> is_moe(mixtral), is_moe(llama)
        (True, False)
    """
    kind = ckpt.model_type
    return isinstance(kind, str) and (kind in names.OUTPUT_LAYOUTS or kind in _OTHER_MOE or "moe" in kind.lower())


def moe_base(ckpt: Checkpoint, where: str = "base_model") -> MoeBase:
    """Describe MoE checkpoint `ckpt` from its config.json and tensor headers.

    Raises:
        PlanError: a family this tool cannot grow, a fused layout, or config.json and the tensors
            disagreeing (the expert count, the expert size, missing experts) — every problem at once.
    """
    kind = ckpt.model_type
    label = f"{where} ({ckpt.ref})"
    if kind not in names.OUTPUT_LAYOUTS or kind not in DENSE_OF:
        raise PlanError(f"{label}: model_type {kind!r} is an MoE that moe-upcycle does not grow; it grows "
                        f"{', '.join(DENSE_OF)} checkpoints")
    layout = names.OUTPUT_LAYOUTS[kind]
    cfg = ckpt.fields
    tensors = ckpt.tensors
    n_layers = cfg.num_hidden_layers
    if any(names.fill(t, layer=layer) in tensors for t in names.FUSED_EXPERT for layer in range(n_layers)):
        raise PlanError(f"{label}: the experts are stored fused (mlp.experts.gate_up_proj, every expert in one "
                        f"tensor); growing reads one tensor per expert matrix — save the model again with "
                        f"transformers' save_pretrained, or rebuild it with layout: per_expert")
    problems: list[str] = []
    keys = tuple(k for k in (layout.experts_key, "num_local_experts", "num_experts") if k in cfg)
    keys = tuple(dict.fromkeys(keys))
    stated = {cfg[k] for k in keys}
    if len(stated) != 1 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in stated):
        raise PlanError(f"{label}: config.json gives the number of experts as "
                        f"{', '.join(f'{k}={cfg[k]!r}' for k in keys) or 'nothing'}; an MoE's config.json has one "
                        f"positive {layout.experts_key} — re-download the folder")
    n_experts = stated.pop()
    k = cfg.get("num_experts_per_tok")
    if not (isinstance(k, int) and not isinstance(k, bool) and 0 < k <= n_experts):
        problems.append(f"{label}: config.json's num_experts_per_tok is {k!r}; it must be a whole number from 1 to "
                        f"{n_experts} (the experts)")
    moe_layers = tuple(layer for layer in range(n_layers) if names.fill(layout.router, layer=layer) in tensors)
    dense_layers = tuple(layer for layer in range(n_layers) if layer not in moe_layers)
    if not moe_layers:
        problems.append(f"{label}: no layer has a router ({names.fill(layout.router, layer=0)}); config.json says "
                        f"{kind}, the tensors are not — re-download the folder")
    size_key = layout.expert_size_key
    size = cfg.get(size_key)
    for layer in moe_layers:
        gate = tensors[names.fill(layout.router, layer=layer)].shape
        if tuple(gate) != (n_experts, cfg.hidden_size):
            problems.append(f"{label}: {names.fill(layout.router, layer=layer)} is {tuple(gate)}, config.json says "
                            f"({n_experts}, {cfg.hidden_size}) ({layout.experts_key}, hidden_size)")
        for e in range(n_experts):
            for proj in names.PROJS:
                key = names.fill(layout.expert[proj], layer=layer, expert=e)
                info = tensors.get(key)
                want = (cfg.hidden_size, size) if proj == "down_proj" else (size, cfg.hidden_size)
                if info is None:
                    problems.append(f"{label}: tensor {key!r} is missing (config.json gives {n_experts} experts)")
                elif tuple(info.shape) != want:
                    problems.append(f"{label}: {key} is {tuple(info.shape)}, config.json's {size_key} {size} and "
                                    f"hidden_size {cfg.hidden_size} say {want}")
        extra = names.fill(layout.expert["gate_proj"], layer=layer, expert=n_experts)
        if extra in tensors:
            problems.append(f"{label}: tensor {extra!r} is beyond the {n_experts} experts config.json gives")
    for layer in dense_layers:
        key = names.fill(names.DENSE_MLP, layer=layer, proj="gate_proj")
        if key not in tensors:
            problems.append(f"{label}: layer {layer} has neither a router nor a dense MLP ({key})")
    if problems:
        raise PlanError(*problems)
    shared = bool(layout.shared_expert) and any(
        names.fill(layout.shared_expert["gate_proj"], layer=layer) in tensors for layer in moe_layers)
    norm = True if kind == "mixtral" else bool(cfg.get("norm_topk_prob", False))
    return MoeBase(kind, layout, n_experts, k, size, moe_layers, dense_layers, norm, shared, keys)


def dense_family_problem(base: MoeBase, src: Checkpoint, label: str) -> Optional[str]:
    """Why dense checkpoint `src` cannot give a new expert of `base` (another family, sizes), or None."""
    want = DENSE_OF[base.model_type]
    if src.model_type not in want:
        return (f"{label}: model_type {src.model_type!r} cannot give an expert of a {base.model_type} base, whose "
                f"experts are {'/'.join(want)} FFNs; give a dense fine-tune of the MoE's own dense model")
    return None
