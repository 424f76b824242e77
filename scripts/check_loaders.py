#!/usr/bin/env python
"""Check that a built MoE loads in the *active* transformers and reproduces the dense logits.

Run it with each interpreter whose transformers you want to check, e.g. the project's (5.x) and a
venv with transformers 4.57::

    python scripts/check_loaders.py DENSE MOE            # MOE already built
    python scripts/check_loaders.py DENSE MOE --build    # build MOE first: 4 copies, random gates, top-2

It loads MOE with ``AutoModelForCausalLM.from_pretrained(..., output_loading_info=True)`` in fp32,
fails on any missing, unexpected or mismatched key (or load error), checks the class is the one
config.json names, and compares logits on seeded random token ids with the dense model's
(``torch.testing.assert_close`` within 1e-5 of the largest logit: copies of one FFN are function-preserving). It prints
one JSON line and exits 0 when everything holds, 1 otherwise.

``--dtype float64`` (transformers 4.x only: 5.x's grouped expert matmul has no float64 kernel on CPU)
separates rounding from layout bugs. Note that Mixtral computes routing weights in fp32 whatever the
model dtype, so with random gates top-2 weights sum to 1 only within ~1e-7; ``--gate-mode uniform``
makes them exactly 1/2 each.

It does not test other loaders (vLLM, llama.cpp): see scripts/BENCHMARKS.md for what was tried.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def build(dense: Path, moe: Path, num_experts: int, gate_mode: str = "random") -> None:
    """Upcycle `dense` into `moe` with moe-upcycle (N copies, top-2)."""
    sys.path.insert(0, str(REPO))
    from moe_upcycle import upcycle

    upcycle({"base_model": str(dense), "num_experts": num_experts, "experts_per_token": 2,
             "gate_mode": gate_mode, "dtype": "float32"}, moe, force=True)


def loading_problems(info: dict) -> dict:
    """Every non-empty list in transformers' loading info (keys differ a little between 4.x and 5.x)."""
    return {k: sorted(map(str, v)) for k, v in info.items() if isinstance(v, (list, set, tuple)) and len(v)}


def load(folder: Path, dtype, **kwargs):
    """AutoModelForCausalLM in `dtype`, whichever keyword this transformers spells it with."""
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"  # 4.56 renamed torch_dtype
    return AutoModelForCausalLM.from_pretrained(str(folder), **{key: dtype}, **kwargs)


def check(dense: Path, moe: Path, rel: float, dtype: str = "float32", seq_len: int = 16, batch: int = 2) -> dict:
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype)
    result: dict = {"transformers": transformers.__version__, "torch": torch.__version__, "moe": str(moe),
                    "dtype": dtype}
    model, info = load(moe, torch_dtype, output_loading_info=True)
    expected_class = json.loads((moe / "config.json").read_text())["architectures"][0]
    result["class"] = type(model).__name__
    result["loading_problems"] = loading_problems(info)
    result["experts"] = getattr(model.config, "num_local_experts", None)
    dense_model = load(dense, torch_dtype)
    vocab = dense_model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = model.eval()(ids).logits
        want = dense_model.eval()(ids).logits
    result["max_abs_diff"] = float((got - want).abs().max())
    result["max_abs_logit"] = float(want.abs().max())
    try:
        # fp32 rounding scales with the largest logit, not with each element (summation order differs per CPU)
        torch.testing.assert_close(got, want, atol=rel * result["max_abs_logit"], rtol=0)
        close = True
    except AssertionError:
        close = False
    result["ok"] = close and not result["loading_problems"] and result["class"] == expected_class
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dense", type=Path, help="the dense model folder the MoE was built from")
    parser.add_argument("moe", type=Path, help="the MoE output folder")
    parser.add_argument("--build", action="store_true", help="build MOE from DENSE first (with --force)")
    parser.add_argument("--experts", type=int, default=4, help="experts for --build")
    parser.add_argument("--gate-mode", default="random", help="gate mode for --build (uniform: routing weights exactly 1/2)")
    parser.add_argument("--rel", type=float, default=1e-5, help="allowed |difference| as a fraction of max |logit|")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="compute dtype for both models (float64 separates layout bugs from rounding)")
    args = parser.parse_args()
    if args.build:
        build(args.dense, args.moe, args.experts, args.gate_mode)
    result = check(args.dense, args.moe, args.rel, args.dtype)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
