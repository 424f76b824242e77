"""Interleaved dense / MoE layers (``moe_layers:``, the sparse-upcycling recipe) from every input family.

Each output that can hold a dense layer (Qwen2-MoE, Qwen3-MoE) is built from 4-layer Llama, Mistral,
Qwen2 and Qwen3 models with some layers left dense. What must hold: transformers 5 and 4.57 build
exactly those layers as MoE blocks (module types per layer), copy-upcycling keeps the dense model's
logits (fp32, to 1e-5 of the largest logit), the dense layers' MLP tensors are the base's bytes, and
routers, experts and shared experts exist in the MoE layers only. Mixtral is refused, naming
``moe_layers`` and the output to use.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moe_upcycle import upcycle
from moe_upcycle.build import prepare
from moe_upcycle.checkpoint.tiny import make_dense_model
from moe_upcycle.errors import ConfigError, PlanError
from moe_upcycle.gates.router import compute_gate_rows
from moe_upcycle.planning.arch import sparse_layer_fields
from moe_upcycle.planning.runtimes import EXACT, NO_LOAD, compatibility
from moe_upcycle.recipe.resolve import gate_params
from tf4_logits import NO_TF4, TF4_PYTHON, tf5_logits
from tolerances import assert_close_rel

pytestmark = pytest.mark.filterwarnings("ignore:.*holds no tokenizer")
IDS = [1, 17, 42, 99, 5, 230, 7, 64, 128, 3, 250, 11]
MOE_CLASSES = {"qwen2_moe": "Qwen2MoeSparseMoeBlock", "qwen3_moe": "Qwen3MoeSparseMoeBlock"}
MLP_CLASSES = {"qwen2_moe": "Qwen2MoeMLP", "qwen3_moe": "Qwen3MoeMLP"}
# every input family and the outputs that hold it, with two choices of layers: Qwen's own "every 2nd" and an
# irregular set with the first and last layer MoE
CASES = [(family, arch, layers) for family, arch in
         (("llama", "qwen2_moe"), ("mistral", "qwen2_moe"), ("qwen2", "qwen2_moe"), ("qwen3", "qwen3_moe"))
         for layers in ({"every": 2}, [0, 3])]
EXPECTED = {"{'every': 2}": ((1, 3), 2, [0, 2]), "[0, 3]": ((0, 3), 1, [1, 2])}  # MoE layers, step, mlp_only_layers


@pytest.fixture(scope="session")
def deep(models) -> dict[str, Path]:
    """4-layer dense models of every input family (Qwen ones with random norms and biases)."""
    return {family: make_dense_model(models / f"{family}_4l", family=family, seed=40 + i, num_hidden_layers=4,
                                     random_norms_and_biases=family.startswith("qwen"))
            for i, family in enumerate(("llama", "mistral", "qwen2", "qwen3"))}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder (single file or shards)."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def mlp_classes(folder: Path) -> list[str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return [type(layer.mlp).__name__ for layer in model.model.layers]


def recipe(base: Path, **extra) -> dict:
    return {"base_model": str(base), "num_experts": 4, "gate_mode": "random", "seed": 3, "dtype": "float32", **extra}


@pytest.fixture(scope="module")
def built(deep, tmp_path_factory) -> dict[tuple, Path]:
    """Every case of `CASES`, copy-upcycled (top-2 of 4 experts)."""
    root = tmp_path_factory.mktemp("interleaved")
    out = {}
    for family, arch, layers in CASES:
        folder = root / f"{family}_{arch}_{len(out)}"
        upcycle(recipe(deep[family], architecture=arch, moe_layers=layers), folder)
        out[(family, arch, str(layers))] = folder
    return out


@pytest.mark.parametrize("family, arch, layers", CASES, ids=[f"{f}->{a} {lay}" for f, a, lay in CASES])
def test_copy_upcycle_builds_those_layers_and_keeps_the_logits(family, arch, layers, deep, built):
    folder = built[(family, arch, str(layers))]
    moe, step, dense = EXPECTED[str(layers)]
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["model_type"], cfg["decoder_sparse_step"], cfg["mlp_only_layers"]) == (arch, step, dense)
    assert cfg["intermediate_size"] == cfg["moe_intermediate_size"] == 128  # dense layers and experts alike
    assert mlp_classes(folder) == [MOE_CLASSES[arch] if i in moe else MLP_CLASSES[arch] for i in range(4)]
    assert_close_rel(tf5_logits(folder, IDS), tf5_logits(deep[family], IDS))
    written, base = tensors(folder), tensors(deep[family])
    for layer in dense:  # the base's own MLP, byte for byte, and nothing of an MoE block
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.{proj}.weight"
            assert written[key].dtype == base[key].dtype and torch.equal(written[key], base[key])
        assert not [k for k in written if k.startswith(f"model.layers.{layer}.mlp.") and
                    ("experts" in k or ".gate." in k or "shared_expert" in k)]
    for layer in moe:  # no dense MLP beside the experts
        assert f"model.layers.{layer}.mlp.gate_proj.weight" not in written
        assert written[f"model.layers.{layer}.mlp.gate.weight"].shape == (4, 64)
    routers = sorted(k for k in written if k.endswith("mlp.gate.weight"))
    assert routers == [f"model.layers.{i}.mlp.gate.weight" for i in moe]


@pytest.mark.skipif(not TF4_PYTHON.is_file(), reason=NO_TF4)
def test_transformers_457_builds_the_same_layers_with_the_dense_logits(deep, built):
    script = """
