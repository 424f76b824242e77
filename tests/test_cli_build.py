"""The `build` and `plan` commands through Typer's runner: mergekit configs, reports, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import model_logits
from failure_checks import previous_build
from moe_upcycle import upcycle
from moe_upcycle.cli import app
from moe_upcycle.checkpoint.tiny import make_dense_model
from tolerances import assert_close_rel

runner = CliRunner()


def run(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


def test_mergekit_config_with_cheap_embed_builds_unchanged(tiny_llama, models, tmp_path):
    """A mergekit-moe config (several source_models with prompts, cheap_embed) is accepted as is."""
    coder = make_dense_model(models / "llama_coder", family="llama", seed=10)
    writer = make_dense_model(models / "llama_writer", family="llama", seed=11)
    config = tmp_path / "mergekit.yaml"
    config.write_text(f"""\
base_model: {tiny_llama}
gate_mode: cheap_embed
dtype: float32
experts_per_token: 2
experts:
  - source_model: {coder}
    positive_prompts:
      - "def add(a, b): return a + b"
      - "import numpy as np"
    negative_prompts:
      - "Once upon a time there was a dragon."
  - source_model: {writer}
    positive_prompts:
      - "Once upon a time there was a little dragon."
  - source_model: {tiny_llama}
    positive_prompts:
      - "Solve 2x + 3 = 7 for x."
