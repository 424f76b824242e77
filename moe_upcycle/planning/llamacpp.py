"""What llama.cpp computes for our MoE outputs, and the constants we write so that it can.

Facts read from llama.cpp's source as vendored by the llama-cpp-python 0.3.36 sdist (ggml 0.25.3):
``src/models/llama.cpp``, ``src/models/qwen2moe.cpp``, ``src/models/qwen3moe.cpp`` and
``llm_graph_context::build_moe_ffn`` in ``src/llama-graph.cpp``. ``scripts/check_llamacpp.py``
measures them (convert with ``convert_hf_to_gguf.py``, compare logits with transformers).

- Every MoE layer: softmax over **all** router logits, then top-k (``ggml_argsort_top_k``), then the
  selected probabilities as weights. Mixtral (llama.cpp arch ``llama``) and ``qwen3moe`` renormalise
  them to sum 1 (``norm_w = true``); ``qwen2moe`` never does (``norm_w = false``, hard-coded: the GGUF
  carries no ``norm_topk_prob``). Transformers' Qwen2-MoE renormalises when ``norm_topk_prob: true``
  (what we write, so identical experts reproduce the dense FFN), so with ``experts_per_token`` below
  the expert count the two runtimes compute different functions: llama.cpp's routed output is
  ``sum_{top-k} p_e E_e(x)`` with ``sum_{top-k} p_e < 1``. With every expert active the top-k mass is the
  whole softmax (1 to fp32 rounding) and they agree.
- ``qwen2moe``'s shared expert: all four tensors are required, sized ``n_ff_shexp`` — or the dense
  ``n_ff`` when the GGUF says 0, so a 0-wide shared expert does not load. Its gate is evaluated as
  ``silu(z) / z`` with ``z = g . x``: NaN when z is exactly 0 (the zero gate the exact split used).
  ``output.weight`` is required (no fallback to tied embeddings).
- ``qwen3moe`` loads q/k/v biases but has no ``attn_output.bias``: a Qwen3 with ``attention_bias: true``
  (o_proj bias) does not load — the dense Qwen3 does not either.
- None of the three has sliding-window attention (the converter writes no window for them): a base
  that transformers runs through a window (Mistral v0.1's 4096, a Qwen with ``use_sliding_window:
  true``) agrees up to that many tokens and differs beyond.
- ``qwen2moe`` sizes q and o ``hidden x hidden``: a ``head_dim`` other than hidden / heads (Mistral-Nemo)
  does not load. ``llama`` and ``qwen3moe`` read ``head_dim``.
- ``rope_type: llama3`` becomes ``rope_freqs`` in the converter's llama only; ``qwen2moe`` / ``qwen3moe``
  rotate with unscaled frequencies. The converter writes nothing for ``dynamic`` (unscaled: identical up
  to ``max_position_embeddings``); linear and yarn (with ``original_max_position_embeddings``, which
  `rope.rope_fields` always writes) convert for all three (`rope.problem`).
- Qwen3.5-MoE (``qwen35moe``, ``src/models/qwen35moe.cpp``): softmax, top-k, renormalised; the shared gate is a
  plain ``ggml_sigmoid``; ``output.weight`` optional. Its converter (``Qwen3_5MoeTextModel``) asserts that the
  folder has multi-token-prediction layers (``mtp.*``) unless run with ``--no-mtp``: an upcycled model has none.
- The converter's qwen2moe / qwen3moe split transformers-5 fused experts (``gate_up_proj``); its llama
  (Mixtral) cannot map them.
- A dense layer between MoE layers (``moe_layers:``, transformers' ``mlp_only_layers``) has no place in
  either: ``gguf-py``'s tensor lists for ``QWEN2MOE`` / ``QWEN3MOE`` have no dense ``FFN_GATE/UP/DOWN``, so the
  converter cannot map ``mlp.gate_proj``, and ``src/models/qwen2moe.cpp`` / ``qwen3moe.cpp`` create
  ``ffn_gate_inp`` and the expert tensors for every layer as required tensors (flag 0), reading no
  ``mlp_only_layers`` / ``decoder_sparse_step``. Such a folder does not convert; converted with dense names
  forced into the converter's table, the GGUF does not load ("tensor 'blk.0.ffn_gate_inp.weight' not found").

- ``glm4moe`` (``conversion/glm.py``, ``src/models/glm4-moe.cpp``): sigmoid gating with ``exp_probs_b`` (the
  correction bias) for the choice, ``expert_weights_norm`` / ``expert_weights_scale`` from ``norm_topk_prob`` /
  ``routed_scaling_factor``, a leading dense block (``first_k_dense_replace``), q/k/v biases and q/k norms, and
  shared-expert tensors only when ``n_shared_experts`` > 0 (0-wide ones make "wrong number of tensors"). Its
  converter's vocabulary step looks up GLM's special tokens (``[gMASK]`` ...), a KeyError for any other
  tokenizer: `verdict` says "will not load", and what the weights do once the vocabulary is written otherwise.

So we write (a) a shared expert at least 1 wide, zeros when there is none (adds exactly 0 in both
runtimes), (b) the "constant" shared gate as tiny equal entries `half_gate_value` instead of zeros:
sigmoid(z) = 1/2 to fp32 rounding for any realistic x and z != 0, so llama.cpp's silu(z)/z is 1/2
too, and (c) ``lm_head.weight`` for Qwen2-MoE even when the embeddings are tied. It does not change
routing: where llama.cpp cannot mean what transformers means, `verdict` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from moe_upcycle.planning import rope as rope_rules
from moe_upcycle.planning import windows
from moe_upcycle.planning.model_config import head_dim_differs, moe_config

if TYPE_CHECKING:
    from moe_upcycle.planning.steps import Plan

LLAMACPP_SOURCE = "llama.cpp as vendored by llama-cpp-python 0.3.36 (PyPI sdist)"
EMPTY_SHARED_EXPERT_SIZE = 1  # intermediate size of the all-zero shared expert written when there is none


@dataclass(frozen=True)
class LlamaCppArch:
    """How llama.cpp runs one of our output architectures."""

    name: str  # llama.cpp's architecture (general.architecture in the GGUF)
    renormalises_top_k: bool  # top-k softmax weights divided by their sum
    shared_gate: Optional[str] = None  # how the shared expert's sigmoid gate is computed
    needs_lm_head: bool = False  # output.weight required even with tied embeddings
    loads_o_proj_bias: bool = True
    free_head_dim: bool = True  # q/o sized heads x head_dim (False: hidden x hidden, so head_dim must be hidden/heads)
    llama3_rope: bool = False  # the converter writes rope_freqs for rope_type llama3 (only its llama does)
    converts_fused: bool = True  # the converter splits transformers-5 fused experts (gate_up_proj, down_proj)
    convert_flags: str = ""  # what convert_hf_to_gguf.py must be told for our output
    # GLM-4-MoE (`glm4`): routing as the GGUF says (expert_weights_norm / _scale from norm_topk_prob and
    # routed_scaling_factor, sigmoid gating, exp_probs_b), a leading dense block (first_k_dense_replace), and a
    # converter whose vocabulary step needs the model's tokenizer to hold these special tokens
    reads_norm_topk_prob: bool = False
    loads_leading_dense: bool = False
    gating: str = "softmax over all experts, then top-k"
    vocab_tokens: tuple[str, ...] = ()


LLAMACPP: dict[str, LlamaCppArch] = {
    "mixtral": LlamaCppArch("llama", renormalises_top_k=True, llama3_rope=True, converts_fused=False),
    "qwen2_moe": LlamaCppArch("qwen2moe", renormalises_top_k=False, shared_gate="silu(z) / z (NaN at z = 0)",
                              needs_lm_head=True, free_head_dim=False),
    "qwen3_moe": LlamaCppArch("qwen3moe", renormalises_top_k=True, loads_o_proj_bias=False),
    # src/models/qwen35moe.cpp: build_moe_ffn with norm_w = true; the shared gate is ggml_sigmoid; output.weight
    # optional (tied embeddings load); convert_hf_to_gguf.py's Qwen3_5MoeTextModel splits fused experts
    "qwen3_5_moe_text": LlamaCppArch("qwen35moe", renormalises_top_k=True, shared_gate="sigmoid(z)",
                                     loads_o_proj_bias=False, convert_flags="--no-mtp"),
    # src/models/granite.cpp (LLM_ARCH_GRANITE_MOE): softmax, top-k, norm_w = true; the converter's GraniteMoeModel
    # splits input_linear and writes the multipliers as attention / embedding / residual / logit scales
    "granitemoeshared": LlamaCppArch("granitemoe", renormalises_top_k=True),
    # conversion/glm.py's Glm4MoeModel and src/models/glm4-moe.cpp
    "glm4_moe": LlamaCppArch("glm4moe", renormalises_top_k=True, converts_fused=False, reads_norm_topk_prob=True,
                             loads_leading_dense=True,
                             gating="sigmoid scores (+ e_score_correction_bias for the choice), top-k, weights from "
                                    "the sigmoid scores times routed_scaling_factor",
                             vocab_tokens=("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")),
    # src/models/ernie4-5-moe.cpp: softmax, top-k with the exp_probs_b correction bias (zeros here), norm_w = true
    "ernie4_5_moe": LlamaCppArch("ernie4_5-moe", renormalises_top_k=True, loads_o_proj_bias=False),
}
GATING = "softmax over all experts, then top-k"


def half_gate_value(dtype: torch.dtype) -> float:
    """The entry of the "constant" shared-expert gate: sigmoid(g . x) is 1/2 and g . x is not 0.

    With every entry v, z = v * sum(x) and sigmoid(z) - 1/2 is at most |z| / 4. v = 2^-64 (fp32,
    bf16: same exponent range) leaves |z| < 2^-25, where fp32 rounds sigmoid(z) to exactly 1/2, for any
    sum(x) below 2^39. fp16 cannot hold 2^-64, so it gets its smallest subnormal 2^-24: the gate is
    then 1/2 to a relative 2^-25 * |sum(x)| (3e-6 for sum(x) = 100). Only x = 0 (a zero hidden state,
    which no gate can help) still gives z = 0.

    Example:
        >>> half_gate_value(torch.float32) == 2.0 ** -64
        True
    """
    return 2.0 ** -24 if dtype == torch.float16 else 2.0 ** -64


def half_gate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The "constant" shared-expert gate (1, H): every entry `half_gate_value`."""
    return torch.full(shape, half_gate_value(dtype), dtype=dtype)


