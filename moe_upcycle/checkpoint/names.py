"""The one table of tensor names: dense input families and MoE output layouts.

Inputs are the gate/up/down SwiGLU families with Llama's layer names (Llama, Mistral, Qwen2 with
q/k/v biases, Qwen3 with q/k norms, Qwen3.5 with Gated DeltaNet layers, Granite with its multipliers,
ERNIE 4.5). Outputs are Mixtral, Qwen2-MoE (attention biases, one shared expert with a sigmoid gate),
Qwen3-MoE (q/k norms), Qwen3.5-MoE (hybrid layers by ``layer_types``), Granite-MoE-Shared and
ERNIE-4.5-MoE; each says which dense tensors it can hold (per layer kind for hybrid models), its
per-expert and fused names, the names of a layer left dense (``moe_layers:``; Qwen MoE only), its
config.json keys and which bases it takes, so `arch`, `plan`, `fused` and `model_files` need no
per-architecture code paths.

Names are templates with ``{layer}`` and ``{expert}`` holes, filled by `fill`. `split_layer`
turns a concrete key such as ``model.layers.3.self_attn.q_proj.weight`` back into
``("model.layers.{layer}.self_attn.q_proj.weight", 3)``. Nothing here reads tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from moe_upcycle.errors import PlanError

DENSE_MLP = "model.layers.{layer}.mlp.{proj}.weight"
PROJS = ("gate_proj", "up_proj", "down_proj")  # SwiGLU: down(act(gate(x)) * up(x))
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"

# the tokenizer (and generation) files of a model folder, copied byte for byte into the output
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
# named chat templates beside the default one (tool_use, rag...), one ``NAME.jinja`` each: transformers ≥ 4.54
# saves a tokenizer's dict of templates there and loads every file of it
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_TEMPLATE_FILE = re.compile(rf"^{CHAT_TEMPLATE_DIR}/[^/\\]+\.jinja$")


def tokenizer_files(folder: Path) -> list[str]:
    """The tokenizer files of model `folder` that are there, as paths relative to it (TOKENIZER_FILES, then the
    named chat templates ``additional_chat_templates/NAME.jinja``); links included, so callers can name broken ones."""
    found = [name for name in TOKENIZER_FILES if (folder / name).is_file() or (folder / name).is_symlink()]
    templates = folder / CHAT_TEMPLATE_DIR
    if templates.is_dir():
        found += sorted(f"{CHAT_TEMPLATE_DIR}/{p.name}" for p in templates.iterdir()
                        if is_tokenizer_file(f"{CHAT_TEMPLATE_DIR}/{p.name}") and (p.is_file() or p.is_symlink()))
    return found


def is_tokenizer_file(name: str) -> bool:
    """Whether `name` (relative to a model folder) is one of the tokenizer files a build copies.

    Example:
        >>> is_tokenizer_file("additional_chat_templates/tool_use.jinja"), is_tokenizer_file("x/../../etc.jinja")
        (True, False)
    """
    return name in TOKENIZER_FILES or bool(_TEMPLATE_FILE.match(name)) and ".." not in name.split("/")


@dataclass(frozen=True)
class InputFamily:
    """A dense architecture whose MLP is a gate/up/down SwiGLU and whose layers use Llama's names."""

    model_type: str
    class_name: str
    default_output: str  # the output tried first when `architecture:` is not given
    # which layers its attention window applies to, as transformers runs it (`planning.windows`):
    # "none" (Llama ignores sliding_window), "all" (Mistral), "qwen" (use_sliding_window, layer_types)
    window_rule: str = "none"
    # the outputs that compute what it computes (empty: any whose tensors fit); Granite's multipliers live only
    # in Granite-MoE, so a Llama-named Granite written as Mixtral would silently lose them
    only_outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class OutputLayout:
    """How one MoE architecture names its tensors, and which dense tensors it can hold.

    Per-layer tensors are suffixes after ``model.layers.{layer}.``. The fused names are the
    transformers-5 in-memory layout: each maps to the dense projections stacked per expert, so
    ``gate_up_proj`` is (E, 2I, H) = for every expert e, gate_proj_e (I, H) then up_proj_e (I, H).
    """

    model_type: str
    class_name: str
    label: str  # for messages: "Mixtral"
    router: str
    expert: dict[str, str]  # dense proj name -> expert template
    layer_tensors: tuple[str, ...]  # required in the base
    bias_tensors: tuple[str, ...] = ()  # attention biases it can hold
    biases_always: bool = False  # written as zeros when the base has none (loaders expect them)
    bias_config_key: Optional[str] = None  # config.json switch for the biases
    shared_expert: dict[str, str] = field(default_factory=dict)  # proj -> template (one shared expert)
    shared_expert_gate: Optional[str] = None  # (1, H) sigmoid gate of the shared expert
    fused_router: str = "model.layers.{layer}.mlp.gate.weight"
    fused_expert: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(FUSED_EXPERT))
    experts_key: str = "num_experts"  # config.json field for the number of routed experts
    expert_size_key: str = "moe_intermediate_size"  # config.json field for one expert's intermediate size
    inherit: tuple[str, ...] = ()  # base config.json fields copied beyond model_files.INHERITED
    per_layer_windows: bool = False  # layer_types says which layers slide (else one window for every layer)
    config: dict = field(default_factory=dict)  # fixed config.json fields
    # proj -> name of a dense layer's MLP (``moe_layers:``; the class transformers builds for a layer in
    # ``mlp_only_layers``); empty: every layer is an MoE layer (Mixtral)
    dense_mlp: dict[str, str] = field(default_factory=dict)
    # hybrid models (`planning.hybrid`): layer_types value -> the tensors such a layer needs besides layer_tensors
    layer_kinds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    input_families: tuple[str, ...] = ()  # the dense model_types whose layers it can hold (empty: any it holds)
    fused_only: bool = False  # transformers reads only the fused expert tensors (no per-expert conversion)
    # its fused names are its own checkpoint format, which every loader of it reads (Granite-MoE's input_linear):
    # written with the ordinary safetensors "pt" format, not the transformers-5-only fused layout's
    native_fused: bool = False

    # GLM-4-MoE (`planning.glm4`): tensors held when the base has them (q/k norms, its config switch use_qk_norm),
    # the router's (E,) score-correction bias (zeros), dense layers only as a prefix (first_k_dense_replace),
    # and the config.json field for the shared expert's size (None: n_shared_experts x moe_intermediate_size)
    optional_tensors: tuple[str, ...] = ()
    router_bias: Optional[str] = None
    router_bias_shape: str = "(E,)"  # ERNIE-4.5-MoE's moe_statics bias is (1, E)
    leading_dense_only: bool = False
    shared_size_key: Optional[str] = "shared_expert_intermediate_size"
    # tried without `architecture:` and suggested in errors; False: only when named (or when nothing else fits)
    automatic: bool = True
    router_scoring: str = "softmax"  # "sigmoid": each expert's score on its own (GLM-4-MoE, `planning.glm4`)


    def holds(self, suffix: str) -> bool:
        """Whether a dense per-layer non-MLP tensor (suffix) has a place in this layout."""
        return (suffix in self.layer_tensors or suffix in self.bias_tensors or suffix in self.optional_tensors
                or any(suffix in kind for kind in self.layer_kinds.values()))


