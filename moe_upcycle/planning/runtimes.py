"""Where a planned output runs: one verdict per runtime, from what each runtime's loader does.

`compatibility(plan)` answers, for transformers 5, transformers 4.x, vLLM, llama.cpp and
ExLlamaV2, whether the output is *exact* there (computes the function transformers 5 computes,
up to that runtime's rounding), *runs, not exact* (loads, but computes something else: why), or
*will not load* (why). Each verdict says what it rests on: ``measured`` (run by this project on
tiny models: transformers 5 and 4.57 by the test suite, llama.cpp by the issue-14 llama.cpp
check) or ``loader code`` (read, not run: vLLM's ``models/{mixtral,qwen2_moe,qwen3_moe}.py``,
ExLlamaV2's ``architecture.py``/``moe_mlp.py``, llama.cpp's ``src/models/*.cpp``).

The facts it reads are those of the output as planned and configured (`OutputFacts`: the
written config.json via `model_config.moe_config`, zero-size tensors, attention biases, the
`llamacpp` verdict), so a change to what the tool writes changes the verdicts with it. The
rules per runtime are plain functions in `RULES`; what they encode:

- transformers 5: reads every output (per-expert checkpoints are converted while loading).
- transformers 4.x: per-expert only; fused shards carry a safetensors ``format`` that 4.x
  refuses (see `fused`), instead of loading random experts. Its (4.57) Qwen2-MoE refuses a
  head_dim other than hidden_size / num_attention_heads, and with eager or sdpa attention applies
  ``sliding_window`` to every layer (one mask for the whole model; ``max_window_layers`` only
  reaches flash-attention 2, ``layer_types`` not at all), so a base that slides some layers only
  runs there, not exactly.
- vLLM: per-expert only (its loaders map ``experts.{e}.{proj}``); honours ``norm_topk_prob``
  (``renormalize=config.norm_topk_prob``); its qwen2_moe builds no shared expert when
  ``shared_expert_intermediate_size`` is 0 and then has no parameter for zero-size
  ``shared_expert.down_proj`` tensors; its qwen3_moe has no o_proj bias and silently skips one;
  its qwen2_moe takes head_dim as hidden_size / num_attention_heads.
- llama.cpp: the rules of `llamacpp` (its qwen2moe never renormalises the top-k weights, so
  qwen2_moe with experts_per_token < num_experts runs but is not exact; its qwen3moe refuses an
  o_proj bias; it has no sliding window; head_dim, llama3 rope and the fused layout per architecture), each
  case measured by ``scripts/check_llamacpp.py``.
- GLM-4-MoE (`glm4`): transformers 5 and 4.57 (measured); vLLM's ``models/glm4_moe.py`` (sigmoid grouped
  top-k with the correction bias, ``renormalize=norm_topk_prob``, ``routed_scaling_factor``,
  ``first_k_dense_replace``); llama.cpp as `llamacpp` says (its converter wants GLM's tokenizer).
- ExLlamaV2: MixtralForCausalLM and Qwen3MoeForCausalLM (always renormalises top-k); no
  Qwen2MoeForCausalLM or Glm4MoeForCausalLM (it falls back to Llama and finds no dense MLP); per-expert names only. MoE is
  a per-architecture switch (``is_moe``: ``model.py`` builds every layer's MLP as ``ExLlamaV2MoEMLP``)
  and ``config.py`` reads no ``mlp_only_layers``, so dense layers between MoE layers do not load.
- Dense layers between MoE layers (``moe_layers:``): transformers 4.57 and 5 build them from
  ``mlp_only_layers`` / ``decoder_sparse_step`` (measured); vLLM's qwen2_moe / qwen3_moe apply the same
  rule (``Qwen2MoeDecoderLayer``, ``Qwen3MoeDecoderLayer``); llama.cpp cannot convert them (`llamacpp`).
- Qwen3.5-MoE (``qwen3_5_moe_text``): transformers 5 only (4.57 has no Qwen3.5 classes); vLLM's
  ``models/qwen3_5.py`` reads its fused experts and ``layer_types``; llama.cpp's ``qwen35moe`` (converted by
  ``Qwen3_5MoeTextModel``) renormalises the top-k and applies a plain sigmoid to the shared gate; no ExLlamaV2.
- Granite-MoE-Shared (``granitemoeshared``): its fused ``input_linear`` / ``output_linear`` are the format
  transformers 4.57, vLLM (``models/granitemoeshared.py``) and llama.cpp's converter (``GraniteMoeModel``) read;
  ExLlamaV2 has no Granite MoE.
- ERNIE-4.5-MoE (``ernie4_5_moe``): per-expert tensors and a zero ``e_score_correction_bias``; transformers 4.57,
  vLLM (``models/ernie45_moe.py``) and llama.cpp (``ernie4_5-moe``) read them; no ExLlamaV2.
- rope scaling (every runtime but transformers 5): the rules of `rope` (dynamic NTK, yarn's
  attention_factor, longrope's factor), read from the config.json as `rope.rope_fields` spells it.

It reads no tensors and runs no runtime.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from moe_upcycle.checkpoint import names
from moe_upcycle.planning import llamacpp, rope
from moe_upcycle.planning.model_config import head_dim_differs, moe_config
from moe_upcycle.planning.steps import Plan

EXACT = "exact"
RUNS = "runs, not exact"
NO_LOAD = "will not load"
MEASURED = "measured"
CODE = "loader code"
FUSED_ONLY = "transformers >= 5 only"


@dataclass(frozen=True)
class OutputFacts:
    """What the runtimes' loaders care about in one planned output."""

    model_type: str
    layout: str  # "per_expert" or "fused"
    config: dict  # the config.json the build writes
    zero_size: tuple[str, ...]  # tensors with a 0 in their shape
    o_proj_bias: bool  # attention output biases (self_attn.o_proj.bias)
    llamacpp: tuple[str, str] = ("exact", "")  # `llamacpp.verdict`: (status, why)
    fused_scope: str = FUSED_ONLY  # the runtimes that read the fused layout: "transformers >= 5 ... only"
    ties_decide: bool = False  # `Plan.ties_decide`: tied router scores choose between experts that differ
    dense_layers: tuple[int, ...] = ()  # layers that keep the dense MLP (``moe_layers:``, config's mlp_only_layers)

    @property
    def renormalises(self) -> bool:
        """Whether transformers renormalises the top-k routing weights (Mixtral always does)."""
        return self.model_type == "mixtral" or bool(self.config.get("norm_topk_prob"))

    @property
    def all_experts_active(self) -> bool:
        """top-k = all experts: the top-k softmax weights already sum to 1, so renormalising is a no-op."""
        experts_key = names.output_layout(self.model_type).experts_key
        return self.config.get("num_experts_per_tok") == self.config.get(experts_key)

    @property
    def some_layers_slide(self) -> bool:
        """Qwen-MoE: a window on some layers only (``layer_types`` mixes sliding and full attention)."""
        types = self.config.get("layer_types") or []
        return (bool(self.config.get("use_sliding_window")) and bool(self.config.get("sliding_window"))
                and "full_attention" in types and "sliding_attention" in types)

    @property
    def head_dim_differs(self) -> bool:
        """head_dim is not hidden_size / num_attention_heads (Mistral-Nemo, Qwen3)."""
        return head_dim_differs(self.config)

    @property
    def shared_expert(self) -> bool:
        return bool(self.config.get("shared_expert_intermediate_size"))