def verdict(plan: "Plan", vocab: bool = True) -> tuple[str, str]:
    """How the planned output runs in llama.cpp: ("exact" | "runs, not exact" | "will not load", why).

    "exact" means llama.cpp computes what transformers computes (logits equal to fp32 rounding);
    whether that is the dense model's function is the plan's other notes' business. `vocab`: False judges the
    weights alone, as if the converter's vocabulary step had passed (`scripts/check_llamacpp.py` measures both).
    """
    arch = LLAMACPP[plan.architecture]
    if vocab and arch.vocab_tokens:
        return ("will not load", f"convert_hf_to_gguf.py's {plan.architecture} converter (Glm4MoeModel._set_vocab_glm) "
                                 f"looks up GLM's special tokens {', '.join(arch.vocab_tokens)} in the tokenizer, which "
                                 f"a {plan.base_config.model_type} tokenizer lacks (KeyError '[gMASK]'); with the "
                                 f"vocabulary written by the converter's gpt2 path instead, llama.cpp "
                                 f"{verdict(plan, vocab=False)[0]}")
    if plan.dense_layers and not (arch.loads_leading_dense and plan.dense_layers == tuple(range(len(plan.dense_layers)))):
        first = plan.dense_layers[0]
        return ("will not load", f"dense layers between MoE layers (moe_layers): convert_hf_to_gguf.py's {arch.name} "
                                 f"has no GGUF name for a dense MLP (\"Can not map tensor "
                                 f"'model.layers.{first}.mlp.down_proj.weight'\"), and llama.cpp's {arch.name} "
                                 f"loader requires a router and experts in every layer (\"tensor "
                                 f"'blk.{first}.ffn_gate_inp.weight' not found\"); for llama.cpp leave moe_layers out "
                                 f"(every layer an MoE layer)")
    if plan.layout == "fused" and not arch.converts_fused:
        return ("will not load", f"convert_hf_to_gguf.py's {arch.name} maps per-expert tensors only (\"Can not map "
                                 f"tensor ...mlp.experts.gate_up_proj\"); write layout: per_expert")
    names = {s.name for s in plan.steps}
    if not arch.loads_o_proj_bias and any(n.endswith("self_attn.o_proj.bias") for n in names):
        return ("will not load", f"llama.cpp's {arch.name} has no attention output bias (self_attn.o_proj.bias) "
                                 f"and refuses a GGUF with extra tensors; the dense base does not load either")
    cfg = moe_config(plan)  # what the build writes: what the converter reads
    heads, head_dim = cfg["num_attention_heads"], cfg["head_dim"]
    if not arch.free_head_dim and head_dim_differs(cfg):
        return ("will not load", f"llama.cpp's {arch.name} sizes the attention q/o projections hidden x hidden "
                                 f"({cfg['hidden_size']}), but head_dim {head_dim} x {heads} heads is "
                                 f"{heads * head_dim}; use architecture: mixtral (or qwen3_moe)")
    sliding = [w for w in windows.dense_windows(plan.base_config) if w]
    if sliding:
        return ("runs, not exact",
                f"llama.cpp's {arch.name} has no sliding-window attention: it attends over the whole context, "
                f"transformers through a window of {min(sliding)} tokens on {len(sliding)} of "
                f"{cfg['num_hidden_layers']} layers; identical up to {min(sliding)} tokens, different beyond")
    rope_problem = rope_rules.problem("llama.cpp", cfg)
    if rope_problem:
        return ("runs, not exact", f"{rope_problem}")
    rope = cfg.get("rope_scaling") or {}
    if not arch.llama3_rope and str(rope.get("rope_type", rope.get("type", ""))).lower() == "llama3":
        return ("runs, not exact", f"rope_type llama3: convert_hf_to_gguf.py writes the llama3 rope frequencies "
                                   f"(rope_freqs) for llama only, so llama.cpp's {arch.name} rotates with unscaled "
                                   f"frequencies; use architecture: mixtral")
    experts = len(plan.expert_names)
    if arch.reads_norm_topk_prob:
        pass  # the GGUF carries norm_topk_prob (expert_weights_norm): llama.cpp does what transformers does
    elif not arch.renormalises_top_k and plan.norm_topk_prob and plan.experts_per_token < experts:
        return ("runs, not exact",
                f"llama.cpp's {arch.name} never renormalises the top-{plan.experts_per_token} router weights "
                f"(it ignores norm_topk_prob: true), so each MoE layer's routed output is scaled by the top-"
                f"{plan.experts_per_token} softmax mass (< 1, per token) there; exact only with "
                f"experts_per_token: {experts} (all experts active), norm_topk_prob: false (transformers then "
                f"computes what llama.cpp does) or architecture: qwen3_moe / mixtral")
    if arch.renormalises_top_k and not plan.norm_topk_prob and plan.experts_per_token < experts \
            and not arch.reads_norm_topk_prob:
        return ("runs, not exact",
                f"llama.cpp's {arch.name} always renormalises the top-{plan.experts_per_token} router weights, and "
                f"this config says norm_topk_prob: false (transformers does not); exact with norm_topk_prob: true "
                f"or experts_per_token: {experts}")
    if plan.ties_decide:
        k, dense = plan.experts_per_token, plan.base_config.intermediate_size
        g = dense // plan.expert_intermediate_size if plan.expert_intermediate_size and dense else 1
        if g > 1 and k % g == 0 and experts % g == 0:  # split: experts 0..k-1 are k/G whole virtual groups
            return ("runs, not exact", f"gate_mode uniform ties every expert's score; llama.cpp breaks the tie with the "
                                       f"lowest-indexed experts, 0 to {k - 1}, {k // g} whole virtual group(s) of this "
                                       f"split, so it computes the dense FFN; torch.topk's order may take halves of "
                                       f"different groups (top-2 of 8 on a CPU: experts 6 and 5), so transformers can "
                                       f"differ from it; the same in both with experts_per_token: {experts}")
        return ("runs, not exact", f"gate_mode uniform ties every expert's score, and llama.cpp breaks the tie with "
                                   f"the lowest-indexed experts, torch.topk not always (top-2 of 4 on a CPU: experts "
                                   f"2 and 3); these experts differ, so the outputs do; exact with "
                                   f"experts_per_token: {experts}")
    how = ("renormalised as in transformers" if arch.renormalises_top_k and plan.norm_topk_prob else
           "not renormalised, as norm_topk_prob: false says" if arch.reads_norm_topk_prob else
           "not renormalised, as in transformers with norm_topk_prob: false" if not arch.renormalises_top_k
           and not plan.norm_topk_prob else "all experts active, so the weights already sum to 1")
    flags = f"; convert with {arch.convert_flags}" if arch.convert_flags else ""
    return ("exact", f"{arch.gating}, {how}{flags}")


def plan_note(plan: "Plan") -> str:
    """One plan/card line: the llama.cpp verdict and its reason."""
    status, why = verdict(plan)
    return f"llama.cpp: {status} ({why})"
