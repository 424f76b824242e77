"""What the model card says about where the model came from and how it was made.

`card` lays the card out; this module supplies its facts in a form a publisher can upload as is:
hub ids for ``base_model`` (never local paths), readable parameter counts, markdown-safe table
cells, and a short account of how the experts and their router rows were made. It reads only
the sources' ``config.json``; no tensors.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping, Optional

from moe_upcycle.planning import shared_experts
from moe_upcycle.recipe.resolved import resolved
from moe_upcycle.planning.plan_report import readable_count  # noqa: F401  (re-exported)
from moe_upcycle.recipe.schema import ExpertConfig, UpcycleConfig
from moe_upcycle.checkpoint.lora import split_ref
from moe_upcycle.terminal.hints import is_hub_id

LOCAL = "local model"


def hub_id(ref: str, path: Optional[Path]) -> Optional[str]:
    """The hub id of a source: `ref` itself when it is one and no local folder of that name was
    used, else the ``_name_or_path`` its config.json records when that is a hub id; else None."""
    local_folder = path is not None and Path(os.path.expanduser(ref)).is_dir()
    model = ref.partition("@")[0]  # mergekit's org/name@revision is the hub model org/name
    if is_hub_id(model) and not local_folder:
        return model
    if path is not None and (Path(path) / "config.json").is_file():
        try:
            named = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            named = None
        if isinstance(named, str) and is_hub_id(named) and not Path(os.path.expanduser(named)).exists():
            return named
    return None


class Sources:
    """How each model reference of a recipe is named in the card: its hub id, else "local model `name`"."""

    def __init__(self, config: UpcycleConfig, paths: Mapping[str, Optional[Path]]):
        refs = [config.base_model] + [e.source_model for e in config.expert_list()]
        refs += [e.source_model for e in config.shared_experts]
        self.refs = list(dict.fromkeys(refs))
        # mergekit's model+adapter: named by its two parts (the model's folder is paths[ref])
        self.lora = {ref: split_ref(ref) for ref in self.refs if split_ref(ref)[1] is not None}
        self.hub = {ref: None if ref in self.lora else hub_id(ref, paths.get(ref)) for ref in self.refs}
        self.part_hub = {part: hub_id(part if Path(os.path.expanduser(part)).is_dir() else part.partition("@")[0],
                                      paths.get(ref) if part == model else None)
                         for ref, (model, adapter) in self.lora.items() for part in (model, adapter)}

    def base_models(self) -> list[str]:
        """Hub ids of every source (base, experts, shared experts; a LoRA's model and adapter), each once, base first."""
        ids = [h for r in self.refs for h in ([self.part_hub[p] for p in self.lora[r]] if r in self.lora
                                               else [self.hub[r]])]
        return list(dict.fromkeys(h for h in ids if h))

    def local(self) -> list[str]:
        """References with no hub id."""
        return [r for r in self.refs if not self.hub[r]]

    def name(self, ref: str) -> str:
        """Markdown for a source: ``[org/name](https://huggingface.co/org/name)`` or ``local model `ft0```."""
        if ref in self.lora:
            model, adapter = self.lora[ref]
            return f"{self._part(model, True)} with LoRA {self._part(adapter, True)} merged in"
        h = self.hub.get(ref)
        if h and self._revision(ref):
            return f"[{h}@{self._revision(ref)}](https://huggingface.co/{h}/tree/{self._revision(ref)})"
        if h:
            return f"[{h}](https://huggingface.co/{h})"
        return f"{LOCAL} {code_span(Path(os.path.expanduser(ref)).name or ref)}"

    def _revision(self, ref: str) -> str:
        """The revision of a hub reference written ``org/name@revision``, else ''."""
        model, _, revision = ref.partition("@")
        return revision if self.hub.get(ref) == model else ""

    def shown(self, ref: str) -> str:
        """A reference as the card's recipe writes it: hub ids as they are, local folders by name only."""
        if ref in self.lora:
            return "+".join(self.part_hub.get(p) or self.shown(p) for p in self.lora[ref])
        if self._revision(ref):
            return ref  # the hub model at the revision the recipe pins
        return self.hub.get(ref) or Path(os.path.expanduser(ref)).name

    def _part(self, part: str, markdown: bool) -> str:
        h = self.part_hub.get(part)
        if h:
            return f"[{h}](https://huggingface.co/{h})" if markdown else h
        name = Path(os.path.expanduser(part.partition("@")[0] if not Path(os.path.expanduser(part)).is_dir() else part)).name
        return f"{LOCAL} {code_span(name or part)}" if markdown else f"{LOCAL} {name or part}"

    def without_paths(self, text: str, paths: Mapping[str, Optional[Path]]) -> str:
        """`text` with every local source's reference and folder replaced by its plain name."""
        for ref in sorted(self.local(), key=len, reverse=True):
            for form in {str(paths.get(ref) or ""), str(Path(os.path.expanduser(ref)).resolve()), ref} - {""}:
                text = text.replace(form, self.plain(ref))
        return text

    def plain(self, ref: str) -> str:
        """A source without markdown: its hub id or ``local model ft0``."""
        if ref in self.lora:
            model, adapter = self.lora[ref]
            return f"{self._part(model, False)} with LoRA {self._part(adapter, False)} merged in"
        return self.hub.get(ref) or f"{LOCAL} {Path(os.path.expanduser(ref)).name or ref}"


def cell(text: object) -> str:
    """Text safe inside a markdown table cell: one line, pipes escaped.

    Example:
        >>> cell("a | b\\nc")
        'a \\\\| b c'
    """
    return " ".join(str(text).split()).replace("|", "\\|")


def code_span(text: object) -> str:
    """`text` as one line of inline code outside a table (no pipe escaping, which would show there); a name holding
    backticks is fenced with longer ones, as CommonMark allows.

    Example:
        >>> code_span("récit|story"), code_span("a `b`")
        ('`récit|story`', '`` a `b` ``')
    """
    line = " ".join(str(text).split())
    if "`" not in line:
        return f"`{line}`"
    fence = "`" * (max(len(run) for run in re.findall(r"`+", line)) + 1)
    return f"{fence} {line} {fence}"


def init_text(init) -> str:
    """An `ExpertInit` in words."""
    if init.method == "copy":
        return "exact copies of the source FFN"
    if init.method == "noise":
        kind = "absolute std" if init.absolute else "std relative to each matrix"
        return f"copies plus seeded Gaussian noise ({kind} {init.scale:g})"
    if init.method == "drop":
        ratio = 0.5 if init.ratio is None else init.ratio  # the default of inits.slot_transforms
        return f"Drop-Upcycling: a seeded {ratio:.0%} of each expert's neurons re-initialised"
    if init.method == "split":
        how = ", after a seeded shuffle" if init.shuffle else ""
        return f"each FFN split into {init.granularity} fine-grained experts{how}"
    return str(init.method)


def _prompt_source(expert: ExpertConfig) -> str:
    pos = f"{len(expert.positive_prompts)} positive prompts"
    if expert.positive_prompts_from:
        pos += f" (set {code_span(expert.positive_prompts_from)})" if "/" not in expert.positive_prompts_from and \
            "." not in expert.positive_prompts_from else " (from a file)"
    if expert.negative_prompts:
        pos += f", {len(expert.negative_prompts)} negative"
    return pos


def gate_text(config: UpcycleConfig) -> str:
    """Where the router rows came from, in one sentence."""
    mode = config.gate_mode
    center = ", centred over experts" if config.gate_center else ""
    if config.gate_source == "mergekit" and mode != "uniform_random":
        return _mergekit_gate_text(config)
    if mode == "random":
        return f"random rows, normal(0, {config.router_init_std:g}) (seed {config.seed})"
    if mode == "uniform_random":
        return f"random rows, U(-1/sqrt(hidden), 1/sqrt(hidden)) as nn.Linear initialises them (seed {config.seed})"
    if mode == "uniform":
        return "zeros: every expert gets the same score, routing starts uniform"
    if mode == "cheap_embed":
        scale = f"rows of length {config.gate_scale:g}" if config.gate_scale else "rows of length 16/sqrt(hidden)"
        return (f"the mean token embedding of each expert's positive prompts (minus its negative prompts), no forward "
                f"pass{center}, {scale}")
    if mode == "kmeans":
        name = Path(str(config.calibration_text)).name
        return (f"spherical k-means (seed {config.seed}) of the base model's router inputs "
                f"(post_attention_layernorm outputs) on the calibration text {code_span(name)}; each centroid is a row")
    reduce = "last real token" if mode == "hidden_last" else "mean over real tokens"
    scale = f", rows of length {config.gate_scale:g}" if config.gate_scale else ", length set per layer"
    return (f"the base model's router inputs (post_attention_layernorm outputs, {reduce}) on each expert's "
            f"prompts, positive minus negative{center}{scale}")


def _mergekit_gate_text(config: UpcycleConfig) -> str:
    """The router rows of ``gate_source: mergekit``: mergekit-moe 0.1.5's computation, in words."""
    mode = config.gate_mode
    scale = f", scaled to length {config.gate_scale:g}" if config.gate_scale else ""
    if mode == "random":
        return f"standard normal rows (std 1.0), as mergekit-moe 0.1.5 draws them (seed {config.seed})"
    if mode == "cheap_embed":
        return ("mergekit-moe 0.1.5's computation: the summed token embeddings (BOS included) of each expert's "
                f"positive prompts, unit length, minus its negative prompts', unit rows{scale}")
    where = "mean over all positions, padding included" if mode == "hidden_avg" else "last position"
    return ("mergekit-moe 0.1.5's computation: the base model's residual stream before each layer (bf16, "
            f"{where}) on each expert's prompts, positive minus negative, unit rows{scale}")


def _same_ffn(config: UpcycleConfig) -> list[str]:
    """The fact a copy upcycle's build states: every expert is one and the same FFN until the MoE is trained."""
    experts = config.expert_list()
    first = experts[0]
    if len(experts) < 2 or config.shared_experts or any(init.method != "copy" for init in resolved(config).inits) or any(
            (e.source_model, e.layers) != (first.source_model, first.layers) or e.noise_scale
            or e.residual_scale not in (None, 1.0) for e in experts):
        return []
    if first.source_model == config.base_model and first.layers is None:
        return [f"- All {len(experts)} experts are the same FFN, the dense model's, so whichever experts the router "
                f"picks the MoE computes what the dense model computes, until it is trained."]
    return [f"- All {len(experts)} experts are the same FFN, so the router's choice changes nothing until the MoE is "
            f"trained."]


def making_of(config: UpcycleConfig) -> list[str]:
    """Markdown bullets: how the experts and their routers were made."""
    lines = [f"- Experts: {init_text(config.expert_init)}.", *_same_ffn(config),
             f"- Router (gate mode `{config.gate_mode}`): {gate_text(config)}."]
    if config.gate_mode in ("hidden", "hidden_avg", "hidden_last", "cheap_embed"):
        for e in config.expert_list():
            lines.append(f"  - {code_span(e.name)}: {_prompt_source(e)}")
    if config.shared_experts:
        gate = shared_experts.gate_init(config)  # what was built, also when the recipe left it to the default
        lines.append(f"- Shared expert: {len(config.shared_experts)} source FFN(s) concatenated, sigmoid gate "
                     f"`{gate}`.")
    if config.attention_from == "average":
        lines.append("- Attention, norms and embeddings: the mean over the expert source models.")
    return lines