import sys, json, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor([json.loads(sys.argv[1])])
out = {}
for folder in sys.argv[2:]:
    model, info = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, output_loading_info=True)
    with torch.inference_mode():
        logits = model.eval()(ids).logits[0]
    out[folder] = {"mlp": [type(layer.mlp).__name__ for layer in model.model.layers], "logits": logits.tolist(),
                   "keys": sorted(k for k, v in info.items() if v)}
print(json.dumps(out))
"""
    folders = [str(f) for f in built.values()] + [str(p) for p in deep.values()]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([str(TF4_PYTHON), "-c", script, json.dumps(IDS), *folders], capture_output=True, text=True,
                         timeout=600, env=env, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for (family, arch, layers), folder in built.items():
        moe, _, _ = EXPECTED[layers]
        got = found[str(folder)]
        assert got["keys"] == [], (folder, got["keys"])  # no missing, unexpected or mismatched key
        assert got["mlp"] == [MOE_CLASSES[arch] if i in moe else MLP_CLASSES[arch] for i in range(4)]
        assert_close_rel(torch.tensor(got["logits"]), torch.tensor(found[str(deep[family])]["logits"]))


def test_sparse_layer_fields_reproduce_every_choice_of_layers():
    """transformers' rule — MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 — gives back
    exactly the chosen layers, for every subset of 6 layers."""
    n = 6
    for mask in range(1, 2 ** n):
        moe = tuple(i for i in range(n) if mask >> i & 1)
        fields = sparse_layer_fields(moe, n)
        built = tuple(i for i in range(n) if i not in fields["mlp_only_layers"]
                      and (i + 1) % fields["decoder_sparse_step"] == 0)
        assert built == moe
        assert fields["mlp_only_layers"] == [i for i in range(n) if i not in moe]
    assert sparse_layer_fields((2, 5, 8), 9)["decoder_sparse_step"] == 3
    assert sparse_layer_fields(tuple(range(9)), 9) == {"decoder_sparse_step": 1, "mlp_only_layers": []}


def test_mixtral_is_refused_naming_moe_layers_and_what_to_use(deep):
    with pytest.raises(PlanError) as err:
        upcycle(recipe(deep["llama"], architecture="mixtral", moe_layers=[1, 3]), dry_run=True)
    text = str(err.value)
    assert "architecture: mixtral" in text and "moe_layers: [1, 3] keeps 2 of the 4 layers dense (0, 2)" in text
    assert "→ use architecture: qwen2_moe" in text


def test_mixtral_with_every_layer_listed_is_todays_build(deep):
    plain = upcycle(recipe(deep["llama"]), dry_run=True).plan
    listed = upcycle(recipe(deep["llama"], moe_layers=[0, 1, 2, 3]), dry_run=True).plan
    assert listed.architecture == plain.architecture == "mixtral"
    assert listed.steps == plain.steps and listed.dense_layers == ()
    assert any("every one of the 4 layers" in n for n in listed.notes)


def test_without_architecture_a_llama_becomes_qwen2_moe_and_says_why(deep):
    result = upcycle(recipe(deep["llama"], moe_layers={"every": 2}), dry_run=True)
    assert result.plan.architecture == "qwen2_moe"
    said = [n for n in result.plan.cautions if n.startswith("mixtral: Mixtral makes every layer an MoE layer")]
    assert said and "written as qwen2_moe; add architecture: qwen2_moe" in said[0]


def test_fused_layout_holds_dense_layers(deep, tmp_path):
    out = tmp_path / "fused"
    upcycle(recipe(deep["qwen3"], architecture="qwen3_moe", layout="fused", moe_layers=[0, 3]), out)
    written = tensors(out)
    assert written["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 256, 64)
    assert torch.equal(written["model.layers.1.mlp.up_proj.weight"], tensors(deep["qwen3"])["model.layers.1.mlp.up_proj.weight"])
    assert mlp_classes(out) == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    assert_close_rel(tf5_logits(out, IDS), tf5_logits(deep["qwen3"], IDS))


GATE_MODES = [("random", "native"), ("uniform_random", "native"), ("uniform", "native"), ("cheap_embed", "native"),
              ("hidden", "native"), ("hidden_avg", "native"), ("hidden_last", "native"), ("kmeans", "native"),
              ("random", "mergekit"), ("cheap_embed", "mergekit"), ("hidden", "mergekit"), ("hidden_last", "mergekit")]
PROMPTS = ["Once upon a time there was a dragon", "def add(a, b): return a + b", "The integral of x squared",
           "Bonjour, comment allez-vous"]


@pytest.mark.parametrize("mode, source", GATE_MODES, ids=[f"{m}-{s}" for m, s in GATE_MODES])
def test_every_gate_mode_gives_routers_for_the_moe_layers_only_and_the_same_rows(mode, source, deep, tmp_path):
    """A layer's router rows do not depend on which other layers are MoE layers."""
    base = deep["qwen3"]
    if mode == "kmeans":
        text = tmp_path / "calibration.txt"
        text.write_text("\n".join(PROMPTS * 20), encoding="utf-8")
        fields = {"num_experts": 4, "calibration_text": str(text)}
    elif mode in ("random", "uniform_random", "uniform"):
        fields = {"num_experts": 4}
    else:
        fields = {"experts": [{"source_model": str(base), "positive_prompts": [p]} for p in PROMPTS]}
    common = {"base_model": str(base), "gate_mode": mode, "gate_source": source, "seed": 5, "device": "cpu", **fields}
    rows = {}
    for name, layers in (("interleaved", {"moe_layers": [1, 3]}), ("every layer", {})):
        config, sources, plan = prepare({**common, **layers})
        rows[name] = compute_gate_rows(gate_params(config), plan, sources[config.base_model]).routers
    assert sorted(rows["interleaved"]) == [1, 3] and sorted(rows["every layer"]) == [0, 1, 2, 3]
    for layer in (1, 3):
        assert torch.equal(rows["interleaved"][layer], rows["every layer"][layer])


