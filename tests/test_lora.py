"""mergekit's ``model+adapter`` references: a PEFT LoRA adapter merged into the model as it is read.

Adapters are written here as peft saves them (adapter_config.json + adapter_model.safetensors,
keys ``base_model.model.<module>.lora_A.weight``), with random nonzero A and B; the merged weights
are checked against a hand computation of peft's merge_and_unload (W + alpha/r * B @ A in fp32,
cast to W's dtype), and built MoEs against the merged dense model's logits.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_upcycle import upcycle
from moe_upcycle.cli.app import app

from conftest import model_logits

FFN = ("gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."


def make_adapter(folder: Path, model: Path, modules: dict[str, int], seed: int, alpha: float = 16.0,
                 extra_config: dict | None = None, default_name: bool = False, fmt: str = "safetensors",
                 embedding: bool = False) -> Path:
    """A LoRA adapter for `model`: module name -> rank, random nonzero A (r, in) and B (out, r)."""
    weights = load_file(str(model / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    mid = ".default" if default_name else ""
    for module, r in modules.items():
        out_f, in_f = weights[f"{module}.weight"].shape
        if embedding and module.endswith("embed_tokens"):
            state[f"{PREFIX}{module}.lora_embedding_A{mid}"] = torch.randn(r, out_f, generator=gen) * 0.1
            state[f"{PREFIX}{module}.lora_embedding_B{mid}"] = torch.randn(in_f, r, generator=gen) * 0.1
            continue
        state[f"{PREFIX}{module}.lora_A{mid}.weight"] = torch.randn(r, in_f, generator=gen) * 0.1
        state[f"{PREFIX}{module}.lora_B{mid}.weight"] = torch.randn(out_f, r, generator=gen) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    rank = next(iter(modules.values()))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "base_model_name_or_path": str(model),
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "rank_pattern": {},
              "alpha_pattern": {}, "task_type": "CAUSAL_LM", **(extra_config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    if fmt == "bin":
        torch.save(state, folder / "adapter_model.bin")
    else:
        save_file(state, str(folder / "adapter_model.safetensors"))
    return folder


def merged_by_hand(model: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """peft's merge_and_unload computed by hand: W + scaling * B @ A in fp32, cast to W's dtype."""
    weights = load_file(str(model / "model.safetensors"))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key in [k for k in lora if ".lora_A" in k or ".lora_embedding_A" in k]:
        module = key[len(PREFIX):].split(".lora_")[0]
        b = lora[key.replace("lora_A", "lora_B").replace("lora_embedding_A", "lora_embedding_B")].float()
        a = lora[key].float()
        # peft's pattern rule: a key names the module itself or the end of its dotted name
        def pick(patterns, default):
            return next((v for k, v in patterns.items() if module == k or module.endswith("." + k)), default)
        r = pick(cfg.get("rank_pattern", {}), cfg["r"])
        alpha = pick(cfg.get("alpha_pattern", {}), cfg["lora_alpha"])
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        delta = (b @ a) * scaling
        if "embedding" in key:
            delta = delta.T
        w = weights[f"{module}.weight"]
        weights[f"{module}.weight"] = (w.float() + delta).to(w.dtype)
    return weights


def save_merged(model: Path, adapter: Path, folder: Path) -> Path:
    """The merged dense model as its own folder (what peft's merge_and_unload().save_pretrained writes)."""
    shutil.copytree(model, folder)
    save_file(merged_by_hand(model, adapter), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def layer_modules(layers=(0, 1), projs=FFN) -> list[str]:
    return [f"model.layers.{i}.mlp.{p}" for i in layers for p in projs]


def read_output(folder: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return state


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    ffn = {m: 4 for m in layer_modules()}
    attn = {f"model.layers.{i}.self_attn.{p}": 4 for i in (0, 1) for p in ("q_proj", "v_proj")}
    return {
        "ffn": make_adapter(root / "ffn", tiny_llama, ffn, seed=1),
        "ffn2": make_adapter(root / "ffn2", tiny_llama, ffn, seed=2, default_name=True),
        "attn": make_adapter(root / "attn", tiny_llama, {**attn, "model.layers.0.mlp.up_proj": 4}, seed=3),
        "rslora": make_adapter(root / "rslora", tiny_llama, {**ffn, "model.layers.1.mlp.down_proj": 8}, seed=4,
                               alpha=8.0, extra_config={"use_rslora": True,
                                                        "rank_pattern": {"model.layers.1.mlp.down_proj": 8},
                                                        "alpha_pattern": {"down_proj": 32}}),
        "embed": make_adapter(root / "embed", tiny_llama, {"model.embed_tokens": 4, **attn}, seed=5, embedding=True),
        "bin": make_adapter(root / "bin", tiny_llama, ffn, seed=6, fmt="bin"),
    }


def moe_config(base: str, experts: list[str], **extra) -> dict:
    return {"base_model": base, "gate_mode": "random", "dtype": "float32", "checksums": False,
            "experts": [{"source_model": e, "positive_prompts": [f"topic {i}"]} for i, e in enumerate(experts)],
            **extra}


# ---------------------------------------------------------------- merged weights in the built experts


@pytest.mark.parametrize("name", ["ffn", "ffn2", "rslora", "bin"])
def test_expert_weights_are_the_merged_weights(name, tiny_llama, adapters, tmp_path):
    """Every expert slot from X+Y holds W + scaling * B @ A (fp32 sum cast to W's dtype), bit for bit."""
    ref = f"{tiny_llama}+{adapters[name]}"
    out = upcycle(moe_config(str(tiny_llama), [ref, str(tiny_llama)]), tmp_path / "moe").output
    state = read_output(out)
    expected = merged_by_hand(tiny_llama, adapters["ffn" if name == "bin" else name]) if name != "bin" else None
    if name == "bin":  # the same computation, from adapter_model.bin
        lora = torch.load(adapters["bin"] / "adapter_model.bin", weights_only=True)
        plain = tmp_path / "bin_as_st"
        plain.mkdir()
        shutil.copy(adapters["bin"] / "adapter_config.json", plain)
        save_file(lora, str(plain / "adapter_model.safetensors"))
        expected = merged_by_hand(tiny_llama, plain)
    dense = load_file(str(tiny_llama / "model.safetensors"))
    for layer in (0, 1):
        for proj, ours in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3")):
            key = f"model.layers.{layer}.mlp.{proj}.weight"
            got = state[f"model.layers.{layer}.block_sparse_moe.experts.0.{ours}.weight"]
            assert torch.equal(got, expected[key]), key
            assert not torch.equal(got, dense[key])  # the adapter did change it
            assert torch.equal(state[f"model.layers.{layer}.block_sparse_moe.experts.1.{ours}.weight"], dense[key])


def test_base_model_with_adapter_changes_attention_and_embeddings(tiny_llama, adapters, tmp_path):
    """base_model: X+Y gives the MoE the adapted attention (and a lora_embedding's embedding)."""
    for name in ("attn", "embed"):
        base = f"{tiny_llama}+{adapters[name]}"
        out = upcycle(moe_config(base, [base, str(tiny_llama)]), tmp_path / name).output
        state, expected = read_output(out), merged_by_hand(tiny_llama, adapters[name])
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
                    "model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight"):
            assert torch.equal(state[key], expected[key]), (name, key)
        changed = load_file(str(tiny_llama / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
        assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"], changed)


def test_copy_init_moe_logits_equal_the_merged_dense_model(tiny_llama, adapters, tmp_path):
    """Every expert and the base are X+Y: the MoE computes what the merged dense model computes."""
    ref = f"{tiny_llama}+{adapters['attn']}"
    merged = save_merged(tiny_llama, adapters["attn"], tmp_path / "merged")
    out = upcycle(moe_config(ref, [ref, ref]), tmp_path / "moe").output
    want, got = model_logits(merged), model_logits(out)
    assert not torch.allclose(want, model_logits(tiny_llama), atol=1e-3)  # the adapter matters
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_hidden_gates_run_the_merged_base(tiny_llama, adapters, tmp_path):
    """gate_mode: hidden on base X+Y captures the merged model's hidden states: the rows equal those of the
    merged folder built as a plain base, and differ from X's."""
    ref = f"{tiny_llama}+{adapters['attn']}"
    merged = save_merged(tiny_llama, adapters["attn"], tmp_path / "merged")
    gate = "model.layers.1.block_sparse_moe.gate.weight"
    rows = {}
    for name, base in (("lora", ref), ("merged", str(merged)), ("plain", str(tiny_llama))):
        out = upcycle(moe_config(base, [str(tiny_llama), str(tiny_llama)], gate_mode="hidden"),
                      tmp_path / f"out_{name}").output
        rows[name] = read_output(out)[gate]
    torch.testing.assert_close(rows["lora"], rows["merged"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(rows["lora"], rows["plain"], atol=1e-4)


# ---------------------------------------------------------------- sharing


def test_same_base_two_adapters_shares_only_untouched_tensors(tiny_llama, adapters, tmp_path):
    """X+A and X+B: tensors an adapter changes are not shared; up_proj of layer 1 (in neither 'attn'
    nor... ) is. 'ffn' adapts every FFN tensor, 'attn' only layer 0's up_proj among them."""
    from moe_upcycle.build import prepare
    from moe_upcycle.planning.report import sharing_report

    a, b = f"{tiny_llama}+{adapters['attn']}", f"{tiny_llama}+{adapters['ffn']}"
    config, sources, plan = prepare(moe_config(str(tiny_llama), [a, b, str(tiny_llama)]))
    lines = sharing_report(plan, sources, "share")
    # shared: every FFN tensor 'attn' leaves alone, between X+attn and X (5 tensors: 6 minus layer 0's up_proj)
    assert lines[0].startswith("Duplicate tensors: 10 expert slots are fed by 5 source tensors"), lines
    assert f"of {tiny_llama} ->" in lines[0]
    out = upcycle(moe_config(str(tiny_llama), [a, b, str(tiny_llama)]), tmp_path / "moe").output
    state, dense = read_output(out), load_file(str(tiny_llama / "model.safetensors"))
    up0 = "model.layers.0.block_sparse_moe.experts.{}.w3.weight"
    assert not torch.equal(state[up0.format(0)], state[up0.format(1)])
    assert not torch.equal(state[up0.format(0)], dense["model.layers.0.mlp.up_proj.weight"])
    down1 = "model.layers.1.block_sparse_moe.experts.{}.w2.weight"
    assert torch.equal(state[down1.format(0)], dense["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(state[down1.format(2)], dense["model.layers.1.mlp.down_proj.weight"])
    assert not torch.equal(state[down1.format(1)], dense["model.layers.1.mlp.down_proj.weight"])


# ---------------------------------------------------------------- refusals


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_weights(folder: Path, change) -> None:
    state = load_file(str(folder / "adapter_model.safetensors"))
    change(state)
    save_file(state, str(folder / "adapter_model.safetensors"))


def _rename(state, old, new):
    state[new] = state.pop(old)


A0 = f"{PREFIX}model.layers.0.mlp.up_proj.lora_A.weight"
B0 = f"{PREFIX}model.layers.0.mlp.up_proj.lora_B.weight"
BAD_ADAPTERS = {
    "peft_type": (lambda f: _edit_config(f, peft_type="IA3"), ["adapter_config.json", "peft_type is 'IA3'",
                                                                "only LORA"]),
    "dora": (lambda f: _edit_config(f, use_dora=True), ["use_dora is true", "merge_and_unload"]),
    "layer_replication": (lambda f: _edit_config(f, layer_replication=[[0, 2]]), ["layer_replication is set"]),
    "bad_r": (lambda f: _edit_config(f, r=0), ["r must be a positive number, got 0"]),
    "infinite_alpha": (lambda f: _edit_config(f, lora_alpha=float("inf")), ["lora_alpha must be a positive number, "
                                                                             "got inf"]),
    "infinite_alpha_pattern": (lambda f: _edit_config(f, alpha_pattern={"up_proj": float("inf")}),
                               ["alpha_pattern must map module names to positive numbers"]),
    # a flag written as text: "false" is truthy, so it must not be read at all
    "dora_as_text": (lambda f: _edit_config(f, use_dora="false"), ["use_dora must be true or false, got 'false'",
                                                                   '(or write "use_dora": false)']),
    "rslora_as_text": (lambda f: _edit_config(f, use_rslora="yes"), ["use_rslora must be true or false, got 'yes'"]),
    "rank_mismatch_config": (lambda f: _edit_config(f, r=8), ["has rank 4 but adapter_config.json gives r = 8"]),
    "no_config": (lambda f: (f / "adapter_config.json").unlink(), ["has no adapter_config.json"]),
    "bad_json": (lambda f: (f / "adapter_config.json").write_text("{"), ["adapter_config.json: not valid JSON"]),
    "no_weights": (lambda f: (f / "adapter_model.safetensors").unlink(),
                   ["has no adapter_model.safetensors or adapter_model.bin"]),
    "unknown_module": (lambda f: _edit_weights(f, lambda s: (_rename(s, A0, A0.replace("up_proj", "upp_proj")),
                                                             _rename(s, B0, B0.replace("up_proj", "upp_proj")))),
                       ["'model.layers.0.mlp.upp_proj.weight'", "does not have", "another model"]),
    "shape": (lambda f: _edit_weights(f, lambda s: s.update({A0: torch.ones(4, 7), })),
              ["make a [128, 7] change", "is [128, 64]"]),
    "ab_rank": (lambda f: _edit_weights(f, lambda s: s.update({B0: torch.ones(128, 3)})), ["their ranks differ"]),
    "non_float": (lambda f: _edit_weights(f, lambda s: s.update({A0: torch.ones(4, 64, dtype=torch.int8)})),
                  ["torch.int8", "must be floating point"]),
    "duplicate": (lambda f: _edit_weights(f, lambda s: s.update({A0.replace("lora_A.", "lora_A.default."): s[A0].clone()})),
                  ["are both lora_A of 'model.layers.0.mlp.up_proj'"]),
    "missing_b": (lambda f: _edit_weights(f, lambda s: s.pop(B0)), ["not its B matrix"]),
    "bias_the_model_lacks": (lambda f: _edit_weights(f, lambda s: s.update(
        {f"{PREFIX}model.layers.0.mlp.up_proj.bias": torch.ones(128)})),
        ["is a bias for 'model.layers.0.mlp.up_proj', which has no bias", "bias: none"]),
    "lora_bias": (lambda f: _edit_weights(f, lambda s: s.update({B0.replace(".weight", ".bias"): torch.ones(128)})),
                  ["adapters with lora_bias are not merged", "merge_and_unload"]),
    # peft >= 0.15 trainable_token_indices: trained rows of the embedding, saved beside the LoRA pairs
    "trainable_tokens": (lambda f: _edit_weights(f, lambda s: s.update(
        {f"{PREFIX}model.embed_tokens.token_adapter.trainable_tokens_delta": torch.ones(2, 64)})),
        ["adapters with trainable tokens (trainable_token_indices) are not merged", "merge_and_unload"]),
    "modules_to_save_shape": (lambda f: _edit_weights(f, lambda s: s.update(
        {f"{PREFIX}lm_head.weight": torch.ones(2, 2)})), ["'base_model.model.lm_head.weight' is [2, 2]",
                                                          "'lm_head.weight'", "resized vocabulary"]),
    "modules_to_save_unknown": (lambda f: _edit_weights(f, lambda s: s.update(
        {f"{PREFIX}model.score.weight": torch.ones(2, 2)})), ["replaces 'model.score.weight'", "another model"]),
    "replaced_twice": (lambda f: _edit_weights(f, lambda s: s.update({
        f"{PREFIX}model.norm.weight": torch.ones(64), f"{PREFIX}model.norm.modules_to_save.default.weight": torch.ones(64)})),
        ["both replace 'model.norm.weight'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_ADAPTERS))
def test_bad_adapters_are_refused(case, tiny_llama, adapters, tmp_path, write_yaml):
    """Each refusal: exit 1, the message names the adapter file / key / field, and no output folder."""
    change, words = BAD_ADAPTERS[case]
    bad = tmp_path / "adapter"
    shutil.copytree(adapters["ffn"], bad)
    change(bad)
    path = write_yaml(moe_config(str(tiny_llama), [f"{tiny_llama}+{bad}", str(tiny_llama)]))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["build", str(path), "-o", str(out)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "experts[0].source_model" in text or str(bad) in text, text
    for word in words:
        assert word in text, (word, text)
    assert not out.exists()


def test_lm_head_adapter_on_a_tied_model_is_refused(tiny_qwen2_tied, tmp_path, write_yaml):
    """A tied model has no lm_head tensor: peft's lm_head merge would change the embedding; refused, named."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({f"{PREFIX}lm_head.lora_A.weight": torch.ones(2, 64), f"{PREFIX}lm_head.lora_B.weight": torch.ones(5, 2)},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    path = write_yaml(moe_config(str(tiny_qwen2_tied), [f"{tiny_qwen2_tied}+{adapter}", str(tiny_qwen2_tied)]))
    result = CliRunner().invoke(app, ["build", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "adapts 'lm_head.weight'" in text and "ties lm_head to its embedding" in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", ["embed_tokens", "lm_head"])
def test_trained_embedding_copy_on_a_tied_model_is_refused(module, tiny_qwen2_tied, tmp_path, write_yaml):
    """modules_to_save with the embedding or lm_head of a tied model: peft's merge unties them (the saved folder
    has tie_word_embeddings false, one of the two keeps the old weights), which a tied MoE cannot hold: refused,
    named, no output. (A LoRA on the tied embedding itself stays tied in peft, and is merged: see above.)"""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_tied))
        peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["up_proj"],
                                                   modules_to_save=[module])).save_pretrained(str(tmp_path / "ad"))
    path = write_yaml(moe_config(str(tiny_qwen2_tied), [f"{tiny_qwen2_tied}+{tmp_path / 'ad'}", str(tiny_qwen2_tied)]))
    result = CliRunner().invoke(app, ["build", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    target = "model.embed_tokens" if module == "embed_tokens" else "lm_head"
    for words in (f"is a trained copy of '{target}' (modules_to_save)", "ties lm_head to its embedding",
                  "peft's merge unties them", "merge_and_unload().save_pretrained(folder)"):
        assert words in text, (words, text)
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_adapter_for_another_base_only_warns(tiny_llama, adapters, tmp_path, monkeypatch):
    """base_model_name_or_path naming another hub model is a warning (mergekit does not check), not a refusal;
    a local model folder proves nothing by its name and gets none."""
    from huggingface_hub import constants

    _cache_repo(tmp_path / "cache", "me/base", tiny_llama)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "adapter"
    shutil.copytree(adapters["ffn"], other)
    _edit_config(other, base_model_name_or_path="someone/other-model")
    with pytest.warns(UserWarning, match="was trained on 'someone/other-model'"):
        upcycle(moe_config(str(tiny_llama), [f"me/base+{other}", str(tiny_llama)]), tmp_path / "moe")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        upcycle(moe_config(str(tiny_llama), [f"{tiny_llama}+{other}", str(tiny_llama)]), tmp_path / "moe2")
        _edit_config(other, base_model_name_or_path="ME/Base")  # hub ids: any case
        upcycle(moe_config(str(tiny_llama), [f"me/base@main+{other}", str(tiny_llama)]), tmp_path / "moe3")


@pytest.mark.parametrize("command", ["build", "plan", "plan --from-config"])
@pytest.mark.parametrize("form, words", [
    ("{model}+{tmp}/nowhere", ["experts[0].source_model (LoRA adapter): model", "nowhere", "not found"]),
    ("{model}+me/missing-adapter@v1", ["experts[0].source_model (LoRA adapter): model 'me/missing-adapter@v1' not "
                                      "found", "give the adapter's folder, or download it first",
                                      "download me/missing-adapter --revision v1)"]),
    ("{model}+", ["has an empty adapter part", "MODEL+ADAPTER"]),
    ("+{model}", ["has an empty model part"]),
    ("{model}+{model}", ["has no adapter_config.json"]),  # a model folder given as the adapter
    ("{model}+{model}/model.safetensors", ["(LoRA adapter): model", "is a file, not a model folder"]),
])
def test_unusable_references_are_named(command, form, words, tiny_llama, tmp_path, write_yaml):
    ref = form.format(model=tiny_llama, tmp=tmp_path)
    path = write_yaml(moe_config(str(tiny_llama), [ref, str(tiny_llama)]))
    args = command.split() + [str(path)] + (["-o", str(tmp_path / "out")] if command == "build" else [])
    result = CliRunner().invoke(app, args)
    if command == "plan --from-config" and "adapter_config" in words[0]:
        # plans from config.json files alone: it checks that the adapter is there, reads none of its files
        assert result.exit_code == 0 and "Traceback" not in result.output, result.output
        return
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "experts[0].source_model" in text and "Traceback" not in text, text
    for word in words:
        assert word in text, (word, text)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- plan, mapping form, verify


def test_plan_and_mapping_form_show_the_adapter(tiny_llama, adapters, write_yaml):
    """mergekit's {model: {path}, lora: {path}} reads as X+Y; `plan` names the adapter."""
    data = moe_config(str(tiny_llama), [str(tiny_llama), str(tiny_llama)])
    data["experts"][0]["source_model"] = {"model": {"path": str(tiny_llama)}, "lora": {"path": str(adapters["ffn"])}}
    result = CliRunner().invoke(app, ["plan", str(write_yaml(data))])
    assert result.exit_code == 0, result.output
    text = "".join(result.output.replace("│", "").split())
    assert "LoRAadapter" in text and f"{tiny_llama}+{adapters['ffn']}:LoRA{adapters['ffn']}" in text, result.output
    assert f"mergedinto6tensorsof{tiny_llama}(scaling4)" in text, result.output


def test_verify_compares_with_the_merged_dense_model(tiny_llama, adapters, tmp_path):
    """verify's dense reference for base_model X+Y is the merged model: a copy-init build agrees exactly."""
    from moe_upcycle.check.verify import verify as verify_folder

    ref = f"{tiny_llama}+{adapters['attn']}"
    out = upcycle(moe_config(ref, [ref, ref]), tmp_path / "moe").output
    result = verify_folder(out, None, hashes=False)
    assert result.comparison is not None, result.notes
    assert result.comparison.top1_agreement == 1.0
    assert result.comparison.max_abs_diff < 1e-4


def test_verify_base_option_and_init_drift_use_the_merged_model(tiny_llama, adapters, tmp_path):
    """`verify --base X+Y` compares with the merged model (exact for a copy-init build of X+Y; not for X),
    and a build's init-drift report runs the merged dense model (zero drift for copies)."""
    ref = f"{tiny_llama}+{adapters['attn']}"
    result = upcycle(moe_config(ref, [ref, ref], report_init_drift=True), tmp_path / "moe")
    assert result.drift is not None and result.drift.top1_agreement == 1.0 and result.drift.mean_kl < 1e-8
    runner = CliRunner()
    merged = runner.invoke(app, ["verify", str(result.output), "--base", ref, "--max-kl", "1e-8"])
    assert merged.exit_code == 0, merged.output
    plain = runner.invoke(app, ["verify", str(result.output), "--base", str(tiny_llama), "--max-kl", "1e-8"])
    assert plain.exit_code == 1 and "above the threshold" in " ".join(plain.output.split()), plain.output


def test_cheap_embed_gates_read_the_adapted_embedding(tiny_llama, adapters, tmp_path):
    """cheap_embed rows come from base_model's embedding: with a lora_embedding adapter, the merged one."""
    ref = f"{tiny_llama}+{adapters['embed']}"
    merged = save_merged(tiny_llama, adapters["embed"], tmp_path / "merged")
    gate = "model.layers.0.block_sparse_moe.gate.weight"
    rows = {name: read_output(upcycle(moe_config(base, [str(tiny_llama)] * 2, gate_mode="cheap_embed"),
                                      tmp_path / f"out_{name}").output)[gate]
            for name, base in (("lora", ref), ("merged", str(merged)), ("plain", str(tiny_llama)))}
    assert torch.equal(rows["lora"], rows["merged"])
    assert not torch.equal(rows["lora"], rows["plain"])


# ---------------------------------------------------------------- against peft itself

PEFT_CONFIGS = {
    "plain": dict(r=4, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]),
    "rslora_patterns": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"],
                            rank_pattern={"down_proj": 8, "model.layers.0.mlp.up_proj": 2},
                            alpha_pattern={"up_proj": 3}),
    "embedding": dict(r=4, lora_alpha=16, target_modules=["embed_tokens", "v_proj"]),  # saves the embedding too
    "fan_in_fan_out": dict(r=4, lora_alpha=16, target_modules=["gate_proj"], fan_in_fan_out=True),
    # whole trained copies, saved under the module's own name, loaded in place of the model's
    "modules_to_save": dict(r=4, lora_alpha=16, target_modules=["up_proj"], modules_to_save=["embed_tokens", "lm_head",
                                                                                              "norm"]),
}
QWEN2_PEFT_CONFIGS = {  # Qwen2 has q/k/v biases: peft saves trained ones as <module>[.base_layer].bias
    "qwen2_bias_all": dict(r=4, lora_alpha=16, target_modules=["q_proj", "up_proj"], bias="all"),
    "qwen2_bias_lora_only": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], bias="lora_only"),
    "qwen2_modules_to_save_biased": dict(r=4, lora_alpha=16, target_modules=["up_proj"], modules_to_save=["k_proj"]),
}


@pytest.mark.parametrize("name", [*sorted(PEFT_CONFIGS), *sorted(QWEN2_PEFT_CONFIGS), "bfloat16", "qwen2_biases"])
def test_merge_equals_peft_merge_and_unload(name, tiny_llama, tiny_qwen2, tmp_path):
    """Every tensor of X+Y, as the build reads it, equals peft's merge_and_unload() bit for bit (fp32 models;
    Qwen2's biased projections keep their bias). On a bf16 model peft adds a delta already rounded to bf16, we
    round once after an fp32 add: an element may differ by one bf16 unit in the last place, no more."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from moe_upcycle.checkpoint.source import open_checkpoint
    from moe_upcycle.checkpoint.tiny import make_dense_model

    if name == "bfloat16":
        tiny_llama = make_dense_model(tmp_path / "bf16", family="llama", seed=3, dtype=torch.bfloat16)
    elif name.startswith("qwen2_"):
        tiny_llama = tiny_qwen2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes (fan_in_fan_out reset for nn.Linear, embedding saving)
        lora = {**PEFT_CONFIGS, **QWEN2_PEFT_CONFIGS}.get(
            name, dict(r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "up_proj", "down_proj"]))
        wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora))
        with torch.no_grad():  # "trained": modules_to_save copies and biases move away from the model's own
            for key, param in wrapped.named_parameters():
                if param.requires_grad and ".lora_" not in key:
                    param.add_(torch.randn_like(param) * 0.1)
        wrapped.save_pretrained(str(tmp_path / "adapter"))
        base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype="auto")
        merged = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload().state_dict()
    checkpoint = open_checkpoint(f"{tiny_llama}+{tmp_path / 'adapter'}", "base_model")
    assert checkpoint.adapter.pairs
    if name in QWEN2_PEFT_CONFIGS or name == "modules_to_save":
        whole = {"qwen2_bias_all": {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in (0, 1) for p in "qkv"},
                 "qwen2_bias_lora_only": {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in (0, 1) for p in "qv"},
                 "qwen2_modules_to_save_biased": {f"model.layers.{i}.self_attn.k_proj.{p}" for i in (0, 1)
                                                  for p in ("weight", "bias")},
                 # peft matches "norm" as the end of a module's name: every norm is a trained copy
                 "modules_to_save": {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                                     *(f"model.layers.{i}.{n}.weight" for i in (0, 1)
                                       for n in ("input_layernorm", "post_attention_layernorm"))}}[name]
        assert set(checkpoint.adapter.replaced) == whole
    for key in checkpoint.tensors:
        ours, theirs = checkpoint.read(key), merged[key]
        assert ours.dtype == theirs.dtype, key
        if name == "bfloat16":  # one bf16 ulp: 2**-7 of the value's power of two
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=2 ** -7, atol=0, msg=key)
        else:
            assert torch.equal(ours, theirs), key


def _cache_repo(cache: Path, repo: str, files: Path, revision: str = "main") -> None:
    """Lay `files` out as hub repo `repo` at `revision` in a Hugging Face cache (offline lookups only)."""
    commit = (repo.encode().hex() * 40)[:40]
    snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
    shutil.copytree(files, snap)
    (snap.parent.parent / "refs").mkdir(exist_ok=True)
    (snap.parent.parent / "refs" / revision).write_text(commit)


def test_hub_ids_with_revisions_and_the_model_card(tiny_llama, adapters, tmp_path, monkeypatch):
    """org/model@rev+org/adapter@rev reads both from the cache; the card lists both hub ids as base_model
    and names the expert "model with LoRA adapter merged in"."""
    from huggingface_hub import constants

    cache = tmp_path / "cache"
    _cache_repo(cache, "me/base", tiny_llama)
    _cache_repo(cache, "me/adapter", adapters["ffn"], revision="v2")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    out = upcycle(moe_config("me/base", ["me/base@main+me/adapter@v2", "me/base"]), tmp_path / "moe").output
    expected = merged_by_hand(tiny_llama, adapters["ffn"])
    assert torch.equal(read_output(out)["model.layers.1.block_sparse_moe.experts.0.w2.weight"],
                       expected["model.layers.1.mlp.down_proj.weight"])
    card = (out / "README.md").read_text()
    assert "base_model:\n- me/base\n- me/adapter\n" in card, card[:600]
    assert "[me/base](https://huggingface.co/me/base) with LoRA [me/adapter](https://huggingface.co/me/adapter) " \
           "merged in" in card
    assert "source_model: me/base+me/adapter" in card


@pytest.mark.parametrize("mode", ["random", "hidden", "cheap_embed"])
def test_memory_estimate_counts_the_merge(mode, tiny_llama, adapters, tmp_path):
    """The plan's private-memory figures grow by at least the fp32 merge of the largest adapted tensor."""
    estimates = {}
    for name, ref in (("plain", str(tiny_llama)), ("lora", f"{tiny_llama}+{adapters['embed' if mode == 'cheap_embed' else 'ffn']}")):
        config = moe_config(ref, [ref, ref], gate_mode=mode)
        estimates[name] = upcycle(config, dry_run=True).summary.memory
    largest = 300 * 64 if mode == "cheap_embed" else 128 * 64  # the embedding / one FFN matrix, elements
    phase = "gate_private_bytes" if mode != "random" else "build_private_bytes"
    grown = getattr(estimates["lora"], phase) - getattr(estimates["plain"], phase)
    assert grown >= 12 * largest, (phase, grown)


def test_nan_made_by_the_adapter_names_the_adapter(tiny_llama, tmp_path):
    """NaN from a broken adapter is blamed on the adapter file, not on the model's (finite) weights file."""
    from moe_upcycle.errors import UpcycleWarning

    ffn = {m: 4 for m in layer_modules()}
    adapter = make_adapter(tmp_path / "broken", tiny_llama, ffn, seed=7)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    key = f"{PREFIX}model.layers.0.mlp.down_proj.lora_A.weight"
    weights[key][0, 0] = float("nan")
    save_file(weights, str(adapter / "adapter_model.safetensors"))
    with pytest.warns(UpcycleWarning) as caught:
        result = upcycle(moe_config(str(tiny_llama), [str(tiny_llama), f"{tiny_llama}+{adapter}"]), tmp_path / "moe")
    said = [str(w.message) for w in caught if "NaN" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith(f"{adapter / 'adapter_model.safetensors'}: the LoRA merged into tensor "
                              f"'model.layers.0.mlp.down_proj.weight'"), said
    assert "the model's own tensor is finite" in said[0] and "check the adapter" in said[0]
    hidden = load_file(str(tiny_llama / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].shape[0]
    built = {k: v for shard in result.shards for k, v in load_file(str(result.output / shard)).items()}
    expert = built["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    assert int(torch.isnan(expert).sum()) == hidden  # one NaN in A's row 0 spreads down B's column: every row
    assert torch.isfinite(built["model.layers.0.block_sparse_moe.experts.0.w2.weight"]).all()


def test_adapter_changes_outside_the_ffn_are_named(tiny_llama, adapters, tmp_path, write_yaml):
    """An expert gives the MoE its FFN only: what its adapter changes in attention is said to be left out
    (plan and build), unless base_model reads the same adapted bytes."""
    attn = adapters["attn"]  # q/v of both layers (4 tensors) and one FFN tensor
    only_attn = tmp_path / "only-attn"
    shutil.copytree(attn, only_attn)
    weights = load_file(str(only_attn / "adapter_model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".mlp." not in k}, str(only_attn / "adapter_model.safetensors"))

    def notes(base: str, expert: str) -> list[str]:
        plan = upcycle(moe_config(base, [str(tiny_llama), expert]), dry_run=True).plan
        return [n for n in plan.cautions if "its LoRA adapter changes" in n]

    said = notes(str(tiny_llama), f"{tiny_llama}+{attn}")
    assert said == [f"experts[1] ({tiny_llama}+{attn}): its LoRA adapter changes 4 tensor(s) that the MoE takes from "
                    f"base_model, not from experts (e.g. model.layers.0.self_attn.q_proj.weight), so only the 1 FFN "
                    f"tensor(s) it changes are in the MoE, as mergekit-moe builds it; to keep those changes, put the "
                    f"adapter on base_model too"], said
    said = notes(str(tiny_llama), f"{tiny_llama}+{only_attn}")
    assert len(said) == 1 and "so the adapter changes nothing in the MoE (this expert's FFN is the model's own)" in said[0]
    assert notes(f"{tiny_llama}+{attn}", f"{tiny_llama}+{attn}") == []  # the base reads the same adapted attention
    assert notes(str(tiny_llama), f"{tiny_llama}+{adapters['ffn']}") == []  # an FFN-only adapter: all of it is used
    path = write_yaml(moe_config(str(tiny_llama), [str(tiny_llama), f"{tiny_llama}+{only_attn}"]))
    result = CliRunner().invoke(app, ["build", str(path), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "so the adapter changes nothing in the MoE" in " ".join(result.output.split())


def test_a_model_folder_holding_an_adapter_is_built_as_transformers_loads_it(tiny_llama, adapters, tmp_path):
    """transformers (with peft) loads such a folder's model and applies the adapter on top: the weights alone are
    not the model the folder's users run. Before, the build read the weights alone, silently; now the plain
    reference is refused naming both fixes, and X+X gives the MoE of the model as transformers runs it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "model_with_adapter"
    shutil.copytree(tiny_llama, folder)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(adapters["attn"] / name, folder / name)
    recipe = tmp_path / "plain.yaml"
    recipe.write_text(f"base_model: {folder}\nnum_experts: 2\ngate_mode: random\n")
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "plain")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    said = " ".join(result.output.split())
    assert (f"base_model: {folder} holds a model and a PEFT adapter (adapter_config.json), which transformers applies "
            f"on top of the model when it loads the folder; write {folder}+{folder}") in said, said
    assert not (tmp_path / "plain").exists()

    ref = f"{folder}+{folder}"
    out = upcycle(moe_config(ref, [ref, ref]), tmp_path / "moe").output
    tok = AutoTokenizer.from_pretrained(str(folder))
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)  # the adapter applied
    with torch.inference_mode():
        want = loaded.eval()(**tok("Once upon a time there was a cat", return_tensors="pt")).logits
    got = model_logits(out, "Once upon a time there was a cat")
    assert not torch.allclose(want, model_logits(tiny_llama, "Once upon a time there was a cat"), atol=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_adapter_resaved_during_the_build_is_never_merged_from(tiny_llama, adapters, tmp_path):
    """The next checkpoint of a LoRA run saved over the adapter while a build merges it: before, the experts
    mixed the old adapter's tensors and the new one's."""
    from moe_upcycle.errors import SourceError

    adapter = tmp_path / "adapter"
    shutil.copytree(adapters["ffn"], adapter)
    seen = []

    def resave_once(step, plan):
        if not seen:
            seen.append(step.name)
            _edit_weights(adapter, lambda state: state.update({k: v * 2 for k, v in state.items()}))

    target = tmp_path / "moe"
    with pytest.raises(SourceError, match="adapter_model.safetensors: the file changed on disk after the build read "
                                          "its header"):
        upcycle(moe_config(str(tiny_llama), [f"{tiny_llama}+{adapter}", str(tiny_llama)]), target, on_step=resave_once)
    assert not target.exists() and (adapter / "adapter_model.safetensors").is_file()