LLAMA_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
)
QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
O_BIAS = ("self_attn.o_proj.bias",)
QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# transformers-5 fused expert tensors: name -> dense projections stacked for each expert, in order
FUSED_EXPERT = {
    "model.layers.{layer}.mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),  # (E, 2I, H)
    "model.layers.{layer}.mlp.experts.down_proj": ("down_proj",),  # (E, H, I)
}
# what a per-layer tensor is, for messages ("the base has attention biases (self_attn.q_proj.bias)")
TENSOR_GROUPS = {
    **{s: "attention biases" for s in QKV_BIAS}, "self_attn.o_proj.bias": "an attention output bias",
    **{s: "q/k norms" for s in QK_NORM},
}
WINDOW_FIELDS = ("use_sliding_window", "max_window_layers", "layer_types")
# Qwen3.5: Gated DeltaNet (linear attention) layers and gated full-attention layers (q_proj holds the output
# gate too, so it is 2x wider than a Qwen3's), each copied as it is; layer_types says which layer is which
LINEAR_ATTN = tuple(f"linear_attn.{t}" for t in (
    "A_log", "conv1d.weight", "dt_bias", "in_proj_a.weight", "in_proj_b.weight", "in_proj_qkv.weight",
    "in_proj_z.weight", "norm.weight", "out_proj.weight"))
