"""Logits of saved model folders in transformers 4.57 (the `.venv-tf4` that .ci/run makes) and in this process's
transformers 5: what the runtime tests compare with each other and with the plans' verdicts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Union

import torch

REPO = Path(__file__).resolve().parents[1]
TF4_PYTHON = REPO / ".venv-tf4" / "bin" / "python"  # made by .ci/run before pytest
NO_TF4 = "needs .venv-tf4 (transformers 4.57), which .ci/run creates"

SCRIPT = """
import sys, json, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([json.loads(sys.argv[1])])
out = {}
for folder in sys.argv[2:]:
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.inference_mode():
            out[folder] = model.eval()(ids).logits[0].tolist()
    except Exception as e:
        out[folder] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def tf4_logits(ids: list[int], folders: list[str]) -> dict[str, Union[list, str]]:
    """One 4.57 process loads each folder in fp32 and runs `ids`: folder -> logits (a list), or the error's text."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([str(TF4_PYTHON), "-c", SCRIPT, json.dumps(ids), *folders], capture_output=True,
                         text=True, timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def tf5_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """The folder's fp32 logits for `ids` in this process's transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


LOAD_SCRIPT = """
import sys, json, torch, transformers
m, info = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32,
                                                            output_loading_info=True)
with torch.inference_mode():
    out = m(torch.tensor(json.loads(sys.argv[2]))).logits[0].tolist()
print(json.dumps({"class": type(m).__name__, "problems": {k: list(v) for k, v in info.items() if v}, "logits": out}))
"""


def tf4_load(folder: Path, ids: list[list[int]]) -> dict:
    """A 4.57 process loads `folder` in fp32 and runs the (1, T) `ids`: its class, the loading problems
    (missing / unexpected / mismatched keys) and the logits of the first row."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([str(TF4_PYTHON), "-c", LOAD_SCRIPT, str(folder), json.dumps(ids)], capture_output=True,
                         text=True, timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def folder_logits(folder: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The folder's logits for the (B, T) `ids` in this process's transformers, loaded in `dtype`, as fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    with torch.inference_mode():
        return model(ids).logits.float()


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `folder`, by name."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out
