"""Do our MoE outputs run right in llama.cpp? Convert each to GGUF and compare logits with transformers.

For each case: build a tiny dense model (random, seeded, hidden 64), upcycle it with
``python -m moe_upcycle build``, convert the output with llama.cpp's own ``convert_hf_to_gguf.py``
(``--outtype f32``, or the case's f16 / bf16), evaluate the same token ids in transformers (fp32) and in
llama.cpp (CPU, f32 KV cache) and print max |Δlogit| / max |logit| per case, or why llama.cpp refused the
file. The dense models themselves are checked too: that row is the converter/runtime's own floor.

Each case's expectation is the plan's own llama.cpp verdict (``runtimes.compatibility``: exact -> equal,
runs, not exact -> differs, will not load -> fails; a window verdict expects equal when the text is
shorter than the window) and must also be what the case is written to show: a row marked UNEXPECTED is
a verdict that does not match llama.cpp.

llama.cpp comes from ``scripts/build_llamacpp.sh`` (the pinned llama-cpp-python sdist, built outside
the repo); this script imports its converter, gguf-py and ctypes bindings from there. Nothing from it
is installed. Not part of pytest: it needs that build (5.5 min on 2 shared cores); its 75 cases (103 rows with
the dense models) take ~13 min, plus ~20 min for the 10 glm4_moe ones (``--only glm4``: 1157 s on 2 shared cores)::

    scripts/build_llamacpp.sh /tmp/llamacpp
    python scripts/check_llamacpp.py --llamacpp /tmp/llamacpp [--only qwen2] [--json out.json]

Our tiny models' tokenizer is a freshly trained byte-level BPE whose pre-tokenizer hash the converter
does not know; we feed token ids, never text, so the converter is told it is "gpt-2" (the regex a
ByteLevel pre-tokenizer uses). Exit status 1 when a case expected to agree does not.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moe_upcycle.checkpoint.tiny import make_dense_model, make_finetune  # noqa: E402 (after sys.path)

TEXT = "Once upon a time there was a little dragon. def add(a, b): return a + b"
TOLERANCE = 1e-4  # relative to max |logit|: what the issue asks of "equal logits"
# a 16-bit GGUF is run with 16-bit weights and (CPU) 16-bit activations in every matmul: its own rounding
TOLERANCE_16 = {"bf16": 3e-2, "f16": 4e-3}
WINDOW = 8  # the small sliding window the text (~30 tokens) crosses
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# run the converter with an unknown BPE pre-tokenizer hash mapped to "gpt-2" (see the module docstring)
CONVERT = """
import sys
sys.path[:0] = [{src!r}, {gguf!r}, {pydeps!r}]
import conversion.base as base
for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        original = cls.get_vocab_base_pre
        def patched(self, tokenizer, _original=original):
            try:
                return _original(self, tokenizer)
            except NotImplementedError:
                return "gpt-2"
        cls.get_vocab_base_pre = patched
# ERNIE's converter reads a SentencePiece tokenizer.model; the tiny models' byte-level BPE is read as GPT-2's
# (we feed token ids, so only the vocabulary's size matters)
import conversion.ernie as ernie
ernie.Ernie4_5Model.set_vocab = lambda self: self._set_vocab_gpt2()
{extra}
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}, *{flags!r}]
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""
# give the converter's qwen2moe / qwen3moe names for a dense MLP (they have none), so that an interleaved
# (moe_layers) output reaches llama.cpp's loader: what the loader does with dense layers is then measured too
DENSE_NAMES = """
import gguf
for arch in (gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.QWEN3MOE):
    gguf.MODEL_TENSORS[arch] += [gguf.MODEL_TENSOR.FFN_GATE, gguf.MODEL_TENSOR.FFN_UP, gguf.MODEL_TENSOR.FFN_DOWN]
"""

# the converter's GLM-4-MoE vocabulary step looks up GLM's own special tokens ([gMASK], <|user|>, ...), which a
# Llama / Qwen tokenizer lacks: write the vocabulary by its plain gpt2 path instead, to measure the weights
GLM_VOCAB = """
import conversion.glm as glm
glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
"""

@dataclass
class Case:
    name: str
    base: str  # dense family: llama, qwen2, qwen3, qwen2_tied
    recipe: dict  # YAML fields beyond base_model / experts (architecture, experts_per_token, ...)
    experts: int = 4
    routed_scale: float | None = None
    shared: int = 0  # shared experts copied from the base (qwen2_moe)
    expect: str = "equal"  # what the case is written to show: "equal", "differs" (known why) or "fails"
    why: str = ""
    outtype: str = "f32"  # convert_hf_to_gguf --outtype
    experts_from: tuple = ()  # per expert: (dense model name, extra fields); default: copies of `base`
    dense_names: bool = False  # convert with `DENSE_NAMES` patched in
    glm_vocab: bool = False  # convert with `GLM_VOCAB` patched in
    result: dict = field(default_factory=dict)


