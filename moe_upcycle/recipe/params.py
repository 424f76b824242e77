"""The recipe resolved once, per concern: small frozen dataclasses each stage takes instead of the recipe.

`resolve.py` makes them from a validated `UpcycleConfig`. The stages below the entry points —
gates, checks, prompt tools, writers — see only these, never the whole recipe: a stage can read
only the parameters it was given, and a test can build one by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# gate modes whose routers come from prompts (every expert needs positive prompts)
PROMPT_MODES = ("cheap_embed", "hidden", "hidden_avg", "hidden_last")


def unused_prompts_note(config: Any) -> list[str]:
    """The note for a recipe whose experts list prompts that its gate mode never reads (``random``, ``uniform``,
    ``kmeans``...): the prompts stay in the recipe and the card, but do not shape the routers.

    Shared experts' prompts are left out: their gates use them in the prompt modes only, and say so themselves.
    """
    if config.gate_mode in PROMPT_MODES:
        return []
    listed = [f"experts[{i}]" for i, e in enumerate(config.experts or [])
              if e.positive_prompts or e.negative_prompts or e.positive_prompts_from or e.negative_prompts_from]
    if not listed:
        return []
    shown = ", ".join(listed[:3]) + (f" and {len(listed) - 3} more" if len(listed) > 3 else "")
    return [f"gate_mode: {config.gate_mode} does not read prompts, so the prompts of {shown} do not shape the "
            f"routers (they stay in the recipe); for routers from the prompts use gate_mode: hidden or cheap_embed"]


def mode_said(mode: str, default_reason: str) -> str:
    """A gate mode as messages name it: with why it was chosen when the recipe left ``gate_mode`` out.

    Example:
        >>> mode_said("hidden", "the default when experts have prompts"), mode_said("random", "")
        ('hidden (the default when experts have prompts)', 'random')
    """
    return f"{mode} ({default_reason})" if default_reason else mode


# gate modes that run the base model (see gates/hidden_gates.py)
HIDDEN_MODES = ("hidden", "hidden_avg", "hidden_last", "kmeans")
# init drift is measured by default only up to this output size: it loads the dense and the MoE in fp32
DRIFT_AUTO_MAX_BYTES = 2 * 10**9
DRIFT_TEXT = (
    "Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog. "
    "One day the sun was hot, so they sat under a big tree and ate an apple. "
    "The integral of x squared is x cubed over three. def add(a, b): return a + b. "
    "Photosynthesis turns light into chemical energy, and the cat sat on the mat."
)


@dataclass(frozen=True)
class ExpertPrompts:
    """One expert's name and prompts (``*_prompts_from`` sets already merged in)."""

    name: str
    positive: tuple[str, ...] = ()
    negative: tuple[str, ...] = ()


@dataclass(frozen=True)
class GateParams:
    """How to make the routers (and a prompt-initialised shared-expert gate).

    Attributes:
        mode: the recipe's ``gate_mode``.
        source: ``gate_source``: ``native`` (our router-input semantics) or ``mergekit`` (mergekit-moe 0.1.5's).
        experts: the routed experts' prompts, in slot order.
        shared_experts: the shared experts' prompts (qwen2_moe), in recipe order.
        copies: True for ``num_experts: N`` (copies of the base, no prompts).
        seed: seeds the random modes and k-means.
        scale: ``gate_scale`` (None: `router.default_gate_scale`).
        init_std: ``router_init_std`` for ``random``.
        group_size: G of ``expert_init: split`` (rows tied within each group of G), else 1.
        center, calibration_text, batch_size, device, dtype, quantize: hidden-state modes only.
        mode_default: why `mode` was chosen when the recipe left ``gate_mode`` out ("" when it gave it), for messages.
    """

    mode: str
    experts: tuple[ExpertPrompts, ...]
    source: str = "native"
    shared_experts: tuple[ExpertPrompts, ...] = ()
    copies: bool = False
    seed: int = 0
    scale: Optional[float] = None
    init_std: float = 0.02
    group_size: int = 1
    center: bool = False
    calibration_text: Optional[str] = None
    batch_size: int = 8
    device: str = "auto"
    dtype: Optional[str] = None
    quantize: Optional[str] = None
    mode_default: str = ""

    @property
    def mode_said(self) -> str:
        """The mode as messages name it: ``hidden (the default when experts have prompts)`` when the recipe left it out."""
        return mode_said(self.mode, self.mode_default)