QWEN3_5_KINDS = {"linear_attention": LINEAR_ATTN, "full_attention": LLAMA_LAYER[2:] + QK_NORM}
QWEN3_5_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                  "linear_num_value_heads")

INPUT_FAMILIES: dict[str, InputFamily] = {
    "llama": InputFamily("llama", "LlamaForCausalLM", "mixtral", window_rule="none"),
    "mistral": InputFamily("mistral", "MistralForCausalLM", "mixtral", window_rule="all"),
    "qwen2": InputFamily("qwen2", "Qwen2ForCausalLM", "qwen2_moe", window_rule="qwen"),
    "qwen3": InputFamily("qwen3", "Qwen3ForCausalLM", "qwen3_moe", window_rule="qwen"),
    # Qwen3.5's language model as Qwen3_5ForCausalLM saves it (model.layers.N.*; no sliding window)
    "qwen3_5_text": InputFamily("qwen3_5_text", "Qwen3_5ForCausalLM", "qwen3_5_moe_text"),
    # Granite: Llama's layers with embedding / residual / attention multipliers and logits_scaling
    "granite": InputFamily("granite", "GraniteForCausalLM", "granitemoeshared", only_outputs=("granitemoeshared",)),
    # ERNIE 4.5: Llama's names, GLM-style interleaved rope (only ERNIE-4.5-MoE rotates the same way)
    "ernie4_5": InputFamily("ernie4_5", "Ernie4_5ForCausalLM", "ernie4_5_moe", only_outputs=("ernie4_5_moe",)),
}

