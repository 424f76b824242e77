"""Is a checkpoint quantized, or not a Hugging Face model folder at all? Said by name, before any plan.

Quantized weights are recognised by the tensors their formats add beside (or instead of) a
``weight``, whether or not config.json keeps its ``quantization_config`` (a re-saved or hand-copied
folder often loses it, and the plan would then blame "biases" or missing projections):

- GPTQ / AWQ / Marlin: ``qweight``, ``qzeros``, ``scales``, ``g_idx``;
- bitsandbytes: ``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.*`` (4-bit), ``SCB`` (8-bit);
- fp8 and compressed-tensors: ``weight_scale``, ``weight_scale_inv``, ``input_scale``,
  ``weight_packed``, ``weight_zero_point``, ``weight_global_scale``.

`foreign_folder_hint` names what a folder without config.json or without transformers' weight files
holds instead (Meta/Mistral native weights, GGUF, a LoRA adapter, a ``model.fp16.safetensors``
variant, TensorFlow/Flax weights), so the message says what to give.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional

# tensor-name endings -> the format that writes them
QUANTIZED_ENDINGS = {
    ".qweight": "GPTQ/AWQ", ".qzeros": "GPTQ/AWQ", ".scales": "GPTQ/AWQ", ".g_idx": "GPTQ",
    ".weight.absmax": "bitsandbytes 4-bit", ".weight.quant_map": "bitsandbytes 4-bit",
    ".SCB": "bitsandbytes 8-bit", ".weight_format": "bitsandbytes 8-bit",
    ".weight_scale": "fp8 / compressed-tensors", ".weight_scale_inv": "fp8", ".input_scale": "fp8",
    ".weight_packed": "compressed-tensors", ".weight_zero_point": "compressed-tensors",
    ".weight_global_scale": "compressed-tensors (nvfp4)",
}
_BNB_STATE = re.compile(r"\.weight\.quant_state\.")


def quantized_problem(keys: Iterable[str], where: str) -> Optional[str]:
    """The refusal for a checkpoint whose tensor names show quantized weights, or None."""
    for key in keys:
        kind = next((k for end, k in QUANTIZED_ENDINGS.items() if key.endswith(end)), None)
        if kind is None and _BNB_STATE.search(key):
            kind = "bitsandbytes 4-bit"
        if kind is not None:
            return (f"{where}: tensor {key!r} belongs to quantized weights ({kind}; config.json has no "
                    f"quantization_config, but the tensors are packed integers or scaled fp8, not a dense model's "
                    f"weights); moe-upcycle reads unquantized weights: upcycle the model's unquantized (bf16, fp16 "
                    f"or fp32) release")
    return None


def foreign_folder_hint(path: Path) -> str:
    """What a folder without config.json (or weights) holds instead, and what to give; "" when nothing is recognised."""
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return ""
    if "adapter_config.json" in names:
        return " — it holds a PEFT adapter (adapter_config.json), not a model: " + _adapter_advice(path)
    native = [n for n in names if n == "params.json" or n.startswith("consolidated")]
    if native:
        return (f" — it holds Meta/Mistral's native format ({', '.join(native[:2])}), which transformers does not "
                f"load: give the model's Hugging Face release (config.json + model*.safetensors), or convert it "
                f"with transformers' convert_llama_weights_to_hf.py / convert_mistral_weights_to_hf.py")
    gguf = [n for n in names if n.lower().endswith(".gguf")]
    if gguf:
        return (f" — it holds GGUF file(s) ({gguf[0]}), llama.cpp's format: give the Hugging Face release the GGUF "
                f"was converted from (config.json + model*.safetensors)")
    variants = [n for n in names if re.fullmatch(r"(model|pytorch_model)\.[\w-]+\.(safetensors|bin)(\.index\.json)?", n)]
    if variants:  # from_pretrained(..., variant="fp16") reads them; a plain load (and this tool) does not
        plain = re.sub(r"^(model|pytorch_model)[.][^.]+[.]", r"\1.", variants[0])
        example = "" if "-of-" in variants[0] else f", e.g. {plain}"
        return (f" — it holds {variants[0]}, a variant that transformers loads only when asked "
                f"(variant=...): rename the files without the variant{example}")
    other = [n for n in names if n in ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index")]
    if other:
        return (f" — it holds {other[0]} (TensorFlow/Flax weights): load it with transformers "
                f"(from_tf=True / from_flax=True) and save_pretrained the model to get model.safetensors")
    if (path / "original").is_dir() or any(n.endswith((".pth", ".pt")) for n in names):
        return " — it holds PyTorch .pth files, which transformers does not load as a model: give the model's " \
               "Hugging Face release"
    return ""


def file_given_hint(path: Path) -> Optional[str]:
    """The message for a model reference that names a GGUF or adapter file; None for other files."""
    name = path.name.lower()
    if name.endswith(".gguf"):
        return ("is a GGUF file (llama.cpp's format), which moe-upcycle does not read; give the Hugging Face "
                "release it was converted from (a folder with config.json and model*.safetensors)")
    if name.startswith("adapter_model.") or name == "adapter_config.json":
        return "is a PEFT adapter's file, not a model; " + _adapter_advice(path.parent)
    return None


def _adapter_advice(folder: Path) -> str:
    """Write MODEL+ADAPTER, naming the model when adapter_config.json says which it was trained on."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError, RecursionError):
        base = None
    if isinstance(base, str) and base.strip():
        return f"write MODEL+ADAPTER, e.g. {base.strip()}+{folder} (the model adapter_config.json names)"
    return f"write MODEL+ADAPTER: the model the adapter was trained on, a plus sign, and {folder}"
