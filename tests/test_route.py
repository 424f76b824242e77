"""Routing of a built MoE: own prompts go to their own expert on stories260K; `route` numbers and CLI."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from typer.testing import CliRunner

from moe_upcycle import upcycle
from moe_upcycle.cli import app
from moe_upcycle.gates.checks import layer_ranges, parallel_experts
from moe_upcycle.check.route import route
from routing_prompts import CODE, STORY

runner = CliRunner()


@pytest.fixture(scope="module")
def moe(stories, tmp_path_factory):
    """stories260K upcycled to two experts whose prompts differ in kind: code snippets vs. stories."""
    out = tmp_path_factory.mktemp("route") / "moe"
    result = upcycle({"base_model": str(stories), "gate_mode": "hidden", "experts_per_token": 1, "device": "cpu",
                      "experts": [{"source_model": str(stories), "name": "code", "positive_prompts": CODE},
                                  {"source_model": str(stories), "name": "story", "positive_prompts": STORY}]}, out)
    return result


@pytest.fixture(scope="module")
def routed(moe):
    return route(moe.output, CODE + STORY, device="cpu", batch_size=5)


def test_each_expert_gets_its_own_prompts_top1_in_most_layers(routed):
    majority = routed.layer_majority()  # (P, L): expert most of the prompt's tokens chose first
    n = len(CODE)
    code_share = (majority[:n] == 0).double().mean().item()
    story_share = (majority[n:] == 1).double().mean().item()
    assert code_share >= 0.8 and story_share >= 0.8, (code_share, story_share)
    # and across layers and tokens, every prompt's most chosen expert is its own
    assert routed.prompt_expert() == [0] * n + [1] * len(STORY)


def test_route_numbers_are_consistent(routed, moe):
    assert routed.expert_names == ["code", "story"]
    p, layers, e = routed.top1.shape
    assert (p, layers, e) == (len(CODE) + len(STORY), 5, 2)
    # every real token has exactly one top-1 expert per layer
    assert torch.equal(routed.top1.sum(dim=2), routed.tokens[:, None].expand(p, layers))
    load = routed.layer_load()
    torch.testing.assert_close(load.sum(dim=1), torch.ones(layers, dtype=torch.float64))
    entropy = routed.layer_entropy()
    expected = -(load * torch.log2(load)).sum(dim=1)
    torch.testing.assert_close(entropy, expected)
    assert ((entropy > 0.5) & (entropy <= 1.0)).all()  # both experts used, neither starved
    share = routed.prompt_share()
    torch.testing.assert_close(share.sum(dim=1), torch.ones(p, dtype=torch.float64))
    # the gate rows written equal what route sees: its own prompts, same numbers twice
    again = route(moe.output, CODE[:2], device="cpu", batch_size=1)
    torch.testing.assert_close(again.top1, routed.top1[:2])


def test_route_cli_json(moe, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{STORY[0]}\n\n{STORY[1]}\n", encoding="utf-8")
    result = runner.invoke(app, ["route", str(moe.output), "--prompts", str(prompts), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    assert data["experts"] == ["code", "story"] and data["max_entropy_bits"] == 1.0
    assert [p["prompt"] for p in data["prompts"]] == STORY[:2]
    assert all(p["top_expert"] == "story" for p in data["prompts"])
    assert all(math.isclose(sum(p["top1_share"].values()), 1.0, abs_tol=2e-4) for p in data["prompts"])
    assert [row["layer"] for row in data["layers"]] == [0, 1, 2, 3, 4]
    assert len(data["prompts"][0]["layer_top_expert"]) == 5


def test_route_cli_tables_and_plot(moe, tmp_path):
    pytest.importorskip("matplotlib")  # the optional `plot` extra; the error path is tested below
    prompts = tmp_path / "p.yaml"
    prompts.write_text(json.dumps({"prompts": [CODE[0], STORY[0]]}), encoding="utf-8")
    png = tmp_path / "routing.png"
    result = runner.invoke(app, ["route", str(moe.output), "--prompts", str(prompts), "--plot", str(png),
                                 "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "per layer: top-1 expert load" in result.stdout and "entropy" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_plot_without_matplotlib_is_a_clear_error(moe, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n", encoding="utf-8")
    result = runner.invoke(app, ["route", str(moe.output), "--prompts", str(prompts), "--plot",
                                 str(tmp_path / "r.png"), "--device", "cpu"])
    assert result.exit_code == 1
    assert "--plot needs matplotlib" in result.output and "pip install matplotlib" in result.output
    assert "pip install -e '.[plot]'" in result.output and "'moe-upcycle[plot]'" not in result.output


def test_route_rejects_a_dense_model(stories, tmp_path, monkeypatch):
    """From its config.json, before any loading (a dense 70B would load for minutes only to be refused)."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the dense model was loaded before the refusal"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n", encoding="utf-8")
    result = runner.invoke(app, ["route", str(stories), "--prompts", str(prompts), "--device", "cpu"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in text, text
    assert f"{stories} is a dense model (model_type 'llama', LlamaForCausalLM" in text
    assert "not a Mixture-of-Experts, so there is nothing to route" in text


def test_parallel_gates_are_named_with_their_layers():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    gates = {layer: torch.stack([a, a * 2 + 0.01 * layer, b]) for layer in range(4)}
    gates[2] = torch.stack([a, b, -a])  # layer 2 tells them apart
    (message,) = parallel_experts(gates, ["coder", "math", "chat"])
    assert "`coder` and `math`" in message and "layer(s) 0-1, 3" in message and "too similar" in message
    assert parallel_experts({0: torch.zeros(3, 8)}, ["a", "b", "c"]) == []  # uniform gates: by design
    assert layer_ranges([0, 1, 2, 4]) == "0-2, 4"


def test_a_split_builds_tied_routers_are_not_reported_as_parallel(tiny_llama, tmp_path):
    """expert_init: split ties the router rows within each virtual group on purpose (that keeps it exact): no
    warning about them, and none blaming prompts a random gate never read."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    tied = {0: torch.stack([a, a, b, b])}
    assert parallel_experts(tied, ["e0", "e1", "e2", "e3"], group_size=2) == []
    (message,) = parallel_experts({0: torch.stack([a, a, b])}, ["e0", "e1", "e2"], from_prompts=False)
    assert message.endswith("in layer(s) 0: the router cannot tell them apart") and "prompts" not in message
    result = upcycle({"base_model": str(tiny_llama), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random",
                      "expert_init": {"method": "split", "granularity": 2}}, tmp_path / "moe")
    assert result.gate_warnings == []


def test_build_warns_about_identical_prompts(tiny_llama, tmp_path, write_yaml):
    same = ["def add(a, b): return a + b", "for i in range(10): print(i)"]
    cfg = write_yaml({"base_model": str(tiny_llama), "gate_mode": "cheap_embed", "experts": [
        {"source_model": str(tiny_llama), "name": "coder", "positive_prompts": same},
        {"source_model": str(tiny_llama), "name": "math", "positive_prompts": same},
        {"source_model": str(tiny_llama), "name": "chat", "positive_prompts": ["Hello! How are you today?"]}]})
    result = runner.invoke(app, ["build", str(cfg), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "experts `coder` and `math` are nearly parallel" in result.output
    assert "layer(s) 0-1" in result.output and "`chat`" not in result.output


def test_build_device_option_is_validated(tiny_llama, tmp_path, write_yaml):
    cfg = write_yaml({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random"})
    result = runner.invoke(app, ["build", str(cfg), str(tmp_path / "out"), "--device", "tpu"])
    assert result.exit_code == 1
    assert "--device 'tpu' is not a device; use auto, cpu, cuda or cuda:N" in result.output
    assert not (tmp_path / "out").exists()


def test_a_pad_token_added_past_the_embedding_routes(moe, tmp_path):
    """A tokenizer given a [PAD] token after training (id = vocab size, no embedding row): before, route refused
    every batch that needed padding ("produced token id 512 ... do not belong to this model"), though the pad
    positions are masked; now they are padded with a row that exists, and the routing is the unpadded one."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "moe"
    shutil.copytree(moe.output, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok.add_special_tokens({"pad_token": "[PAD]"})
    assert tok.pad_token_id == vocab
    tok.save_pretrained(folder)
    prompts = [CODE[0], STORY[0] + " " + STORY[1]]  # different lengths: the batch is padded
    padded = route(folder, prompts, device="cpu", batch_size=2)
    alone = [route(folder, [p], device="cpu", batch_size=1) for p in prompts]
    for i, single in enumerate(alone):
        assert torch.equal(padded.top1[i], single.top1[0])


def test_labels_that_name_no_expert_are_refused_before_the_model_loads(moe, tmp_path, monkeypatch):
    """Checked after the MoE had loaded (minutes for a large one), and named as labels[0]."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the MoE was loaded before the labels were checked"))
    labels = tmp_path / "labels.csv"
    labels.write_text("expert,prompt\nCode,def f(x): return x\nstory_teller,Once upon a time\n")
    result = runner.invoke(app, ["route", str(moe.output), "--labeled", str(labels), "--device", "cpu"])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in text, text
    names = ", ".join(json.loads((moe.output / "moe_upcycle.json").read_text())["config"]["experts"][i]["name"]
                      for i in range(2))
    assert (f"--labeled {labels}: prompt 1 ('def f(x): return x') has label 'Code', which is not an expert; did you "
            f"mean code? expected one of {names}") in text
    assert "prompt 2 ('Once upon a time') has label 'story_teller', which is not an expert; expected one of" in text


def test_route_counts_equal_the_routers_own_logits(moe, routed):
    """Each prompt alone through the MoE with `output_router_logits`: the top-1 and top-k counts over its real
    tokens (not the BOS) are route's counts, which were made in padded batches of 5 on the router's device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_upcycle.gates.batches import encode

    model = AutoModelForCausalLM.from_pretrained(moe.output, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(moe.output)
    n_experts, k = model.config.num_local_experts, model.config.num_experts_per_tok
    top1 = torch.zeros_like(routed.top1)
    topk = torch.zeros_like(routed.topk)
    for p, enc in enumerate(encode(tokenizer, CODE + STORY, 4096)):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([enc.ids]), output_router_logits=True)
        real = torch.tensor(enc.real)
        for layer, logits in enumerate(out.router_logits):
            logits = logits.reshape(len(enc.ids), n_experts)[real]
            top1[p, layer] = torch.bincount(logits.argmax(dim=1), minlength=n_experts)
            topk[layer] += torch.bincount(logits.topk(k, dim=1).indices.reshape(-1), minlength=n_experts)
    assert torch.equal(routed.top1, top1)
    assert torch.equal(routed.topk, topk)
    assert torch.equal(routed.tokens, top1[:, 0].sum(dim=1))


def test_route_adds_no_host_synchronisation_per_layer(moe, monkeypatch):
    """On a GPU, masked indexing (nonzero), bincount, .item() and copies to the host make the host wait for the
    queue. Counted at torch's dispatcher on the CPU: route adds none of them to the plain forward of the same
    padded batches (before: a masked index and a bincount per layer, and a copy to the host per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_upcycle.check import route as route_module
    from moe_upcycle.gates.batches import encode, pad_batch, padding_id
    from moe_upcycle.inputs.text import check_token_ids

    waits = {"aten.nonzero", "aten.bincount", "aten._local_scalar_dense", "aten.masked_select", "aten.item"}

    class Count(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket._qualified_op_name.replace("::", ".")
            Count.seen.append(name)
            return func(*args, **(kwargs or {}))

    texts = CODE[:4] + STORY[:3]
    model = AutoModelForCausalLM.from_pretrained(moe.output, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(moe.output)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **kw: model)

    def plain():  # route's batches, no hooks
        encoded = encode(tokenizer, texts, 4096)
        pad_id = padding_id(tokenizer, model.get_input_embeddings().num_embeddings)
        with torch.inference_mode():
            for start in range(0, len(encoded), 3):
                ids, attn, real = pad_batch(encoded[start:start + 3], pad_id, "right")
                check_token_ids(ids[attn.bool()], model.get_input_embeddings().num_embeddings, tokenizer)
                model.base_model(input_ids=ids, attention_mask=attn, use_cache=False)

    def waits_in(fn) -> dict:
        Count.seen = []
        with Count():
            fn()
        return {name: Count.seen.count(name) for name in waits}

    base = waits_in(plain)
    routed = waits_in(lambda: route_module.route(moe.output, texts, device="cpu", batch_size=3))
    assert routed == base, (routed, base)