OUTPUT_LAYOUTS: dict[str, OutputLayout] = {
    "mixtral": OutputLayout(
        model_type="mixtral",
        class_name="MixtralForCausalLM",
        label="Mixtral",
        router="model.layers.{layer}.block_sparse_moe.gate.weight",
        expert={
            "gate_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
            "down_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
            "up_proj": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        },
        layer_tensors=LLAMA_LAYER,
        experts_key="num_local_experts",
        expert_size_key="intermediate_size",
        config={"router_jitter_noise": 0.0},
    ),
    "qwen2_moe": OutputLayout(
        model_type="qwen2_moe",
        class_name="Qwen2MoeForCausalLM",
        label="Qwen2-MoE",
        router="model.layers.{layer}.mlp.gate.weight",
        expert={p: "model.layers.{layer}.mlp.experts.{expert}." + p + ".weight" for p in PROJS},
        layer_tensors=LLAMA_LAYER,
        bias_tensors=QKV_BIAS,
        biases_always=True,  # Qwen2-MoE loaders (llama.cpp, vLLM) always expect q/k/v biases
        bias_config_key="qkv_bias",
        shared_expert={p: "model.layers.{layer}.mlp.shared_expert." + p + ".weight" for p in PROJS},
        shared_expert_gate="model.layers.{layer}.mlp.shared_expert_gate.weight",
        inherit=WINDOW_FIELDS,
        per_layer_windows=True,  # transformers 5's Qwen2-MoE reads layer_types (Qwen3-MoE does not)
        # norm_topk_prob: top-k weights sum to 1, so identical experts reproduce the dense FFN;
        # decoder_sparse_step and mlp_only_layers: `arch.config_fields` (which layers are MoE layers)
        config={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
        dense_mlp={p: DENSE_MLP.replace("{proj}", p) for p in PROJS},  # Qwen2MoeMLP in mlp_only_layers
    ),
    "qwen3_moe": OutputLayout(
        model_type="qwen3_moe",
        class_name="Qwen3MoeForCausalLM",
        label="Qwen3-MoE",
        router="model.layers.{layer}.mlp.gate.weight",
        expert={p: "model.layers.{layer}.mlp.experts.{expert}." + p + ".weight" for p in PROJS},
        layer_tensors=LLAMA_LAYER + QK_NORM,
        bias_tensors=QKV_BIAS + O_BIAS,
        bias_config_key="attention_bias",
        inherit=WINDOW_FIELDS,
        config={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
        dense_mlp={p: DENSE_MLP.replace("{proj}", p) for p in PROJS},  # Qwen3MoeMLP in mlp_only_layers
    ),
    # ``architecture: qwen3_5_moe``: Qwen3_5MoeForCausalLM's text config (model_type qwen3_5_moe_text). Every
    # layer an MoE block: softmax top-k, always renormalised (no norm_topk_prob), plus a shared expert behind a
    # sigmoid gate. transformers converts no per-expert names for it, so the experts are always fused.
    "qwen3_5_moe_text": OutputLayout(
        model_type="qwen3_5_moe_text",
        class_name="Qwen3_5MoeForCausalLM",
        label="Qwen3.5-MoE",
        router="model.layers.{layer}.mlp.gate.weight",
        expert={p: "model.layers.{layer}.mlp.experts.{expert}." + p + ".weight" for p in PROJS},
        layer_tensors=LLAMA_LAYER[:2],
        bias_tensors=QKV_BIAS + O_BIAS,
        bias_config_key="attention_bias",
        shared_expert={p: "model.layers.{layer}.mlp.shared_expert." + p + ".weight" for p in PROJS},
        shared_expert_gate="model.layers.{layer}.mlp.shared_expert_gate.weight",
        inherit=QWEN3_5_FIELDS,
        layer_kinds=QWEN3_5_KINDS,
        input_families=("qwen3_5_text",),
        fused_only=True,
    ),
    # GraniteMoeSharedForCausalLM (the Granite 3 MoE checkpoint format): the router's top-k logits are softmaxed
    # (weights sum to 1); experts stored fused as JetMoE's input_linear (E, 2I, H: gate rows, then up rows) and
    # output_linear (E, H, I), which transformers 4.57 reads as they are and 5 renames; the shared MLP is ungated,
    # so it is left out (shared_intermediate_size 0) and shared_experts are refused
    "granitemoeshared": OutputLayout(
        model_type="granitemoeshared",
        class_name="GraniteMoeSharedForCausalLM",
        label="Granite-MoE-Shared",
        router="model.layers.{layer}.block_sparse_moe.router.layer.weight",
        expert={p: "model.layers.{layer}.block_sparse_moe.experts.{expert}." + p + ".weight" for p in PROJS},
        layer_tensors=LLAMA_LAYER,
        bias_tensors=QKV_BIAS + O_BIAS,
        bias_config_key="attention_bias",
        fused_router="model.layers.{layer}.block_sparse_moe.router.layer.weight",
        fused_expert={"model.layers.{layer}.block_sparse_moe.input_linear.weight": ("gate_proj", "up_proj"),
                      "model.layers.{layer}.block_sparse_moe.output_linear.weight": ("down_proj",)},
        experts_key="num_local_experts",
        expert_size_key="intermediate_size",
        inherit=("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"),
        config={"shared_intermediate_size": 0},
        input_families=("granite",),
        fused_only=True,
        native_fused=True,
    ),
    # DeepSeek-V3's router (sigmoid scores, e_score_correction_bias, group-limited top-k, routed_scaling_factor) and
    # one ungated shared-experts MLP; attention as the base's with partial_rotary_factor 1 (`planning.glm4`)
    "glm4_moe": OutputLayout(
        model_type="glm4_moe",
        class_name="Glm4MoeForCausalLM",
        label="GLM-4-MoE",
        router="model.layers.{layer}.mlp.gate.weight",
        expert={p: "model.layers.{layer}.mlp.experts.{expert}." + p + ".weight" for p in PROJS},
        layer_tensors=LLAMA_LAYER,
        bias_tensors=QKV_BIAS,  # no o_proj bias in Glm4MoeAttention
        bias_config_key="attention_bias",
        optional_tensors=QK_NORM,
        shared_expert={p: "model.layers.{layer}.mlp.shared_experts." + p + ".weight" for p in PROJS},
        experts_key="n_routed_experts",
        router_bias="model.layers.{layer}.mlp.gate.e_score_correction_bias",
        leading_dense_only=True,
        shared_size_key=None,
        automatic=False,
        router_scoring="sigmoid",
        config={"norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                "partial_rotary_factor": 1.0, "num_nextn_predict_layers": 0},
        dense_mlp={p: DENSE_MLP.replace("{proj}", p) for p in PROJS},  # Glm4MoeMLP below first_k_dense_replace
    ),
    # Ernie4_5_MoeForCausalLM: softmax, top-k of (probabilities + a zero correction bias), divided by their sum
    # (`planning.router_statics`); per-expert names (transformers 5 converts them like Qwen2-MoE's); no shared experts
    "ernie4_5_moe": OutputLayout(
        model_type="ernie4_5_moe",
        class_name="Ernie4_5_MoeForCausalLM",
        label="ERNIE-4.5-MoE",
        router="model.layers.{layer}.mlp.gate.weight",
        expert={p: "model.layers.{layer}.mlp.experts.{expert}." + p + ".weight" for p in PROJS},
        layer_tensors=LLAMA_LAYER,
        experts_key="moe_num_experts",
        router_bias="model.layers.{layer}.mlp.moe_statics.e_score_correction_bias",
        router_bias_shape="(1, E)",
        config={"use_bias": False},
        input_families=("ernie4_5",),
    ),
}


def fill(template: str, layer: Optional[int] = None, expert: Optional[int] = None, **extra: str) -> str:
    """Fill a name template.

    Example:
        >>> fill(OUTPUT_LAYOUTS["mixtral"].expert["gate_proj"], layer=3, expert=1)
        'model.layers.3.block_sparse_moe.experts.1.w1.weight'
    """
    return template.format(layer=layer, expert=expert, **extra)


_LAYER_RE = re.compile(r"^(model\.layers\.)(\d+)(\..+)$")


def shown(key: str) -> str:
    r"""A tensor name as a message prints it: as it is, or as Python writes it when it holds characters that do
    not print (a name from a file must not start a new line of the message, or move the cursor).

    Example:
        >>> shown("mlp.up_proj.weight"), shown("x\n.weight")
        ('mlp.up_proj.weight', "'x\\n.weight'")
    """
    return key if key.isprintable() else repr(key)


def split_layer(key: str) -> tuple[str, Optional[int]]:
    """Pull the layer index out of a key.

    Example:
        >>> split_layer("model.layers.12.mlp.up_proj.weight")
        ('model.layers.{layer}.mlp.up_proj.weight', 12)
        >>> split_layer("model.norm.weight")
        ('model.norm.weight', None)
    """
    m = _LAYER_RE.match(key)
    if not m:
        return key, None
    return m.group(1) + "{layer}" + m.group(3), int(m.group(2))


def input_family(model_type: str, where: str) -> InputFamily:
    """Look up a dense family by `model_type`, or fail listing what is supported."""
    try:
        return INPUT_FAMILIES[model_type]
    except KeyError:
        raise PlanError(f"{where}: {unsupported_input(model_type)}") from None


# MoE model types besides our outputs: a model of one of them is never a dense input
_OTHER_MOE_TYPES = ("mixtral", "dbrx", "jamba", "deepseek", "deepseek_v2", "deepseek_v3", "phimoe", "granitemoe")


def unsupported_input(model_type: object) -> str:
    """Why a model of `model_type` cannot be an input, and what is supported (an MoE is told to give its dense model)."""
    supported = ", ".join(f"{f.class_name} ({k})" for k, f in INPUT_FAMILIES.items())
    already = (isinstance(model_type, str) and (model_type in OUTPUT_LAYOUTS or model_type in _OTHER_MOE_TYPES
                                                 or "moe" in model_type.lower()))
    return (f"model_type {model_type!r} is not supported as input"
            + (" — it is already a Mixture-of-Experts: give the dense model it was made from" if already else "")
            + f"; supported: {supported}")


def layout_of_config(config: dict) -> Optional[OutputLayout]:
    """The output layout a config.json describes (its ``model_type``), or None for any other model.

    Example:
        >>> layout_of_config({"model_type": "qwen3_moe"}).experts_key
        'num_experts'
    """
    return next((lay for lay in OUTPUT_LAYOUTS.values() if lay.model_type == config.get("model_type")), None)


def output_layout(name: str, where: str = "architecture") -> OutputLayout:
    """Look up an MoE output layout by name, or fail listing what is supported."""
    try:
        return OUTPUT_LAYOUTS[name]
    except KeyError:
        raise PlanError(f"{where}: {name!r} is not a supported output architecture; "
                        f"supported: {', '.join(OUTPUT_LAYOUTS)}") from None