PROJS = ("gate_proj", "up_proj", "down_proj")
INITS = [{"method": "noise", "scale": 0.05}, {"method": "drop", "ratio": 0.5},
         {"method": "split", "granularity": 2, "shuffle": True}]


@pytest.mark.parametrize("init", INITS, ids=lambda i: i["method"])
def test_every_expert_init_makes_the_moe_layers_experts_the_full_builds_and_keeps_dense_bytes(init, deep, tmp_path):
    base = deep["qwen3"]
    interleaved, full = tmp_path / "interleaved", tmp_path / "full"
    result = upcycle(recipe(base, expert_init=init, moe_layers=[1, 3]), interleaved)
    upcycle(recipe(base, expert_init=init), full)
    a, b, dense = tensors(interleaved), tensors(full), tensors(base)
    experts = [k for k in a if ".experts." in k]
    assert experts and all(k.startswith(("model.layers.1.", "model.layers.3.")) for k in experts)
    assert all(torch.equal(a[k], b[k]) for k in experts)  # inits are keyed by (seed, layer, expert)
    for layer in (0, 2):
        key = f"model.layers.{layer}.mlp.down_proj.weight"
        assert torch.equal(a[key], dense[key])
    cfg = json.loads((interleaved / "config.json").read_text())
    width = 64 if init["method"] == "split" else 128  # split: narrower experts, the dense layers keep 128
    assert (cfg["intermediate_size"], cfg["moe_intermediate_size"]) == (128, width)
    assert mlp_classes(interleaved) == ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"] * 2
    if init["method"] == "split":  # G = 2 divides k = 2 and E = 4: exact
        assert_close_rel(tf5_logits(interleaved, IDS), tf5_logits(base, IDS))
    else:  # the init itself, in the MoE layers' experts, by its formula (float32 output)
        for layer, e, proj in [(layer, e, proj) for layer in (1, 3) for e in range(4) for proj in PROJS]:
            src = dense[f"model.layers.{layer}.mlp.{proj}.weight"].double()
            got = a[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"].double()
            if init["method"] == "noise":  # + N(0, (0.05 · std W)^2): the difference's std, within 5 sampling sds
                assert abs(float((got - src).std() / src.std()) / 0.05 - 1) < 5 / math.sqrt(2 * src.numel())
            else:  # drop 0.5 of 128 neurons: round(0.5 · 128) = 64 re-drawn (rows of gate/up, columns of down)
                changed = (got != src).any(dim=0 if proj == "down_proj" else 1)
                assert int(changed.sum()) == 64, (layer, e, proj)
        assert result.drift is not None and result.drift.mean_kl > 0  # and the build measured its drift


def test_shared_experts_exact_split_sits_in_the_moe_layers_only(deep, tmp_path):
    base = deep["qwen2"]
    out = tmp_path / "shared"
    upcycle({"base_model": str(base), "architecture": "qwen2_moe", "gate_mode": "random", "dtype": "float32",
             "moe_layers": [2], "shared_expert_gate": "constant",
             "experts": [{"source_model": str(base), "residual_scale": 0.5}] * 4,
             "shared_experts": [{"source_model": str(base)}]}, out)
    written = tensors(out)
    shared = sorted({k.split(".mlp.")[0] for k in written if "shared_expert" in k})
    assert shared == ["model.layers.2"]
    assert mlp_classes(out) == ["Qwen2MoeMLP", "Qwen2MoeMLP", "Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"]
    assert json.loads((out / "config.json").read_text())["shared_expert_intermediate_size"] == 128
    assert_close_rel(tf5_logits(out, IDS), tf5_logits(base, IDS))


def test_layer_ranges_feed_the_moe_layers_and_the_dense_layers_stay_the_base(deep, models, tmp_path):
    from moe_upcycle.checkpoint.tiny import make_finetune

    base = deep["qwen3"]
    deeper = make_finetune(base, models / "qwen3_8l_ft", seed=41, scale=0.2, layers=8)
    out = tmp_path / "ranges"
    upcycle({"base_model": str(base), "architecture": "qwen3_moe", "gate_mode": "random", "moe_layers": [1, 3],
             "experts": [{"source_model": str(base)}, {"source_model": str(base)},
                         {"source_model": str(deeper), "layers": [4, 8]}, {"source_model": str(deeper), "layers": [2, 6]}]},
            out)
    written, dense, ft = tensors(out), tensors(base), tensors(deeper)
    for layer in (1, 3):
        assert torch.equal(written[f"model.layers.{layer}.mlp.experts.2.up_proj.weight"],
                           ft[f"model.layers.{layer + 4}.mlp.up_proj.weight"])
        assert torch.equal(written[f"model.layers.{layer}.mlp.experts.3.up_proj.weight"],
                           ft[f"model.layers.{layer + 2}.mlp.up_proj.weight"])
    for layer in (0, 2):  # from base_model, whatever the experts' ranges
        assert torch.equal(written[f"model.layers.{layer}.mlp.up_proj.weight"], dense[f"model.layers.{layer}.mlp.up_proj.weight"])


def test_runtime_verdicts_of_an_interleaved_output(deep):
    for family, arch in (("qwen3", "qwen3_moe"), ("llama", "qwen2_moe")):
        plan = upcycle(recipe(deep[family], architecture=arch, experts_per_token=4, moe_layers={"every": 2}),
                       dry_run=True).plan
        verdicts = {v.runtime: v for v in compatibility(plan)}
        assert verdicts["transformers 5"].status == verdicts["transformers 4.x"].status == EXACT
        assert verdicts["vLLM"].status == EXACT and "mlp_only_layers" in verdicts["vLLM"].why
        assert verdicts["llama.cpp"].status == NO_LOAD and "ffn_gate_inp" in verdicts["llama.cpp"].why
        assert verdicts["ExLlamaV2"].status == NO_LOAD


def test_upcycle_model_interleaves_in_memory(deep):
    from transformers import AutoModelForCausalLM

    from moe_upcycle.in_memory import upcycle_model

    dense = AutoModelForCausalLM.from_pretrained(str(deep["mistral"]), dtype=torch.float32).eval()
    moe = upcycle_model(dense, num_experts=4, moe_layers={"every": 2, "start": 0}).eval()
    assert type(moe).__name__ == "Qwen2MoeForCausalLM"  # Mixtral holds no dense layer
    assert [type(layer.mlp).__name__ for layer in moe.model.layers] == ["Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP"] * 2
    kept = moe.model.layers[1].mlp.up_proj.weight
    assert torch.equal(kept, dense.model.layers[1].mlp.up_proj.weight)
    assert kept.data_ptr() != dense.model.layers[1].mlp.up_proj.weight.data_ptr()  # its own storage
    with torch.inference_mode():
        ids = torch.tensor([IDS])
        assert_close_rel(moe(ids).logits, dense(ids).logits)
    with pytest.raises(ConfigError, match="moe_layers: .1, 3. is text, not a list of layers"):
        upcycle_model(dense, num_experts=4, moe_layers="1, 3")
    with pytest.raises(PlanError, match="moe_layers"):
        upcycle_model(dense, num_experts=4, moe_layers=[1, 3], architecture="mixtral")


BAD = [
    ("1, 3, 5", "write moe_layers: [1, 3, 5]"),
    ("every other", "write moe_layers: {every: 2}"),
    ("all", "every layer is the default; remove moe_layers"),
    (2, "write [2] for layer 2 alone, or {every: 2} for every second layer"),
    (True, "true is a boolean"),
    (1.5, "single number, not layers"),
    ([], "the empty list makes no layer an MoE layer"),
    ([1, 1, 3], "layer 1 is listed 2 times; list each layer once"),
    ([-1], "layer indices count from 0 up"),
    ([1.5], "item 0: 1.5 is not a whole number; write an integer such as 1"),
    ([True], "item 0 is true, a boolean"),
    ([[1, 2]], "write the layers as one flat list"),
    ([None], "item 0 is empty"),
    ({"every": 0}, "moe_layers.every: 0 is too small; write at least 1"),
    ({"every": True}, "moe_layers.every: true is a boolean"),
    ({"every": 2, "start": -1}, "moe_layers.start: -1 is too small"),
    ({"evry": 2}, "moe_layers.evry: unknown key — did you mean every?"),
    ({"every": 2.5}, "moe_layers.every: 2.5 is not a whole number; write an integer such as 2"),
    ({"every": float("inf")}, "moe_layers.every: .inf (not a number, or infinity) is not a finite number"),
]


@pytest.mark.parametrize("value, said", BAD, ids=[repr(v) for v, _ in BAD])
def test_bad_values_are_refused_naming_moe_layers_with_the_fix(value, said, deep):
    with pytest.raises(ConfigError) as err:
        upcycle(recipe(deep["qwen3"], moe_layers=value), dry_run=True)
    assert any("moe_layers" in p and said in p for p in err.value.problems), err.value.problems


@pytest.mark.parametrize("value, said", [
    ([1, 4, 7], "moe_layers: layers 4, 7 do not exist: base_model"),
    ({"every": 5}, "moe_layers: {every: 5} makes layers 4, 9, ... MoE layers, none of which exists"),
    ({"every": 5}, "use every: 2 to 4 (every: 1 is every layer)"),
    # start written by the user: kept in the message, and the fix is the start (before: "use every: 2 to 4")
    ({"every": 5, "start": 4}, "moe_layers: {every: 5, start: 4} makes layers 4, 9, ... MoE layers, none of which "
                               "exists: base_model"),
    ({"every": 5, "start": 4}, "use start: 0 to 3"),
    ({"every": 2, "start": 4}, "use start: 0 to 3"),
])
def test_layers_the_base_does_not_have_are_refused_at_plan_time(value, said, deep):
    with pytest.raises(PlanError) as err:
        upcycle(recipe(deep["qwen3"], moe_layers=value), dry_run=True)
    assert any(said in p and "has 4 layers, 0 to 3" in p for p in err.value.problems), err.value.problems


def test_cli_refuses_a_bad_value_and_writes_nothing(deep, tmp_path):
    from typer.testing import CliRunner

    from moe_upcycle.cli import app

    config = tmp_path / "r.yaml"
    config.write_text(f"base_model: {deep['qwen3']}\nnum_experts: 4\ngate_mode: random\nmoe_layers: 1,3\n")
    result = CliRunner().invoke(app, ["build", str(config), str(tmp_path / "out")])
    assert result.exit_code == 1 and "moe_layers: '1,3' is text, not a list of layers; write moe_layers: [1, 3]" in \
        " ".join(result.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_python_callers_may_pass_ranges_tuples_and_arrays():
    import numpy as np

    from moe_upcycle.recipe.resolve import moe_layers
    from moe_upcycle.recipe.schema import load_config

    base = {"base_model": "m", "num_experts": 4, "gate_mode": "random"}
    for value in (range(1, 8, 2), (1, 3, 5, 7), np.array([1, 3, 5, 7]), torch.tensor([7, 5, 3, 1]), {3, 1, 7, 5},
                  [np.int64(1), 3, 5, 7]):
        assert moe_layers(load_config({**base, "moe_layers": value})).layers(8) == (1, 3, 5, 7), value
    assert moe_layers(load_config({**base, "moe_layers": {"every": 2}})).layers(8) == (1, 3, 5, 7)
    assert moe_layers(load_config({**base, "moe_layers": {"every": 2, "start": 0}})).layers(8) == (0, 2, 4, 6)
    assert moe_layers(load_config(base)).layers(3) == (0, 1, 2)


def test_whole_numbers_written_with_a_point_are_layers_as_everywhere_in_the_recipe():
    """``num_experts: 4.0`` builds; so do ``moe_layers: [1.0, 3.0]`` and ``{every: 2.0}`` (before: the list was
    refused while the mapping was taken). A fraction stays refused."""
    from moe_upcycle.recipe.resolve import moe_layers
    from moe_upcycle.recipe.schema import load_config

    base = {"base_model": "m", "num_experts": 4, "gate_mode": "random"}
    assert moe_layers(load_config({**base, "moe_layers": [1.0, 3.0, 5, 7.0]})).layers(8) == (1, 3, 5, 7)
    assert moe_layers(load_config({**base, "moe_layers": {"every": 2.0}})).layers(8) == (1, 3, 5, 7)
    with pytest.raises(ConfigError, match=r"item 1: 3.5 is not a whole number; write an integer such as 3"):
        load_config({**base, "moe_layers": [1.0, 3.5]})
    with pytest.raises(ConfigError, match=r"layer 1 is listed 2 times"):
        load_config({**base, "moe_layers": [1.0, 1]})


def test_a_boolean_is_no_second_listing_of_layer_0_or_1_and_ordinals_read_right():
    """Before: ``[1, true]`` also said "layer 1 is listed 2 times" (True == 1); "every 21th layer"."""
    from moe_upcycle.recipe.layer_choice import _ordinal
    from moe_upcycle.recipe.schema import load_config

    base = {"base_model": "m", "num_experts": 4, "gate_mode": "random"}
    for value in ([1, True], [0, False]):
        with pytest.raises(ConfigError) as info:
            load_config({**base, "moe_layers": value})
        assert "item 1 is" in str(info.value) and "listed" not in str(info.value)
    assert [_ordinal(n) for n in (2, 3, 4, 11, 21, 22, 23, 112)] == ["second", "third", "4th", "11th", "21st", "22nd",
                                                                     "23rd", "112th"]