def cases() -> list[Case]:
    """Every output architecture from every input family, and each qwen2_moe recipe docs/architectures.md shows
    (its exact shared split: the "README shared split" cases, named when it was in the README)."""
    no_renorm = ("llama.cpp's qwen2moe never renormalises the top-k weights; transformers does "
                 "(norm_topk_prob: true), so with experts_per_token < experts the two differ")
    # the input families each output can hold (the tool refuses the rest at plan time)
    out = [
        Case("llama->mixtral", "llama", {"architecture": "mixtral"}),
        Case("mistral->mixtral", "mistral", {"architecture": "mixtral"}),
        Case("qwen3->qwen3_moe", "qwen3", {"architecture": "qwen3_moe"}),
        Case("qwen3 tied+bias->qwen3_moe", "qwen3_tied_bias", {"architecture": "qwen3_moe"}, expect="fails",
             why="llama.cpp's qwen3moe has no attn_output.bias (o_proj bias); its dense qwen3 neither"),
        Case("llama->qwen2_moe no shared, k=2", "llama", {"architecture": "qwen2_moe"},
             expect="differs", why=no_renorm),
        Case("llama->qwen2_moe no shared, k=4 of 4", "llama", {"architecture": "qwen2_moe", "experts_per_token": 4}),
        Case("qwen2->qwen2_moe no shared, k=2", "qwen2", {"architecture": "qwen2_moe"},
             expect="differs", why=no_renorm),
        Case("qwen2->qwen2_moe no shared, k=4 of 4", "qwen2", {"architecture": "qwen2_moe", "experts_per_token": 4}),
        Case("qwen2->qwen2_moe README shared split, k=2", "qwen2", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant"}, routed_scale=0.5, shared=1, expect="differs", why=no_renorm),
        Case("qwen2->qwen2_moe README shared split, k=4 of 4", "qwen2", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant", "experts_per_token": 4}, routed_scale=0.5, shared=1),
        Case("qwen2->qwen2_moe 2 shared, k=4 of 4", "qwen2", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant", "experts_per_token": 4}, routed_scale=0.5, shared=2),
        Case("qwen2 tied->qwen2_moe no shared, k=4 of 4", "qwen2_tied",
             {"architecture": "qwen2_moe", "experts_per_token": 4}),
        # fp16 output: the constant gate is 2^-24 there (2^-64 would flush to zero); both runtimes read it in f32
        Case("qwen2->qwen2_moe fp16 README shared split, k=4 of 4", "qwen2", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant", "experts_per_token": 4, "dtype": "float16"}, routed_scale=0.5, shared=1),
        Case("qwen3 tied->qwen3_moe", "qwen3_tied", {"architecture": "qwen3_moe"}),
    ]
    swa = ("llama.cpp's llama / qwen2moe / qwen3moe have no sliding-window attention: they attend over the "
           "whole context, transformers through the window (sequence longer than the window here)")
    no_rope = "llama.cpp's qwen2moe / qwen3moe apply no llama3 rope scaling (rope_freqs is made for llama only)"
    no_dynamic = ("convert_hf_to_gguf.py writes no dynamic NTK scaling: llama.cpp rotates unscaled, transformers "
                  "rescales past max_position_embeddings")
    ft = tuple((f"llama_ft{i}", {}) for i in range(4))
    out += [
        # attention windows: Mistral v0.1 (4096, sequence shorter), a small window the sequence crosses,
        # a Qwen2.5 config whose window is off, a Qwen2 whose upper layers slide
        Case("mistral v0.1 window 4096->mixtral", "mistral_4096", {"architecture": "mixtral"}),
        Case("mistral window 8->mixtral", "mistral_w8", {"architecture": "mixtral"}, expect="differs", why=swa),
        Case("mistral window 8->qwen2_moe k=4 of 4", "mistral_w8", {"architecture": "qwen2_moe",
             "experts_per_token": 4}, expect="differs", why=swa),
        Case("qwen2.5 window off->qwen2_moe k=4 of 4", "qwen25", {"architecture": "qwen2_moe",
             "experts_per_token": 4}),
        Case("qwen2.5 window off->qwen2_moe shared split, k=2", "qwen25", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant"}, routed_scale=0.5, shared=1, expect="differs", why=no_renorm),
        Case("qwen2 layers 1+ slide 8->qwen2_moe k=4 of 4", "qwen2_swa", {"architecture": "qwen2_moe",
             "experts_per_token": 4}, expect="differs", why=swa),
        # rope and head_dim
        Case("llama3 rope->mixtral", "llama3", {"architecture": "mixtral"}),
        Case("llama3 rope->qwen2_moe k=4 of 4", "llama3", {"architecture": "qwen2_moe", "experts_per_token": 4},
             expect="differs", why=no_rope),
        Case("linear rope x2->mixtral", "llama_linear", {"architecture": "mixtral"}),
        Case("yarn rope x4->mixtral", "llama_yarn", {"architecture": "mixtral"}),
        Case("yarn rope x4->qwen2_moe k=4 of 4", "llama_yarn", {"architecture": "qwen2_moe", "experts_per_token": 4}),
        Case("nemo head_dim 32->mixtral", "nemo", {"architecture": "mixtral"}),
        Case("nemo head_dim 32->qwen2_moe k=4 of 4", "nemo", {"architecture": "qwen2_moe", "experts_per_token": 4},
             expect="fails", why="llama.cpp's qwen2moe sizes q/o as hidden x hidden"),
        Case("qwen3 head_dim 32->qwen3_moe", "qwen3_hd32", {"architecture": "qwen3_moe"}),
        # rope scaling as published configs spell it (rope_scaling with type / rope_type, transformers 4.x keys),
        # max_position_embeddings 16 so that the ~30-token text goes past it; the build respells it (`planning.rope`)
        Case("dynamic rope x2 (16 positions)->mixtral", "llama_dynamic", {"architecture": "mixtral"},
             expect="differs", why=no_dynamic),
        Case("dynamic rope x2 (16 positions)->qwen2_moe k=4 of 4", "llama_dynamic",
             {"architecture": "qwen2_moe", "experts_per_token": 4}, expect="differs", why=no_dynamic),
        Case("qwen2.5 yarn x4 (type key)->qwen2_moe k=4 of 4", "qwen25_yarn", {"architecture": "qwen2_moe",
             "experts_per_token": 4}),
        Case("yarn x4 without original_max->mixtral", "llama_yarn_noorig", {"architecture": "mixtral"}),
        Case("yarn x4 beta_fast 16, beta_slow 2->mixtral", "llama_yarn_betas", {"architecture": "mixtral"}),
        Case("yarn x4 attention_factor 0.8->mixtral", "llama_yarn_attn", {"architecture": "mixtral"},
             expect="differs", why="llama.cpp replaces yarn's attention_factor by its default 0.1 ln(factor) + 1"),
        Case("longrope (16 of 64 positions)->mixtral", "llama_longrope", {"architecture": "mixtral"},
             expect="differs", why="convert_hf_to_gguf.py's llama writes no longrope short/long factors"),
        Case("qwen3 yarn x4->qwen3_moe", "qwen3_yarn", {"architecture": "qwen3_moe"}),
        Case("linear rope x2 (type key)->qwen2_moe k=4 of 4", "llama_linear_type", {"architecture": "qwen2_moe",
             "experts_per_token": 4}),
        Case("llama without rope_theta->mixtral", "llama_no_theta", {"architecture": "mixtral"}),
        # tied embeddings for each output
        Case("llama tied->mixtral", "llama_tied", {"architecture": "mixtral"}),
        Case("qwen2 tied->qwen2_moe shared split k=4 of 4", "qwen2_tied", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant", "experts_per_token": 4}, routed_scale=0.5, shared=1),
        # fp16 / bf16 outputs, converted to their own type and to f32
        Case("llama->mixtral bf16 (f32 gguf)", "llama", {"architecture": "mixtral", "dtype": "bfloat16"}),
        Case("llama->mixtral bf16 (bf16 gguf)", "llama", {"architecture": "mixtral", "dtype": "bfloat16"},
             outtype="bf16"),
        Case("qwen3->qwen3_moe fp16 (f16 gguf)", "qwen3", {"architecture": "qwen3_moe", "dtype": "float16"},
             outtype="f16"),
        Case("qwen2->qwen2_moe bf16 shared split k=4 of 4 (bf16 gguf)", "qwen2", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant", "experts_per_token": 4, "dtype": "bfloat16"}, routed_scale=0.5,
             shared=1, outtype="bf16"),
        # the converter's default for an fp32 model is f16, but it keeps the shared gate (ffn_gate_inp_shexp) in f32
        Case("qwen2->qwen2_moe README shared split, k=4 of 4 (f16 gguf)", "qwen2", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant", "experts_per_token": 4}, routed_scale=0.5, shared=1, outtype="f16"),
        # expert_init: not the dense function, but llama.cpp must compute what transformers computes
        Case("llama->mixtral noise", "llama", {"architecture": "mixtral",
             "expert_init": {"method": "noise", "scale": 0.05}}),
        Case("llama->mixtral drop 0.5", "llama", {"architecture": "mixtral",
             "expert_init": {"method": "drop", "ratio": 0.5}}),
        Case("llama->mixtral split 2", "llama", {"architecture": "mixtral",
             "expert_init": {"method": "split", "granularity": 2}}),
        Case("qwen3->qwen3_moe split 2 shuffled", "qwen3", {"architecture": "qwen3_moe",
             "expert_init": {"method": "split", "granularity": 2, "shuffle": True}}),
        Case("qwen2->qwen2_moe drop, k=4 of 4", "qwen2", {"architecture": "qwen2_moe", "experts_per_token": 4,
             "expert_init": {"method": "drop", "ratio": 0.5}}),
        # frankenMoE from different fine-tunes, and experts from a deeper model's layers
        Case("llama fine-tunes->mixtral", "llama", {"architecture": "mixtral"}, experts_from=ft),
        Case("llama fine-tunes->qwen2_moe + shared, k=4 of 4", "llama", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant", "experts_per_token": 4}, shared=1, experts_from=ft),
        Case("llama fine-tunes->qwen2_moe + shared, k=2", "llama", {"architecture": "qwen2_moe",
             "shared_expert_gate": "constant"}, shared=1, experts_from=ft, expect="differs", why=no_renorm),
        Case("llama + layers [2, 4) of a 4-layer->mixtral", "llama", {"architecture": "mixtral"},
             experts_from=(("llama", {}), ("llama", {}), ("llama_deep", {"layers": [2, 4]}),
                           ("llama_deep", {"layers": [0, 2]}))),
        # the fused (transformers-5) expert layout
        Case("llama->mixtral fused", "llama", {"architecture": "mixtral", "layout": "fused"}, expect="fails",
             why="convert_hf_to_gguf's llama reads per-expert tensors"),
        Case("qwen2->qwen2_moe fused k=4 of 4", "qwen2", {"architecture": "qwen2_moe", "layout": "fused",
             "experts_per_token": 4}),
        Case("qwen3->qwen3_moe fused", "qwen3", {"architecture": "qwen3_moe", "layout": "fused"}),
    ]
    # interleaved dense / MoE layers (moe_layers: the sparse-upcycling recipe), 4-layer bases: the converter has
    # no name for a dense MLP in qwen2moe / qwen3moe; given one, the loader wants a router in every layer
    dense = "convert_hf_to_gguf.py's qwen2moe / qwen3moe cannot map a dense MLP (mlp.down_proj)"
    loader = "llama.cpp's qwen2moe / qwen3moe loader requires ffn_gate_inp (a router) in every layer"
    every_other = {"moe_layers": {"every": 2}}
    out += [
        Case("qwen3 4L->qwen3_moe moe_layers every 2", "qwen3_4l", {"architecture": "qwen3_moe", **every_other},
             expect="fails", why=dense),
        Case("qwen3 4L->qwen3_moe every 2, dense names forced", "qwen3_4l",
             {"architecture": "qwen3_moe", **every_other}, expect="fails", why=loader, dense_names=True),
        Case("llama 4L->qwen2_moe moe_layers [1,3] k=4 of 4", "llama_4l", {"architecture": "qwen2_moe",
             "experts_per_token": 4, "moe_layers": [1, 3]}, expect="fails", why=dense),
        Case("llama 4L->qwen2_moe [1,3], dense names forced", "llama_4l",
             {"architecture": "qwen2_moe", "experts_per_token": 4, "moe_layers": [1, 3]}, expect="fails", why=loader,
             dense_names=True),
        # the same bases with every layer MoE: the floor the interleaved cases are compared with
        Case("qwen3 4L->qwen3_moe every layer", "qwen3_4l", {"architecture": "qwen3_moe"}),
        Case("llama 4L->qwen2_moe every layer k=4 of 4", "llama_4l", {"architecture": "qwen2_moe",
             "experts_per_token": 4}),
        # norm_topk_prob: false (Qwen1.5-MoE's setting): transformers then computes what llama.cpp's qwen2moe does;
        # llama.cpp's qwen3moe always renormalises
        Case("qwen2->qwen2_moe norm_topk_prob false, k=2", "qwen2", {"architecture": "qwen2_moe",
             "norm_topk_prob": False}),
        Case("qwen3->qwen3_moe norm_topk_prob false, k=2", "qwen3", {"architecture": "qwen3_moe",
             "norm_topk_prob": False}, expect="differs",
             why="llama.cpp's qwen3moe always renormalises the top-k weights; norm_topk_prob: false does not"),
    ]
    # Qwen3.5 (Gated DeltaNet + full attention, 4 layers) -> Qwen3.5-MoE (always fused; llama.cpp's qwen35moe)
    out += [
        Case("qwen3_5->qwen3_5_moe k=2", "qwen3_5", {"architecture": "qwen3_5_moe"}),
        Case("qwen3_5->qwen3_5_moe shared split, k=2", "qwen3_5", {"architecture": "qwen3_5_moe",
             "shared_expert_gate": "constant"}, routed_scale=0.5, shared=1),
        Case("qwen3_5 tied->qwen3_5_moe k=4 of 4", "qwen3_5_tied", {"architecture": "qwen3_5_moe",
             "experts_per_token": 4}),
        Case("qwen3_5->qwen3_5_moe bf16 shared split (bf16 gguf)", "qwen3_5", {"architecture": "qwen3_5_moe",
             "shared_expert_gate": "constant", "dtype": "bfloat16"}, routed_scale=0.5, shared=1, outtype="bf16"),
    ]
    # GLM-4-MoE (DeepSeek-V3 router: sigmoid scores, correction bias, routed_scaling_factor; ungated shared MLP)
    glm_vocab = ("convert_hf_to_gguf.py's Glm4MoeModel looks up GLM's special tokens ([gMASK], <|user|>, ...) in "
                 "the tokenizer: a Llama / Qwen one has none (KeyError)")
    split = dict(routed_scale=0.5, shared=1)
    out += [
        Case("llama->glm4_moe shared split (stock converter)", "llama", {"architecture": "glm4_moe"}, **split,
             expect="fails", why=glm_vocab),
        Case("llama->glm4_moe shared split, k=2", "llama", {"architecture": "glm4_moe"}, **split, glm_vocab=True),
        Case("mistral->glm4_moe shared split, k=2", "mistral", {"architecture": "glm4_moe"}, **split, glm_vocab=True),
        Case("qwen2->glm4_moe shared split, k=2", "qwen2", {"architecture": "glm4_moe"}, **split, glm_vocab=True),
        Case("qwen3->glm4_moe shared split, k=2", "qwen3", {"architecture": "glm4_moe"}, **split, glm_vocab=True),
        Case("qwen3->glm4_moe 2 shared, norm_topk_prob false", "qwen3", {"architecture": "glm4_moe",
             "norm_topk_prob": False}, routed_scale=0.5, shared=2, glm_vocab=True),
        Case("llama 4L->glm4_moe first 2 layers dense", "llama_4l", {"architecture": "glm4_moe",
             "moe_layers": {"every": 1, "start": 2}}, **split, glm_vocab=True),
        Case("llama->glm4_moe split 2 + shared", "llama", {"architecture": "glm4_moe",
             "expert_init": {"method": "split", "granularity": 2}}, **split, glm_vocab=True),
        Case("qwen3->glm4_moe bf16 shared split (bf16 gguf)", "qwen3", {"architecture": "glm4_moe",
             "dtype": "bfloat16"}, **split, glm_vocab=True, outtype="bf16"),
        Case("llama->glm4_moe no shared (0-wide shared MLP)", "llama", {"architecture": "glm4_moe"},
             glm_vocab=True, expect="fails", why="n_shared_experts 0: the 0-wide shared-MLP tensors"),
    ]
    # Granite (multipliers, logits_scaling) -> Granite-MoE-Shared (JetMoE's input_linear; llama.cpp's granitemoe)
    out += [
        Case("granite->granitemoeshared k=2", "granite", {"architecture": "granitemoeshared"}),
        Case("granite tied->granitemoeshared k=4 of 4", "granite_tied", {"architecture": "granitemoeshared",
             "experts_per_token": 4}),
        # ERNIE 4.5 -> ERNIE-4.5-MoE (zero e_score_correction_bias; llama.cpp's ernie4_5-moe)
        Case("ernie4_5->ernie4_5_moe k=2", "ernie4_5", {"architecture": "ernie4_5_moe"}),
        Case("ernie4_5 tied->ernie4_5_moe k=2", "ernie4_5_tied", {"architecture": "ernie4_5_moe"}),
    ]
    return out


# Qwen3.5: linear, full, linear, full; 2 linear key heads and 4 value heads (llama.cpp reorders the value heads)
# Qwen3.5's interleaved M-RoPE sections must fill half the rotary dims in llama.cpp (GGML_ASSERT(sect_dims <= ne0)):
# head_dim 64 x partial_rotary_factor 0.25 = 16 rotary dims, sections 3 + 3 + 2 (Qwen3.5-35B-A3B: 256 x 0.25, 11+11+10)
QWEN3_5 = dict(num_hidden_layers=4, head_dim=64, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention"] * 2,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [3, 3, 2], "mrope_interleaved": True})


GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)


def dense_models(folder: Path) -> dict[str, Path]:
    models = {
        "llama": make_dense_model(folder / "llama", family="llama", seed=0),
        "qwen2": make_dense_model(folder / "qwen2", family="qwen2", seed=3, random_norms_and_biases=True),
        "qwen2_tied": make_dense_model(folder / "qwen2_tied", family="qwen2", seed=4, tie_word_embeddings=True,
                                       random_norms_and_biases=True),
        "qwen3": make_dense_model(folder / "qwen3", family="qwen3", seed=5, random_norms_and_biases=True),
        "qwen3_tied_bias": make_dense_model(folder / "qwen3_tied_bias", family="qwen3", seed=6,
                                            tie_word_embeddings=True, attention_bias=True,
                                            random_norms_and_biases=True),
        "mistral": make_dense_model(folder / "mistral", family="mistral", seed=1),
        "qwen3_tied": make_dense_model(folder / "qwen3_tied", family="qwen3", seed=7, tie_word_embeddings=True,
                                       random_norms_and_biases=True),
        "mistral_4096": make_dense_model(folder / "mistral_4096", family="mistral", seed=8, sliding_window=4096),
        "mistral_w8": make_dense_model(folder / "mistral_w8", family="mistral", seed=9, sliding_window=WINDOW),
        "qwen25": make_dense_model(folder / "qwen25", family="qwen2", seed=10, random_norms_and_biases=True,
                                   sliding_window=WINDOW, use_sliding_window=False, max_window_layers=1),
        "qwen2_swa": make_dense_model(folder / "qwen2_swa", family="qwen2", seed=11, random_norms_and_biases=True,
                                      sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
        "llama3": make_dense_model(folder / "llama3", family="llama", seed=12, rope_parameters=LLAMA3_ROPE),
        "llama_linear": make_dense_model(folder / "llama_linear", family="llama", seed=16,
                                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "llama_yarn": make_dense_model(folder / "llama_yarn", family="llama", seed=17, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
        "nemo": make_dense_model(folder / "nemo", family="mistral", seed=13, head_dim=32),
        "qwen3_hd32": make_dense_model(folder / "qwen3_hd32", family="qwen3", seed=14, head_dim=32,
                                       random_norms_and_biases=True),
        "llama_tied": make_dense_model(folder / "llama_tied", family="llama", seed=15, tie_word_embeddings=True),
        "llama_4l": make_dense_model(folder / "llama_4l", family="llama", seed=31, num_hidden_layers=4),
        "qwen3_4l": make_dense_model(folder / "qwen3_4l", family="qwen3", seed=32, num_hidden_layers=4,
                                     random_norms_and_biases=True),
        "qwen3_5": make_dense_model(folder / "qwen3_5", family="qwen3_5_text", seed=33, random_norms_and_biases=True,
                                    **QWEN3_5),
        "qwen3_5_tied": make_dense_model(folder / "qwen3_5_tied", family="qwen3_5_text", seed=34,
                                         tie_word_embeddings=True, random_norms_and_biases=True, **QWEN3_5),
        "granite": make_dense_model(folder / "granite", family="granite", seed=35, random_norms_and_biases=True,
                                    **GRANITE),
        "granite_tied": make_dense_model(folder / "granite_tied", family="granite", seed=36, tie_word_embeddings=True,
                                         random_norms_and_biases=True, **GRANITE),
        "ernie4_5": make_dense_model(folder / "ernie4_5", family="ernie4_5", seed=37, random_norms_and_biases=True),
        "ernie4_5_tied": make_dense_model(folder / "ernie4_5_tied", family="ernie4_5", seed=38,
                                          tie_word_embeddings=True, random_norms_and_biases=True),
    }
    # published (transformers 4.x) spellings of rope scaling, written over the saved config.json
    short = dict(max_position_embeddings=16)
    published = {
        "llama_dynamic": ("llama", 18, short, {"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}}),
        "qwen25_yarn": ("qwen2", 19, short, {"rope_theta": 1e6, "use_sliding_window": False, "rope_scaling": {
            "factor": 4.0, "original_max_position_embeddings": 16, "type": "yarn"}}),
        "llama_yarn_noorig": ("llama", 21, short, {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn",
                                                                                         "factor": 4.0}}),
        "llama_yarn_betas": ("llama", 22, short, {"rope_theta": 10000.0, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
            "beta_slow": 2.0}}),
        "llama_yarn_attn": ("llama", 27, short, {"rope_theta": 10000.0, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 0.8}}),
        "llama_longrope": ("llama", 23, dict(max_position_embeddings=64), {"rope_theta": 10000.0, "rope_scaling": {
            "rope_type": "longrope", "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}}),
        "qwen3_yarn": ("qwen3", 24, short, {"rope_theta": 1e6, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
        "llama_linear_type": ("llama", 25, {}, {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
        "llama_no_theta": ("llama", 26, {}, {}),  # Llama-1 era: no rope_theta (transformers' default 10000)
    }
    for name, (family, seed, dims, fields) in published.items():
        models[name] = make_dense_model(folder / name, family=family, seed=seed, random_norms_and_biases=True, **dims)
        cfg = json.loads((models[name] / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        (models[name] / "config.json").write_text(json.dumps({**cfg, **fields}, indent=2))
    models.update({f"llama_ft{i}": make_finetune(models["llama"], folder / f"llama_ft{i}", seed=20 + i, scale=0.2)
                   for i in range(4)})
    models["llama_deep"] = make_finetune(models["llama"], folder / "llama_deep", seed=30, scale=0.2, layers=4)
    return models


class LlamaCpp:
    """llama.cpp's library through the sdist's own ctypes bindings (imported without the high-level package)."""

    def __init__(self, root: Path):
        sdist = next(root.glob("llama_cpp_python-*"))
        self.src = sdist / "vendor" / "llama.cpp"
        self.pydeps = root / "pydeps"  # sentencepiece, which the converter imports for Llama vocabularies
        os.environ["LLAMA_CPP_LIB_PATH"] = str(root / "build" / "bin")
        pkg = types.ModuleType("llama_cpp")  # skip llama_cpp/__init__ (it needs diskcache, jinja2)
        pkg.__path__ = [str(sdist / "llama_cpp")]
        sys.modules["llama_cpp"] = pkg
        import llama_cpp.llama_cpp as ll

        self.ll = ll
        self.log: list[str] = []

        def on_log(level, text, user_data):
            self.log.append(text.decode(errors="replace"))

        self._log_cb = ll.llama_log_callback(on_log)  # keep a reference: C holds the pointer
        ll.llama_log_set(self._log_cb, ctypes.c_void_p())
        ll.llama_backend_init()

    def convert(self, model: Path, out: Path, outtype: str = "f32", dense_names: bool = False,
                glm_vocab: bool = False) -> None:
        # Qwen3.5's converter counts on multi-token-prediction layers (mtp.*), which no upcycled model has
        flags = ["--no-mtp"] if json.loads((model / "config.json").read_text())["model_type"].startswith("qwen3_5") \
            else []
        extra = (DENSE_NAMES if dense_names else "") + (GLM_VOCAB if glm_vocab else "")
        code = CONVERT.format(src=str(self.src), gguf=str(self.src / "gguf-py"), pydeps=str(self.pydeps),
                              model=str(model), out=str(out), outtype=outtype, flags=flags,
                              script=str(self.src / "convert_hf_to_gguf.py"), extra=extra)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("convert_hf_to_gguf failed: " + proc.stderr.strip().splitlines()[-1])

    def logits(self, gguf: Path, ids: list[int]) -> np.ndarray:
        """(T, V) logits of every position, or RuntimeError with llama.cpp's own message."""
        ll = self.ll
        self.log.clear()
        mparams = ll.llama_model_default_params()
        model = ll.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not model:
            errors = [line.strip() for line in self.log if "error" in line.lower() or "failed" in line.lower()]
            raise RuntimeError("llama.cpp will not load it: " + (" | ".join(errors[:3]) or "no message"))
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
        cparams.n_threads = cparams.n_threads_batch = 2
        cparams.type_k = cparams.type_v = ll.GGML_TYPE_F32  # the default f16 KV cache costs ~1e-3
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED  # CPU flash attention (auto) costs ~1e-3
        ctx = ll.llama_init_from_model(model, cparams)
        batch = ll.llama_batch_init(len(ids), 0, 1)
        try:
            for i, tok in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(ids)
            if ll.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed: " + " | ".join(self.log[-3:]))
            n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
            rows = [np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                    for i in range(len(ids))]
        finally:
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)
            ll.llama_model_free(model)
        return np.stack(rows)


def hf_logits(folder: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].numpy()


def upcycle(case: Case, dense: dict[str, Path], out: Path) -> tuple[str, str]:
    """Build the case's MoE into `out`; return the plan's llama.cpp verdict (status, why)."""
    base = dense[case.base]
    sources = case.experts_from or [(case.base, {})] * case.experts
    experts = []
    for name, extra in sources:
        expert = {"source_model": str(dense[name]), **extra}
        if case.routed_scale is not None:
            expert["residual_scale"] = case.routed_scale
        experts.append(expert)
    recipe = {"base_model": str(base), "gate_mode": "random", "experts_per_token": 2, "dtype": "float32",
              **case.recipe, "experts": experts}
    if case.shared:
        scale = 1.0 / case.shared
        recipe["shared_experts"] = [{"source_model": str(base), "residual_scale": scale} for _ in range(case.shared)]
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(recipe, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "moe_upcycle", "build", str(config), str(out), "--no-lint"],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError("moe_upcycle build failed: " + (proc.stderr or proc.stdout).strip()[-400:])
    from moe_upcycle import upcycle as plan_only
    from moe_upcycle.planning.runtimes import compatibility

    plan = plan_only(str(config), dry_run=True).plan
    found = next(v for v in compatibility(plan) if v.runtime == "llama.cpp")
    if case.glm_vocab and "[gMASK]" in found.why:  # the vocabulary step patched: the weights' own verdict
        from moe_upcycle.planning.llamacpp import verdict

        return verdict(plan, vocab=False)
    return found.status, found.why


def smallest_window(folder: Path) -> int:
    """The smallest attention window the dense model at `folder` applies in transformers (0: none)."""
    from moe_upcycle.planning.windows import dense_windows

    return min((w for w in dense_windows(json.loads((folder / "config.json").read_text())) if w), default=0)


# dense models whose rope llama.cpp's llama computes differently (`planning.rope.problem`)
ROPE_DIFFERS = {"llama_dynamic", "llama_yarn_attn", "llama_longrope"}
# the plan's llama.cpp verdict -> what the measurement must show
MEASURED_AS = {"exact": "equal", "runs, not exact": "differs", "will not load": "fails"}


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    if not np.isfinite(b).all():
        return float("nan")
    return float(np.abs(a - b).max() / np.abs(a).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamacpp", type=Path, default=Path(os.environ.get(
        "LLAMACPP_DIR", Path.home() / ".cache/moe-upcycle/llamacpp")), help="DEST of scripts/build_llamacpp.sh")
    parser.add_argument("--only", default="", help="run the cases whose name contains this (a|b: either)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    start = time.perf_counter()
    lcpp = LlamaCpp(args.llamacpp)
    work = args.work or Path(tempfile.mkdtemp(prefix="check_llamacpp_"))
    work.mkdir(parents=True, exist_ok=True)
    dense = dense_models(work / "dense")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(dense["llama"]))(TEXT)["input_ids"]  # all tiny models share it
    selected = [c for c in cases() if any(part in c.name for part in args.only.split("|"))]
    rows = []
    for fam in sorted({c.base for c in selected}):
        # llama.cpp's qwen3 has no o_proj bias either; transformers 5 loads our tiny Qwen2 tokenizer as a
        # Qwen2Tokenizer that adds <|endoftext|> as id 300 = vocab_size, which the converter asserts against
        # (a tiny-fixture artifact: real Qwen2 vocabularies have room; the MoE outputs' tokenizers load as given)
        fails = fam == "qwen3_tied_bias" or fam.startswith("qwen2")
        slides = len(ids) > smallest_window(dense[fam]) > 0  # llama.cpp's dense llama has no window either
        slides = slides or fam in ROPE_DIFFERS  # nor dynamic NTK, longrope factors, yarn's attention_factor
        rows.append(Case(f"{fam} (dense)", fam, {}, expect="fails" if fails else "differs" if slides else "equal"))
    rows += selected
    failed = 0
    print(f"{'case':48} {'max rel diff':>13}  verdict")
    for case in rows:
        t0 = time.perf_counter()
        slug = "".join(ch if ch.isalnum() else "_" for ch in case.name)
        out = work / slug
        try:
            if case.name.endswith("(dense)"):
                out = dense[case.base]
            else:
                planned = upcycle(case, dense, out)
                case.result["plan"], case.result["plan_why"] = planned
            gguf = work / f"{slug}.gguf"
            lcpp.convert(out, gguf, case.outtype, case.dense_names, case.glm_vocab)
            diff = rel_diff(hf_logits(out, ids), lcpp.logits(gguf, ids))
            tol = TOLERANCE_16.get(case.outtype, TOLERANCE)
            verdict = ("equal" if diff <= tol else "NaN" if np.isnan(diff) else "differs")
            case.result.update(max_rel_diff=diff, verdict=verdict)
        except RuntimeError as err:
            case.result.update(max_rel_diff=None, verdict="fails", error=str(err))
        case.result["seconds"] = round(time.perf_counter() - t0, 1)
        # the plan must predict what happens (a window the sequence does not cross changes nothing)
        predicted = MEASURED_AS.get(case.result.get("plan", ""), case.expect)
        if predicted == "differs" and "window" in case.result.get("plan_why", "") and len(ids) <= smallest_window(
                dense[case.base]):
            predicted = "equal"
        ok = case.result["verdict"] == case.expect == predicted
        failed += not ok
        diff = case.result["max_rel_diff"]
        shown = f"{diff:13.2e}" if diff is not None else f"{'-':>13}"
        note = case.result.get("error") or (case.why if case.result["verdict"] == "differs" else "")
        if predicted != case.result["verdict"]:
            note = f"PLAN SAYS {case.result.get('plan')}: {case.result.get('plan_why', '')[:200]} | " + note
        print(f"{case.name:48} {shown}  {case.result['verdict']}{'' if ok else ' (UNEXPECTED)'}"
              f"{'  - ' + note if note else ''}", flush=True)
    total = time.perf_counter() - start
    print(f"{len(rows)} cases in {total:.0f} s; {failed} unexpected")
    if args.json:
        args.json.write_text(json.dumps([{"case": c.name, "expect": c.expect, **c.result} for c in rows], indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