@dataclass(frozen=True)
class Verdict:
    """One runtime's verdict on an output."""

    runtime: str
    status: str  # EXACT, RUNS or NO_LOAD
    why: str = ""
    basis: str = CODE

    def line(self) -> str:
        return f"{self.runtime}: {self.status}" + (f" ({self.why})" if self.why else "") + f" [{self.basis}]"


def output_facts(plan: Plan) -> OutputFacts:
    """The loader-relevant facts of a planned output (headers and config only)."""
    layout = names.output_layout(plan.architecture)
    zero = tuple(s.name for s in plan.steps if math.prod(s.shape) == 0)
    cfg = moe_config(plan)
    return OutputFacts(
        model_type=layout.model_type, layout=plan.layout, config=cfg, zero_size=zero,
        o_proj_bias=any(s.name.endswith("self_attn.o_proj.bias") for s in plan.steps),
        llamacpp=llamacpp.verdict(plan), fused_scope=fused_scope(plan.architecture), ties_decide=plan.ties_decide,
        dense_layers=plan.dense_layers,
    )


def fused_scope(architecture: str) -> str:
    """Where the fused expert layout of `architecture` loads, e.g. "transformers >= 5 only".

    Example:
        >>> fused_scope("mixtral"), fused_scope("qwen3_moe")
        ('transformers >= 5 only', 'transformers >= 5 and llama.cpp only')
    """
    return "transformers >= 5 and llama.cpp only" if llamacpp.LLAMACPP[architecture].converts_fused else FUSED_ONLY