""")
    code, output = run("build", config, tmp_path / "out")
    assert code == 0, output
    out = tmp_path / "out"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_local_experts"] == 3 and cfg["num_experts_per_tok"] == 2
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    gate_key = "model.layers.0.block_sparse_moe.gate.weight"
    with safe_open(str(out / index["weight_map"][gate_key]), "pt") as f:
        gate = f.get_tensor(gate_key)
        w1 = f.get_tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight")
    with safe_open(str(coder / "model.safetensors"), "pt") as f:
        assert torch.equal(w1, f.get_tensor("model.layers.0.mlp.gate_proj.weight"))
    assert gate.shape == (3, 64)
    norms = gate.norm(dim=-1)
    torch.testing.assert_close(norms, torch.full((3,), 2.0))  # unit rows x default scale 16/sqrt(64)
    assert len({tuple(r.tolist()) for r in gate}) == 3  # different prompts, different rows
    model_logits(out)  # loads with no missing/unexpected keys


def test_dry_run_and_plan_print_plan_and_write_nothing(tiny_llama, write_yaml, tmp_path):
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random",
                      "output": str(tmp_path / "out")})
    for args in (("build", cfg, "--dry-run"), ("plan", cfg)):
        code, output = run(*args)
        assert code == 0, output
        assert "mixtral" in output and "block_sparse_moe.experts.{expert}.w1.weight" in output
        assert "Duplicate tensors: 24 expert slots are fed by 6 source tensors" in output
    assert not (tmp_path / "out").exists()


def test_bin_with_tied_storage_reports_shared_tensors(tiny_llama_bin_tied, write_yaml, tmp_path):
    """`build` says it in one line without paths; `-v build` (and `plan`) gives the whole report."""
    cfg = write_yaml({"base_model": str(tiny_llama_bin_tied), "num_experts": 2, "gate_mode": "uniform"})
    code, output = run("-v", "build", cfg, tmp_path / "out")
    assert code == 0, output
    assert "model.embed_tokens.weight, lm_head.weight share one storage" in output.replace("\n", " ")
    assert "Sharing saves" in output and "--clone-tensors" in output
    assert_close_rel(model_logits(tmp_path / "out"), model_logits(tiny_llama_bin_tied))
    result = CliRunner().invoke(app, ["build", str(cfg), str(tmp_path / "again")])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if "expert slots" in line]
    assert said == ["12 expert slots share 6 source tensors in memory, saving 196.6 KB; 1 tied group(s) of input "
                    "tensors are written explicitly (-v: more)"]
    assert "Sharing saves" not in result.stderr and "no aliasing" not in result.stderr


def test_non_contiguous_source_tensor_written_with_right_values(models, write_yaml, tmp_path):
    base = make_dense_model(models / "llama_noncontig", family="llama", seed=3, fmt="bin")
    state = torch.load(base / "pytorch_model.bin", weights_only=True)
    key = "model.layers.1.mlp.down_proj.weight"
    dense = state[key].clone()
    state[key] = dense.t().contiguous().t()  # same values, transposed strides
    assert not state[key].is_contiguous()
    torch.save(state, base / "pytorch_model.bin")
    cfg = write_yaml({"base_model": str(base), "num_experts": 2, "gate_mode": "random"})
    code, output = run("build", cfg, tmp_path / "out", "--clone-tensors")
    assert code == 0, output
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model-00001-of-00001.safetensors"), "pt") as f:
        for e in range(2):
            assert torch.equal(f.get_tensor(f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"), dense)


def test_hub_id_resolves_from_local_cache(tiny_llama, write_yaml, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-llama" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("abc123")
    for f in tiny_llama.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    cfg = write_yaml({"base_model": "acme/tiny-llama", "num_experts": 2, "gate_mode": "random"})
    code, output = run("build", cfg, tmp_path / "out")
    assert code == 0, output
    code, output = run("build", write_yaml({"base_model": "acme/absent", "num_experts": 2, "gate_mode": "random"}),
                       tmp_path / "out2")
    assert code == 1 and "acme/absent" in output and "Hugging Face cache" in output


BAD_INPUTS = {
    "unknown key": ({"experts": [{"source_model": "{base}", "positve_prompts": ["x"]}]},
                    ["experts[0].positve_prompts", "unknown key", "did you mean positive_prompts"]),
    "bad enum": ({"num_experts": 2, "gate_mode": "hiden"}, ["gate_mode", "'hiden'", "expected"]),
    "bad policy": ({"num_experts": 2, "gate_mode": "random", "tensor_policy": "copy"}, ["tensor_policy", "'copy'"]),
    "missing model": ({"experts": [{"source_model": "/nonexistent/model", "positive_prompts": ["x"]}],
                       "gate_mode": "random", "experts_per_token": 1}, ["experts[0].source_model", "/nonexistent/model", "not found"]),
    "layer mismatch": ({"experts": [{"source_model": "{deep}"}, {"source_model": "{base}"}], "gate_mode": "random"},
                       ["experts[0]", "num_hidden_layers is 3", "has 2"]),
    "too many active": ({"num_experts": 2, "experts_per_token": 3, "gate_mode": "random"},
                        ["experts_per_token is 3", "only 2 experts"]),
    "both experts and num_experts": ({"num_experts": 2, "experts": [{"source_model": "{base}"}], "gate_mode": "random",
                                      "experts_per_token": 1},
                                     ["num_experts and experts are both given"]),
    "prompts needed": ({"num_experts": 2, "gate_mode": "cheap_embed"}, ["gate_mode", "needs prompts"]),
    "bad shard size": ({"num_experts": 2, "gate_mode": "random", "max_shard_size": "5 parsecs"}, ["max_shard_size"]),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_nonzero_names_field_and_writes_nothing(case, tiny_llama, models, write_yaml, tmp_path):
    deep = make_dense_model(models / "llama_deep", family="llama", seed=5, num_hidden_layers=3)
    data, expected = BAD_INPUTS[case]
    text = json.dumps({"base_model": str(tiny_llama), **data}).replace("{base}", str(tiny_llama)).replace("{deep}", str(deep))
    cfg = write_yaml(json.loads(text))
    code, output = run("build", cfg, tmp_path / "out")
    flat = " ".join(output.split())
    assert code == 1, output
    for words in expected:
        assert words in flat, flat
    assert "Traceback" not in output
    assert leftovers(tmp_path, "out") == []


def test_existing_output_refused_then_force_replaces(tiny_llama, write_yaml, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"})
    code, output = run("build", cfg, out)
    assert code == 1 and "already exists" in output and "--force" in output
    assert (out / "keep.txt").read_text() == "precious"
    code, output = run("build", cfg, "-o", out, "--force")  # not ours (no moe_upcycle.json): still refused
    assert code == 1 and "was not written by moe-upcycle" in " ".join(output.split()), output
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    previous_build(out, {"config.json": "{}"})  # a previous build, holding only its own files: replaced
    code, output = run("build", cfg, "-o", out, "--force")
    assert code == 0, output
    assert (out / "config.json").is_file() and json.loads((out / "config.json").read_text())["num_local_experts"] == 2
    assert leftovers(tmp_path, "out") == ["out"]


def test_output_from_yaml_and_missing_output(tiny_llama, write_yaml, tmp_path):
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random",
                      "output": str(tmp_path / "from_yaml")})
    code, output = run("build", cfg)
    assert code == 0, output
    assert json.loads((tmp_path / "from_yaml" / "config.json").read_text())["num_local_experts"] == 2
    cfg2 = write_yaml({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"}, "b.yaml")
    code, output = run("build", cfg2)
    assert code == 1 and "output:" in output


def test_yaml_syntax_error_shows_line_and_column(write_yaml, tmp_path):
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("base_model: x\nexperts: [\n  - a\n")
    code, output = run("build", cfg, tmp_path / "out")
    assert code == 1 and "YAML syntax error" in output and "broken.yaml:" in output


def test_one_model_spelled_three_ways_is_read_once(tiny_llama, tmp_path, monkeypatch):
    """./base, base and /abs/base/ are one folder: before, each spelling was a model of its own, so the 'share'
    policy read and held its FFN three times and the duplicate-tensor report said nothing."""
    from moe_upcycle.build import prepare
    from moe_upcycle.planning.report import sharing_report

    shutil.copytree(tiny_llama, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    config = {"base_model": "./base", "gate_mode": "random", "experts": [
        {"source_model": "./base"}, {"source_model": "base"}, {"source_model": f"{tmp_path / 'base'}/"}]}
    _, sources, plan = prepare(config)
    lines = sharing_report(plan, sources, "share")
    assert lines and lines[0].startswith("Duplicate tensors: 18 expert slots are fed by 6 source tensors"), lines
    assert "of ./base ->" in lines[0]
    same = upcycle(config, tmp_path / "moe").output
    once = upcycle({**config, "experts": [{"source_model": "./base"}] * 3}, tmp_path / "moe-once").output
    assert (same / "model-00001-of-00001.safetensors").read_bytes() == (once / "model-00001-of-00001.safetensors").read_bytes()


def test_a_mergekit_moe_command_line_says_what_to_run(tiny_llama, tmp_path, monkeypatch):
    """`mergekit-moe config.yml merge --copy-tokenizer --allow-crimes --out-shard-size 1B --lazy-unpickle`, as model
    cards give it, with moe-upcycle's name: before, the parser's bare "No such option: --copy-tokenizer"."""
    import shlex

    from moe_upcycle.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yml").write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n")
    args = ["build", "config.yml", "merge", "--copy-tokenizer", "--allow-crimes", "--out-shard-size", "1B",
            "--lazy-unpickle", "--cuda"]
    result = CliRunner().invoke(app, args)
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "No such option" not in text
    assert ("--copy-tokenizer, --allow-crimes, --out-shard-size 1B, --lazy-unpickle, --cuda are mergekit-moe's "
            "options, not moe-upcycle's") in text
    assert ("--out-shard-size 1B: mergekit counts parameters per shard, not bytes: 1B parameters are 2GB in bfloat16 "
            "or float16 (4GB in float32) → --max-shard-size 2GB") in text
    assert "Run: moe-upcycle build config.yml merge --max-shard-size 2GB --device cuda" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yml"]
    # the command it gives runs (on the CPU here)
    run = shlex.split(text.split("Run: ")[1])[1:]
    run[run.index("cuda")] = "cpu"
    done = CliRunner().invoke(app, run)
    assert done.exit_code == 0, done.output
    assert json.loads((tmp_path / "merge" / "config.json").read_text())["num_local_experts"] == 2


@pytest.mark.parametrize("args, run", [
    (["config.yml", "merge"], "moe-upcycle build config.yml merge"),
    (["Config.YAML", "out", "--copy-tokenizer", "--out-shard-size", "2B"], "moe-upcycle build Config.YAML out --max-shard-size 4GB"),
])
def test_a_recipe_where_the_command_goes_says_which_command(args, run):
    """`moe-upcycle config.yml merge` (mergekit-moe's argument order): before, "No such command 'config.yml'"."""
    from moe_upcycle.cli import app

    result = CliRunner().invoke(app, args)
    text = " ".join(result.output.split())
    assert result.exit_code == 1
    assert f"{args[0]} is a recipe, not a command; build from it with: {run}" in text
    assert f"(or plan it first: moe-upcycle plan {args[0]})" in text
