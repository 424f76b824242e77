"""Which runtimes run an interleaved (``moe_layers:``) MoE, and how exactly: the table in docs/expert_init.md.

For every input family and the Qwen-MoE output that holds it, a 4-layer tiny model (seeded) is
copy-upcycled with MoE in layers 1 and 3 (``moe_layers: {every: 2}``) and with MoE in layers 0 and 3
(``[0, 3]``, not a ``decoder_sparse_step`` pattern). Each output is loaded in transformers 5 (this process)
and 4.57 (``.venv-tf4``), in fp32; printed per case: the class of every layer's MLP and max |Δlogit| /
max |logit| against the dense model in the same version. llama.cpp is measured by
``scripts/check_llamacpp.py --only 4L`` (it needs its own build); vLLM and ExLlamaV2 are not installed here.

    python scripts/interleave_runtimes.py [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from moe_upcycle import upcycle  # noqa: E402 (after sys.path)
from moe_upcycle.checkpoint.tiny import make_dense_model  # noqa: E402

IDS = [1, 17, 42, 99, 5, 230, 7, 64, 128, 3, 250, 11]
CASES = [(family, arch) for family, arch in (("llama", "qwen2_moe"), ("mistral", "qwen2_moe"), ("qwen2", "qwen2_moe"),
                                             ("qwen3", "qwen3_moe"))]
LAYERS = ({"every": 2}, [0, 3])
RUN = """
import sys, json, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([json.loads(sys.argv[1])])
out = {}
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out[folder] = {"mlp": [type(layer.mlp).__name__ for layer in model.model.layers],
                       "logits": model(ids).logits[0].tolist()}
print(json.dumps(out))
"""


def run(python: str, folders: list[Path]) -> dict:
    """Every folder's MLP classes and logits in the transformers of `python`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([python, "-c", RUN, json.dumps(IDS), *map(str, folders)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="interleave_"))
    dense, built = {}, {}
    for i, (family, arch) in enumerate(CASES):
        dense[family] = make_dense_model(work / f"{family}_4l", family=family, seed=60 + i, num_hidden_layers=4,
                                         random_norms_and_biases=family.startswith("qwen"))
        for layers in LAYERS:
            out = work / f"{family}_{arch}_{'every2' if isinstance(layers, dict) else 'l03'}"
            upcycle({"base_model": str(dense[family]), "architecture": arch, "num_experts": 4, "gate_mode": "random",
                     "dtype": "float32", "moe_layers": layers}, out, force=True)
            built[(family, arch, json.dumps(layers))] = out
    folders = list(dense.values()) + list(built.values())
    versions = {"transformers 5": sys.executable, "transformers 4.57": str(REPO / ".venv-tf4" / "bin" / "python")}
    print(f"{'runtime':18} {'case':40} {'layers 0-3':16} max rel diff")
    for runtime, python in versions.items():
        if not Path(python).is_file():
            print(f"{runtime:18} not installed ({python})")
            continue
        found = run(python, folders)
        for (family, arch, layers), out in built.items():
            got, ref = found[str(out)], torch.tensor(found[str(dense[family])]["logits"])
            diff = float((torch.tensor(got["logits"]) - ref).abs().max() / ref.abs().max())
            kinds = " ".join("MoE" if name.endswith("SparseMoeBlock") else "MLP" for name in got["mlp"])
            print(f"{runtime:18} {family + '->' + arch + ' ' + layers:40} {kinds:16} {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
