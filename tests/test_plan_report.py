"""Planning without spending: meta descriptions of 7B-class models, exact counts, memory, disk."""

from __future__ import annotations

import json
import time
from collections import namedtuple

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from moe_upcycle import OutputError, load_config, upcycle
from moe_upcycle.planning.plan_report import parameter_counts
from moe_upcycle.cli import app
from moe_upcycle.errors import PlanError
from moe_upcycle.checkpoint.meta_model import describe_dense
from moe_upcycle.planning.plan import make_plan
from moe_upcycle.planning.memory import RUNTIME_BYTES
from moe_upcycle.planning.plan_report import summarize
from moe_upcycle.planning.report import sharing_report
from moe_upcycle.checkpoint.source import meta_checkpoint

runner = CliRunner()
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1 config.json (the fields that matter)
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
MISTRAL_7B_PARAMS = 7_241_732_096
MIXTRAL_8X7B_PARAMS = (46_702_792_704, 12_879_925_248)  # total, active with top-2
REF = "mistralai/Mistral-7B-v0.1"


def _mixtral_plan(**extra):
    config = load_config({"base_model": REF, "num_experts": 8, "experts_per_token": 2, "gate_mode": "random", **extra})
    sources = {REF: meta_checkpoint(REF, MISTRAL_7B, describe_dense(MISTRAL_7B))}
    return config, sources, make_plan(config, sources)


@pytest.mark.parametrize("family,extra", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("llama", {"attention_bias": True}),
    ("mistral", {"num_key_value_heads": 2}), ("llama", {"head_dim": 32}),
])
def test_describe_dense_matches_transformers_meta_model(family, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=120)
    hf_config = AutoConfig.for_model(family, **dims, **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if hf_config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # a tied head is not stored
    described = describe_dense({"model_type": family, **dims, **extra})
    assert {k: s for k, (s, _) in described.items()} == expected


def test_describe_mistral_7b():
    start = time.perf_counter()
    tensors = describe_dense(MISTRAL_7B)
    assert time.perf_counter() - start < 0.05
    assert len(tensors) == 291
    assert sum(torch.Size(s).numel() for s, _ in tensors.values()) == MISTRAL_7B_PARAMS
    assert {d for _, d in tensors.values()} == {torch.bfloat16}
    assert tensors["model.layers.31.self_attn.k_proj.weight"][0] == (1024, 4096)


def test_describe_rejects_unknown_family():
    with pytest.raises(PlanError, match="model_type 'gpt2' is not supported as input; supported: LlamaForCausalLM"):
        describe_dense({"model_type": "gpt2", "hidden_size": 8})


def test_mixtral_8x7b_plan_on_meta_tensors():
    start = time.perf_counter()
    config, sources, plan = _mixtral_plan(dtype="bfloat16")
    summary = summarize(config, plan, sources, sharing_report(plan, sources, "share"))
    assert time.perf_counter() - start < 1.0  # milliseconds in practice; no tensor memory at all
    assert summary.num_tensors == len(plan.steps) == 995
    assert (summary.total_params, summary.active_params) == MIXTRAL_8X7B_PARAMS
    assert f"{summary.total_params / 1e9:.1f}B / {summary.active_params / 1e9:.1f}B" == "46.7B / 12.9B"
    assert summary.output_bytes == plan.total_bytes == 2 * MIXTRAL_8X7B_PARAMS[0] == 93_405_585_408
    assert summary.num_shards == 19  # 5 GB shards
    routers = 32 * 8 * 4096 * 4
    assert summary.memory.gate_private_bytes == RUNTIME_BYTES + routers
    # bf16 in, bf16 out: every slot is a view of the mapped input; the largest private tensor is one
    # layer's router cast to bf16 (8 x 4096 x 2 bytes)
    assert summary.memory.build_private_bytes == RUNTIME_BYTES + routers + 8 * 4096 * 2 + 4 * 16 * 2**20  # + staging
    rows = {c.template: c for c in summary.components}
    w1 = rows["model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight"]
    assert (w1.count, w1.shape, w1.source, w1.params) == (256, (14336, 4096), "model.layers.{layer}.mlp.gate_proj.weight",
                                                          256 * 14336 * 4096)
    assert "768 expert slots are fed by 96 source tensors" in summary.sharing[0]


def test_parameter_counts_are_exact_for_tied_stories(stories, tmp_path):
    result = upcycle({"base_model": str(stories), "num_experts": 4, "gate_mode": "random"}, tmp_path / "moe")
    stored = 0
    for shard in result.shards:
        with safe_open(str(result.output / shard), "pt") as f:
            stored += sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    total, active = parameter_counts(result.plan)
    assert total == stored  # the tied embedding is stored, and counted, once
    expert = 3 * 64 * 172
    assert total - active == 5 * 2 * expert  # per layer, 2 of the 4 experts are idle
    assert result.summary.total_params == total and result.summary.tied_embeddings


def test_fused_layout_counts_active_parameters_per_expert():
    # a fused tensor holds all of a layer's experts; only experts_per_token of them are active
    for layout in ("per_expert", "fused"):
        _, _, plan = _mixtral_plan(layout=layout)
        assert parameter_counts(plan) == MIXTRAL_8X7B_PARAMS, layout
    _, _, plan = _mixtral_plan(layout="fused", experts_per_token=1)
    total, active = parameter_counts(plan)
    assert total == MIXTRAL_8X7B_PARAMS[0] and total - active == 32 * 7 * 3 * 4096 * 14336


def test_plan_cli_from_config_only(tmp_path, write_yaml):
    folder = tmp_path / "Mistral-7B-config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MISTRAL_7B))
    cfg = write_yaml({"base_model": str(folder), "num_experts": 8, "gate_mode": "random"})
    res = runner.invoke(app, ["plan", str(cfg), "--from-config", "-o", str(tmp_path / "out")],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "46,702,792,704 (46.70B) total, 12,879,925,248 (12.88B) active per token" in res.stdout
    assert "93,405,585,408 bytes) in 19 shard(s)" in res.stdout
    assert "Disk: needs 93.4 GB" in res.stdout
    # without --from-config the missing weights are reported as usual
    res = runner.invoke(app, ["plan", str(cfg)])
    assert res.exit_code == 1 and "has no model.safetensors" in res.stderr


def test_build_dry_run_prints_plan(tiny_llama, write_yaml, tmp_path):
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random"})
    res = runner.invoke(app, ["build", str(cfg), str(tmp_path / "out"), "--dry-run"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    total, active = 260_416, 162_112  # 4 copies of tiny_llama's MLP, 2 active
    assert f"{total:,} (0.26M) total" in res.stdout and f"{active:,} (0.16M) active per token" in res.stdout
    assert "— fits" in res.stdout and not (tmp_path / "out").exists()


def test_build_stops_before_writing_when_disk_is_too_small(tiny_llama, tmp_path, monkeypatch, write_yaml):
    import moe_upcycle.checkpoint.disk_space as guards

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(guards.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 12_345, 12_345))
    target = tmp_path / "moe"
    with pytest.raises(OutputError) as err:
        upcycle({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random"}, target)
    message = str(err.value)
    assert f"not enough disk space for the output in {tmp_path}" in message
    assert "12345 bytes (12.3 KB) available" in message
    assert not target.exists() and list(tmp_path.iterdir()) == []  # nothing staged, no lock left
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random"}, "c.yaml")
    res = runner.invoke(app, ["build", str(cfg), str(target)])
    assert res.exit_code == 1 and "12345 bytes (12.3 KB) available" in " ".join(res.stderr.split()) and not target.exists()