TIES = ("gate_mode uniform ties every expert's score: its GPU top-k breaks the tie its own way, and these experts "
        "differ")


def _transformers5(f: OutputFacts) -> Verdict:
    return Verdict("transformers 5", EXACT, "the reference `moe-upcycle verify` compares with", MEASURED)


def _transformers4(f: OutputFacts) -> Verdict:
    if f.model_type == "qwen3_5_moe_text":
        return Verdict("transformers 4.x", NO_LOAD, "4.57 has no Qwen3.5 or Qwen3.5-MoE classes (they came with "
                       "transformers 5)", MEASURED)
    if f.layout == "fused":
        return Verdict("transformers 4.x", NO_LOAD, f"fused expert tensors are {f.fused_scope}; the shards' "
                       f"safetensors format makes 4.x refuse them instead of loading random experts", MEASURED)
    if f.model_type == "qwen2_moe" and f.head_dim_differs:
        cfg = f.config
        return Verdict("transformers 4.x", NO_LOAD, f"its Qwen2-MoE needs head_dim = hidden_size / num_attention_heads "
                       f"({cfg['hidden_size'] // cfg['num_attention_heads']}), not {cfg['head_dim']}", MEASURED)
    if f.model_type == "qwen2_moe" and f.some_layers_slide:
        return Verdict("transformers 4.x", RUNS, "its Qwen2-MoE applies sliding_window to every layer (eager/sdpa "
                       "attention ignore layer_types and max_window_layers), the base only to some", MEASURED)
    problem = rope.problem("transformers 4.x", f.config)
    if problem:
        return Verdict("transformers 4.x", RUNS, problem, MEASURED)
    dense = ", dense layers built from mlp_only_layers" if f.dense_layers else ""
    if f.model_type == "granitemoeshared":
        return Verdict("transformers 4.x", EXACT, "4.57 reads input_linear / output_linear as written", MEASURED)
    return Verdict("transformers 4.x", EXACT, f"4.57, per-expert tensors{dense}", MEASURED)


def _vllm(f: OutputFacts) -> Verdict:
    if f.model_type == "ernie4_5_moe":  # models/ernie45_moe.py
        return Verdict("vLLM", EXACT, "its ernie45_moe reads per-expert tensors and e_score_correction_bias, and "
                       "renormalises the top-k weights as transformers does; not run here (GPU)")
    if f.model_type == "granitemoeshared":  # models/granitemoeshared.py: input_linear split into w1/w3
        return Verdict("vLLM", EXACT, "its granitemoeshared reads input_linear / output_linear and the multipliers; "
                       "softmax of the top-k logits, as transformers; not run here (GPU)")
    if f.model_type == "qwen3_5_moe_text":  # models/qwen3_5.py: fused_expert_params_mapping, layer_types
        return Verdict("vLLM", EXACT, "its qwen3_5 reads the fused experts.gate_up_proj / down_proj and layer_types "
                       "(Gated DeltaNet and full attention), its MoE block is Qwen3-Next's with the sigmoid-gated "
                       "shared expert; not run here (GPU)")
    if f.layout == "fused":
        return Verdict("vLLM", NO_LOAD, f"its loaders read per-expert tensors; fused is {f.fused_scope}")
    if f.model_type == "qwen2_moe":
        cfg = f.config
        if f.head_dim_differs:
            return Verdict("vLLM", NO_LOAD, f"its qwen2_moe takes head_dim = hidden_size / num_attention_heads, "
                           f"not head_dim {cfg['head_dim']}")
        if not f.shared_expert and any(".shared_expert." in n for n in f.zero_size):
            return Verdict("vLLM", NO_LOAD, "with shared_expert_intermediate_size 0 it builds no shared expert, "
                           "so it has no parameter for the zero-size shared_expert tensors")
    problem = rope.problem("vLLM", f.config)
    if problem:
        return Verdict("vLLM", RUNS, problem)
    if f.o_proj_bias:
        return Verdict("vLLM", RUNS, f"its {f.model_type} has no attention-output bias and skips "
                       f"self_attn.o_proj.bias")
    if f.ties_decide:
        return Verdict("vLLM", RUNS, TIES)
    if f.model_type == "glm4_moe":  # vllm/model_executor/models/glm4_moe.py
        return Verdict("vLLM", EXACT, "its glm4_moe: sigmoid scoring with e_score_correction_bias, grouped top-k "
                       "(n_group, topk_group), renormalize=norm_topk_prob, routed_scaling_factor, the first "
                       "first_k_dense_replace layers dense, partial_rotary_factor from rope_parameters; not run here "
                       "(GPU)")
    dense = " and mlp_only_layers / decoder_sparse_step (its qwen2_moe / qwen3_moe build a dense MLP there)"
    return Verdict("vLLM", EXACT, f"honours norm_topk_prob{dense if f.dense_layers else ''}; not run here (GPU)")