@dataclass(frozen=True)
class MoeLayers:
    """Which decoder layers become MoE layers: the recipe's ``moe_layers`` (`layer_choice`), resolved once the
    base's depth is known. The other layers keep the dense MLP.

    Attributes:
        indices: the layers listed (``moe_layers: [1, 3, 5]``), else None.
        every, start: ``{every: k, start: s}``; `start` is already s, or k - 1 when the recipe gave none.
        start_given: the recipe wrote ``start:`` (its messages repeat what it wrote, and fix what it chose).
        Neither (the default): every layer.
    """

    indices: Optional[tuple[int, ...]] = None
    every: Optional[int] = None
    start: int = 0
    start_given: bool = False

    @property
    def given(self) -> bool:
        """The recipe chose layers (which may still be all of them)."""
        return self.indices is not None or self.every is not None

    def layers(self, num_layers: int) -> tuple[int, ...]:
        """The MoE layers of a model `num_layers` deep, ascending (indices beyond it are `problems`).

        Example:
            >>> MoeLayers(every=2, start=1).layers(8), MoeLayers(indices=(5, 1)).layers(8), MoeLayers().layers(3)
            ((1, 3, 5, 7), (1, 5), (0, 1, 2))
        """
        if self.indices is not None:
            return tuple(sorted(i for i in self.indices if i < num_layers))
        if self.every is not None:
            return tuple(range(self.start, num_layers, self.every))
        return tuple(range(num_layers))

    def dense_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers that keep the dense MLP."""
        moe = set(self.layers(num_layers))
        return tuple(i for i in range(num_layers) if i not in moe)

    def problems(self, num_layers: int, where: str) -> list[str]:
        """Why these layers do not fit a base `num_layers` deep (`where` names it: "base_model (org/name)")."""
        last = f"{where} has {num_layers} layer{'s' if num_layers != 1 else ''}, 0 to {num_layers - 1}"
        if self.indices is not None:
            beyond = sorted(i for i in self.indices if i >= num_layers)
            if beyond:
                shown = ", ".join(map(str, beyond[:8])) + (f" and {len(beyond) - 8} more" if len(beyond) > 8 else "")
                return [f"moe_layers: layer{'s' if len(beyond) > 1 else ''} {shown} do{'es' if len(beyond) == 1 else ''} "
                        f"not exist: {last}; list layers from 0 to {num_layers - 1}"]
        elif self.every is not None and self.start >= num_layers:
            given = self.text()
            fix = (f"use start: 0 to {num_layers - 1}" if self.every <= num_layers or self.start_given
                   else f"use every: 2 to {num_layers} (every: 1 is every layer)")
            return [f"moe_layers: {given} makes layers {self.start}, {self.start + self.every}, ... MoE layers, none of "
                    f"which exists: {last}; {fix}"]
        return []

    def text(self) -> str:
        """The choice as the recipe writes it: ``[1, 3, 5]``, ``{every: 2}``, ``{every: 2, start: 0}``, or ``all
        layers``."""
        if self.indices is not None:
            return f"[{', '.join(map(str, self.indices))}]"
        if self.every is not None:
            return f"{{every: {self.every}, start: {self.start}}}" if self.start_given else f"{{every: {self.every}}}"
        return "all layers"


@dataclass(frozen=True)
class WriteParams:
    """How tensors are written: storage policy, shard size, checksums, the seed of random inits."""

    tensor_policy: str = "share"
    max_shard_bytes: int = 5 * 10**9
    checksums: bool = True
    seed: int = 0


@dataclass(frozen=True)
class RouterFields:
    """Router settings written into the output's config.json."""

    aux_loss_coef: Optional[float] = None
    jitter_noise: float = 0.0


@dataclass(frozen=True)
class CheckParams:
    """What the checks of a build need to know about its recipe.

    Attributes:
        base_model: the dense reference (folder or hub id).
        function_preserving: the recipe makes copies of the base FFN with nothing changed, so the
            MoE must compute what the dense model does (verify then applies identity thresholds).
        routing_prompts: each expert's first positive prompt (verify routes through every expert).
        experts: every routed expert's prompts (routing evaluation labels by them).
        report_init_drift: the recipe's ``report_init_drift`` (None: decided by size).
        inits_changed: some expert init is not ``copy`` (so init drift is worth measuring).
        drift_text: what the init-drift report runs both models on.
    """

    base_model: str
    function_preserving: bool = False
    routing_prompts: tuple[str, ...] = ()
    experts: tuple[ExpertPrompts, ...] = ()
    report_init_drift: Optional[bool] = None
    inits_changed: bool = False
    drift_text: str = DRIFT_TEXT

    def measures_drift(self, output_bytes: int) -> bool:
        """Whether a build of `output_bytes` reports init drift: ``report_init_drift`` when set; by
        default when some init is not ``copy`` (a copy is function-preserving by construction) and
        the output is at most `DRIFT_AUTO_MAX_BYTES` (the report loads both models in fp32).

        Example:
            >>> CheckParams("base", inits_changed=True).measures_drift(10**9)
            True
        """
        if self.report_init_drift is not None:
            return self.report_init_drift
        return self.inits_changed and output_bytes <= DRIFT_AUTO_MAX_BYTES