def _llama_cpp(f: OutputFacts) -> Verdict:
    if f.zero_size:
        return Verdict("llama.cpp", NO_LOAD, f"it refuses zero-size tensors ({f.zero_size[0]}: shape with a 0)",
                       MEASURED)
    status, why = f.llamacpp  # the rules of `llamacpp`, measured case by case by scripts/check_llamacpp.py
    return Verdict("llama.cpp", status, why, MEASURED)


def _exllamav2(f: OutputFacts) -> Verdict:
    if f.model_type == "qwen3_5_moe_text":
        return Verdict("ExLlamaV2", NO_LOAD, "it has no Qwen3_5MoeForCausalLM (no linear-attention layers)")
    if f.model_type in ("granitemoeshared", "ernie4_5_moe"):
        return Verdict("ExLlamaV2", NO_LOAD, f"it has no {f.model_type} architecture")
    if f.model_type in ("qwen2_moe", "glm4_moe"):
        return Verdict("ExLlamaV2", NO_LOAD, f"it has no {names.output_layout(f.model_type).class_name}: it falls "
                       f"back to Llama and finds no dense mlp.gate_proj")
    if f.layout == "fused":
        return Verdict("ExLlamaV2", NO_LOAD, f"it reads per-expert tensors; fused is {f.fused_scope}")
    if f.dense_layers:
        return Verdict("ExLlamaV2", NO_LOAD, "MoE is a switch per architecture there (is_moe: every layer is built as "
                       "an MoE block) and its config reads no mlp_only_layers / decoder_sparse_step, so it looks "
                       "for experts in the dense layers")
    if f.model_type == "qwen3_moe" and not f.renormalises and not f.all_experts_active:
        return Verdict("ExLlamaV2", RUNS, "it always renormalises the top-k weights, but norm_topk_prob is false")
    problem = rope.problem("ExLlamaV2", f.config)
    if problem:
        return Verdict("ExLlamaV2", RUNS, problem)
    if f.ties_decide:
        return Verdict("ExLlamaV2", RUNS, TIES)
    return Verdict("ExLlamaV2", EXACT, "CUDA, fp16 arithmetic; not run here")


RULES: dict[str, Callable[[OutputFacts], Verdict]] = {
    "transformers 5": _transformers5,
    "transformers 4.x": _transformers4,
    "vLLM": _vllm,
    "llama.cpp": _llama_cpp,
    "ExLlamaV2": _exllamav2,
}


def compatibility(plan: Plan) -> list[Verdict]:
    """Every runtime's verdict on a planned output, in `RULES` order.

    Example:
        >>> [v.status for v in compatibility(mixtral_plan)]  # doctest: +SKIP
        ['exact', 'exact', 'exact', 'exact', 'exact']
    """
    facts = output_facts(plan)
    return [rule(facts) for rule in RULES.values()]


def markdown(verdicts: list[Verdict]) -> list[str]:
    """The verdicts as a markdown table, for the model card."""
    out = ["| runtime | verdict | why | basis |", "|---|---|---|---|"]
    return out + [f"| {v.runtime} | {v.status} | {v.why.replace('|', '/')} | {v.basis} |" for v in verdicts]


def runtime_section(plan: Plan) -> str:
    """The model card's "Runtimes" section: where this output runs, and how exactly."""
    verdicts = compatibility(plan)
    only = f" The fused expert layout is {fused_scope(plan.architecture)}." if plan.layout == "fused" else ""
    intro = (f"Where this {plan.architecture} checkpoint runs (moe-upcycle's compatibility report: *exact* = "
             f"the function transformers 5 computes, up to rounding).{only}")
    return "\n".join(["## Runtimes", "", intro, "", *markdown(verdicts)])
