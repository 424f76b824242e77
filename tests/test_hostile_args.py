"""Hostile arguments to the Python API and to every command's options: each is refused with an
`UpcycleError` (the CLI: exit 1, no traceback, nothing written) that names the argument or option,
and a call that succeeds leaves the dense model exactly as it was.

Broken checkpoints, output-folder safety and published configs are covered elsewhere
(test_bad_inputs, test_trust_*, test_mergekit_configs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from failure_checks import assert_clean_failure, cli
from moe_upcycle import upcycle_model
from moe_upcycle.errors import ConfigError


@pytest.fixture(scope="module")
def dense(stories):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float32)


def snapshot(model: torch.nn.Module) -> dict:
    """Every tensor's bytes, dtype and requires_grad, plus the training flag."""
    state = {k: (v.detach().clone(), v.dtype, v.requires_grad) for k, v in model.state_dict(keep_vars=True).items()}
    return {"state": state, "training": model.training}


def assert_unchanged(model: torch.nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["training"] == before["training"]
    assert after["state"].keys() == before["state"].keys()
    for k, (t, dtype, grad) in before["state"].items():
        t2, dtype2, grad2 = after["state"][k]
        assert dtype2 == dtype and grad2 == grad and torch.equal(t2, t), k


# ---------------------------------------------------------------------------------------------
# upcycle_model: what is passed as the dense model


def _classifier(folder):
    import warnings

    from transformers import LlamaForSequenceClassification

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its new score head is initialised: said by transformers, not us
        return LlamaForSequenceClassification.from_pretrained(str(folder), num_labels=2)


@pytest.mark.parametrize("case_id,make,words", [
    ("path-string", lambda d, s: str(s), ["dense_model: expected a loaded transformers model, not str", "AutoModelForCausalLM.from_pretrained",
                                          "moe_upcycle.upcycle"]),
    ("path-object", lambda d, s: s, ["dense_model: expected a loaded transformers model, not PosixPath", "moe_upcycle.upcycle"]),
    ("none", lambda d, s: None, ["dense_model: expected a loaded transformers model, not NoneType"]),
    ("bare-module", lambda d, s: torch.nn.Linear(4, 4), ["dense_model: expected a loaded transformers model, not Linear"]),
    ("decoder-without-lm-head", lambda d, s: d.model, ["dense_model: a LlamaModel is not a causal language model",
                                                       "a ...Model is the decoder alone", "ForCausalLM"]),
    ("task-head", lambda d, s: _classifier(s), ["dense_model: a LlamaForSequenceClassification is not a causal "
                                                "language model", "ends in a task head", "pass the ...ForCausalLM"]),
], ids=["path-string", "path-object", "none", "bare-module", "decoder-without-lm-head", "task-head"])
def test_not_a_causal_lm_is_named(case_id, make, words, dense, stories):
    before = snapshot(dense)
    with pytest.raises(ConfigError) as info:
        upcycle_model(make(dense, stories), num_experts=2)
    for word in words:
        assert word in str(info.value)
    assert_unchanged(dense, before)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft calling transformers
@pytest.mark.parametrize("how", ["PeftModel", "injected"])
def test_model_with_unmerged_lora_layers_is_named(how, dense):
    """A LoRA-wrapped model (peft's get_peft_model, or LoRA layers injected into the model itself, as transformers'
    add_adapter does) is refused with the merge to do, not planned as a Llama missing its norms; the caller's model
    is left as it was. The injected case calls peft's inject_adapter_in_model, the function add_adapter calls:
    transformers 5.24 refuses add_adapter itself with peft < 0.22, which is not on PyPI yet."""
    import copy

    peft = pytest.importorskip("peft")  # in the test extra
    model = copy.deepcopy(dense)
    lora = peft.LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"])
    if how == "PeftModel":
        model = peft.get_peft_model(model, lora)
    else:
        model = peft.inject_adapter_in_model(lora, model)
    before = snapshot(model)
    with pytest.raises(ConfigError) as info:
        upcycle_model(model, num_experts=2)
    text = str(info.value)
    assert text.startswith(f"dense_model: a {type(model).__name__} carrying PEFT adapter layers (parameter '"), text
    assert "merge_and_unload()" in text and "lora_A" in text
    assert_unchanged(model, before)


@pytest.mark.parametrize("wrapper", ["DataParallel", "DeepSpeedEngine"])
def test_a_training_wrapper_is_refused_with_the_model_to_pass(wrapper, dense):
    """A model inside DataParallel / DistributedDataParallel / a DeepSpeed engine (each keeps it as .module) is
    refused, saying to pass .module and to wrap the MoE again: unwrapping silently would hand a distributed script a
    bare MoE that trains without gradient sync. Before, "expected a loaded transformers model, not DataParallel"."""
    if wrapper == "DataParallel":
        wrapped = torch.nn.DataParallel(dense)
    else:
        wrapped = type("DeepSpeedEngine", (torch.nn.Module,), {})()
        wrapped.module = dense
    with pytest.raises(ConfigError) as info:
        upcycle_model(wrapped, num_experts=2)
    assert str(info.value) == (
        f"dense_model: a {wrapper} wrapper; pass the model it wraps (model.module, or accelerate's "
        f"accelerator.unwrap_model(model)), then wrap the returned MoE again and make the optimizer for its "
        f"parameters: the MoE's parameters are all new")


def test_unsupported_causal_lm_is_named_by_family():
    """A GPT-2 has an LM head: it is refused for its family, not called "not a causal language model"."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from moe_upcycle.errors import PlanError

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0))
    with pytest.raises(PlanError, match="model_type 'gpt2' is not supported as input; supported: LlamaForCausalLM"):
        upcycle_model(gpt2, num_experts=2)


# ---------------------------------------------------------------------------------------------
# upcycle_model: the caller's autograd state


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad, torch.enable_grad],
                         ids=["inference_mode", "no_grad", "enable_grad"])
def test_moe_is_trainable_whatever_the_callers_grad_mode(context, dense, stories):
    """Under torch.inference_mode the MoE's tensors were inference tensors: its first training step
    raised "Inference tensors cannot be saved for backward"."""
    before = snapshot(dense)
    with context():
        moe = upcycle_model(dense, num_experts=2, expert_init={"method": "noise", "scale": 0.01})
    assert not any(t.is_inference() for t in [*moe.parameters(), *moe.buffers()])
    assert all(p.requires_grad for p in moe.parameters()) and moe.training
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    out = moe(input_ids=ids, labels=ids)
    out.loss.backward()
    assert all(p.grad is not None for n, p in moe.named_parameters() if "experts" in n)
    assert_unchanged(dense, before)


def test_dense_with_hooks_grads_and_train_mode_is_left_as_it_was(stories):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float32).train()
    calls = []
    dense.model.layers[0].mlp.register_forward_hook(lambda *a: calls.append(1))
    dense(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()  # .grad set on every parameter
    dense.model.layers[1].requires_grad_(False)
    grads = {n: p.grad.clone() for n, p in dense.named_parameters() if p.grad is not None}
    before = snapshot(dense)
    moe = upcycle_model(dense, num_experts=2)
    assert_unchanged(dense, before)
    assert {n: p.grad for n, p in dense.named_parameters() if p.grad is not None}.keys() == grads.keys()
    assert all(torch.equal(p.grad, grads[n]) for n, p in dense.named_parameters() if p.grad is not None)
    assert not moe.model.layers[0].mlp._forward_hooks  # the dense model's hooks are not copied
    assert all(p.grad is None for p in moe.parameters())


# ---------------------------------------------------------------------------------------------
# upcycle_model: option spellings


@pytest.mark.parametrize("spelling", ["bfloat16", "bf16", "torch.bfloat16", torch.bfloat16])
def test_dtype_spellings(spelling, dense):
    moe = upcycle_model(dense, num_experts=2, dtype=spelling)
    assert {p.dtype for p in moe.parameters()} == {torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# verify and route: option values and files, refused before any model is loaded


@pytest.fixture(scope="module")
def moe_folder(stories, tmp_path_factory):
    from moe_upcycle import upcycle

    out = tmp_path_factory.mktemp("hostile") / "moe"
    upcycle({"base_model": str(stories), "num_experts": 2, "gate_mode": "random"}, out)
    return out


@pytest.fixture
def files(tmp_path):
    """Hostile inputs a user can pass where a file or folder is expected."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\n\t\n")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "prompts.txt").write_text("once upon a time\nthe dog ran\n")
    return tmp_path


VERIFY_CASES = [
    ("device-gpu", ["--device", "gpu"], ["--device 'gpu' is not a device", "auto, cpu, cuda or cuda:N"]),
    ("device-cuda-x", ["--device", "cuda:x"], ["--device 'cuda:x' is not a device"]),
    ("device-cuda-no-gpu", ["--device", "cuda"], ["--device 'cuda' asks for a GPU but torch sees no CUDA device",
                                                   "use --device cpu (or auto)"]),
    ("max-new-tokens-huge", ["--max-new-tokens", "100000"], ["max_new_tokens: 100000", "from 1 to 1024"]),
    ("text-empty", ["--text", "{tmp}/empty.txt"], ["--text:", "empty.txt holds no text"]),
    ("text-blank", ["--text", "{tmp}/blank.txt"], ["--text:", "blank.txt holds no text"]),
    ("text-dir", ["--text", "{tmp}/a_dir"], ["--text:", "a_dir: is a folder, not a file"]),
    ("text-binary", ["--text", "{tmp}/binary.txt"], ["--text:", "binary.txt: not UTF-8 text", "re-save it as UTF-8"]),
    ("text-latin1", ["--text", "{tmp}/latin1.txt"], ["--text:", "latin1.txt: not UTF-8 text (byte 0xe9", "re-save it as UTF-8"]),
    ("text-missing", ["--text", "{tmp}/nope.txt"], ["--text:", "nope.txt: file not found"]),
    ("prompts-empty", ["--prompts", "{tmp}/empty.txt"], ["--prompts:", "empty.txt holds no prompt"]),
    ("prompts-dir", ["--prompts", "{tmp}/a_dir"], ["--prompts:", "a_dir: is a folder, not a file"]),
    ("prompts-binary", ["--prompts", "{tmp}/binary.txt"], ["--prompts:", "binary.txt: not UTF-8 text"]),
    ("base-empty-dir", ["--base", "{tmp}/a_dir"], ["--base:", "a_dir is not a model folder (no config.json)"]),
    ("base-a-file", ["--base", "{tmp}/prompts.txt"], ["--base: model", "prompts.txt", "is a file, not a model folder"]),
    ("base-missing", ["--base", "{tmp}/nowhere"], ["--base: model", "nowhere", "not found"]),
]


@pytest.mark.parametrize("case_id,args,words", VERIFY_CASES, ids=[c[0] for c in VERIFY_CASES])
def test_verify_bad_option(case_id, args, words, moe_folder, files):
    code, output = cli("verify", moe_folder, *[a.replace("{tmp}", str(files)) for a in args])
    assert_clean_failure(code, output, files / "no-output", words)


@pytest.mark.parametrize("folder,words", [("nowhere", ["OUT:", "nowhere does not exist"]),
                                          ("a_dir", ["OUT:", "a_dir is not a model folder (no config.json)"]),
                                          ("prompts.txt", ["OUT:", "prompts.txt is not a model folder"])])
def test_verify_bad_folder(folder, words, files):
    code, output = cli("verify", files / folder)
    assert_clean_failure(code, output, files / "no-output", words)


@pytest.mark.parametrize("kwargs,words", [
    ({"max_new_tokens": 0}, ["max_new_tokens: 0 is not a number of tokens"]),
    ({"max_new_tokens": True}, ["max_new_tokens: True"]),
    ({"max_new_tokens": 2.5}, ["max_new_tokens: 2.5"]),
    ({"max_kl": float("nan")}, ["max_kl: nan is not a threshold"]),
    ({"max_kl": -1}, ["max_kl: -1 is not a threshold"]),
    ({"min_agreement": 1.5}, ["min_agreement: 1.5 is not a fraction"]),
    ({"min_agreement": float("nan")}, ["min_agreement: nan is not a fraction"]),
    ({"device": "gpu", "max_kl": -1}, ["device: 'gpu' is not a device", "max_kl: -1"]),  # all problems at once
])
def test_verify_library_options(kwargs, words, moe_folder):
    from moe_upcycle.check.verify import verify

    with pytest.raises(ConfigError) as info:
        verify(moe_folder, **kwargs)
    for word in words:
        assert word in str(info.value)


ROUTE_CASES = [
    ("device-gpu", ["--prompts", "{tmp}/prompts.txt", "--device", "gpu"], ["--device 'gpu' is not a device"]),
    ("device-cuda-no-gpu", ["--prompts", "{tmp}/prompts.txt", "--device", "cuda"], ["--device 'cuda' asks for a GPU",
                                                                                      "use --device cpu"]),
    ("prompts-empty", ["--prompts", "{tmp}/empty.txt"], ["empty.txt"]),
    ("prompts-dir", ["--prompts", "{tmp}/a_dir"], ["a_dir: is a folder, not a file"]),
    ("prompts-binary", ["--prompts", "{tmp}/binary.txt"], ["binary.txt"]),
    ("prompts-missing", ["--prompts", "{tmp}/nope.txt"], ["nope.txt: file not found"]),
    ("prompts-broken-link", ["--prompts", "{tmp}/dangling.txt"], ["dangling.txt: is a symbolic link that leads nowhere"]),
    ("labeled-missing", ["--labeled", "{tmp}/nope.txt"], ["--labeled", "nope.txt: file not found"]),
    ("labeled-broken-link", ["--labeled", "{tmp}/dangling.txt"], ["dangling.txt: is a symbolic link that leads nowhere"]),
    ("both-inputs", ["--prompts", "{tmp}/prompts.txt", "--labeled", "{tmp}/prompts.txt"], ["exactly one of"]),
    ("label-by-unknown", ["--prompts", "{tmp}/prompts.txt", "--label-by", "magic"], ["--label-by: 'magic'"]),
    ("labeled-empty", ["--labeled", "{tmp}/empty.txt"], ["--labeled", "empty.txt: holds no prompt"]),
    ("labeled-blank", ["--labeled", "{tmp}/blank.txt"], ["--labeled", "blank.txt: holds no prompt"]),
    ("labeled-folder", ["--labeled", "{tmp}/a_dir"], ["--labeled", "a_dir: is a folder, not a file"]),
    ("labeled-binary", ["--labeled", "{tmp}/binary.txt"], ["--labeled", "binary.txt", "UTF-8"]),
    ("plot-folder", ["--prompts", "{tmp}/prompts.txt", "--plot", "{tmp}/a_dir"], ["--plot", "a_dir: is a folder"]),
    ("plot-missing-folder", ["--prompts", "{tmp}/prompts.txt", "--plot", "{tmp}/no/x.png"],
     ["--plot", "folder", "does not exist"]),
    ("plot-unknown-format", ["--prompts", "{tmp}/prompts.txt", "--plot", "{tmp}/x.xyz"], [".xyz is not an image format"]),
    ("plot-no-suffix", ["--prompts", "{tmp}/prompts.txt", "--plot", "{tmp}/heatmap"], ["the name has no suffix"]),
    ("plot-dash", ["--prompts", "{tmp}/prompts.txt", "--plot", "-"], ["--plot -: the heatmap is written to an image "
                                                                      "file, not to standard output"]),
]


@pytest.mark.parametrize("case_id,args,words", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_route_bad_option(case_id, args, words, moe_folder, files, monkeypatch):
    if case_id.startswith("plot"):
        pytest.importorskip("matplotlib")
    if "broken-link" in case_id:
        (files / "dangling.txt").symlink_to(files / "gone.txt")
    import moe_upcycle.check.route as route_module

    def no_route(*args, **kwargs):
        raise AssertionError("the MoE ran before the options were checked")

    monkeypatch.setattr(route_module, "route", no_route)
    before = sorted(p.name for p in files.rglob("*"))
    code, output = cli("route", moe_folder, *[a.replace("{tmp}", str(files)) for a in args])
    assert_clean_failure(code, output, files / "no-output", words)
    assert sorted(p.name for p in files.rglob("*")) == before  # no image written (matplotlib adds .png to a folder)


@pytest.mark.parametrize("folder,words", [("nowhere", ["OUT:", "nowhere does not exist"]),
                                          ("a_dir", ["OUT:", "a_dir is not a model folder (no config.json)"]),
                                          ("prompts.txt", ["OUT:", "prompts.txt is not a model folder"])])
def test_route_bad_folder(folder, words, files):
    code, output = cli("route", files / folder, "--prompts", files / "prompts.txt")
    assert_clean_failure(code, output, files / "no-output", words)
    assert "huggingface.co" not in output  # was: transformers' "couldn't connect" for a local path


def test_route_library_no_prompts(moe_folder):
    from moe_upcycle.check.route import route

    with pytest.raises(ConfigError, match="prompts: there is no prompt to route"):
        route(moe_folder, [])


# ---------------------------------------------------------------------------------------------
# build and plan: files where a config is expected, and option values (named as options, not as
# keys of a file that does not hold them)

RANDOM = "base_model: {base}\nnum_experts: 2\ngate_mode: random\n"
HIDDEN = ("base_model: {base}\ngate_mode: hidden\nexperts:\n  - source_model: {base}\n    positive_prompts: [once]\n"
          "  - source_model: {base}\n    positive_prompts: [the dog]\n")

BUILD_OPTION_CASES = [
    ("shard-zero", RANDOM, ["--max-shard-size", "0"], ["option max_shard_size (--max-shard-size): must be positive"]),
    ("shard-negative-unit", RANDOM, ["--max-shard-size", "-1GB"], ["option max_shard_size (--max-shard-size): '-1GB' is not a size"]),
    ("shard-unknown-unit", RANDOM, ["--max-shard-size", "1XB"], ["option max_shard_size (--max-shard-size): '1XB' is not a size"]),
    ("shard-bare-fraction", RANDOM, ["--max-shard-size", "1.5"], ["option max_shard_size (--max-shard-size): '1.5' is not a whole"]),
    ("shard-one-byte", RANDOM, ["--max-shard-size", "1B"],  # B is bytes: 1GB was meant (before: "e.g. 1BGB")
     ["option max_shard_size (--max-shard-size): '1B' is 1 bytes, smaller than any weight matrix", "e.g. 1GB"]),
    ("batch-zero", HIDDEN, ["--batch-size", "0"], ["option batch_size (--batch-size): 0 is too small; write at least 1"]),
    ("batch-negative", HIDDEN, ["--batch-size", "-3"], ["option batch_size (--batch-size):"]),
    ("batch-huge", HIDDEN, ["--batch-size", "10000000"], ["option batch_size (--batch-size): 10000000 is too large; write at most"]),
    ("device-gpu", HIDDEN, ["--device", "gpu"], ["--device 'gpu' is not a device"]),
    ("device-cuda-x", RANDOM, ["--device", "cuda:x"], ["--device 'cuda:x' is not a device"]),
    ("device-gpu-dry-run", RANDOM, ["--device", "gpu", "--dry-run"], ["--device 'gpu' is not a device"]),
    # the option is named as the option (was: "device: 'cuda' ... use device: cpu", a key the file may not hold)
    ("device-cuda-no-gpu-hidden", HIDDEN, ["--device", "cuda"],
     ["--device 'cuda' asks for a GPU but torch sees no CUDA", "use --device cpu (or auto)"]),
    ("device-cuda-no-gpu-verify", RANDOM, ["--device", "cuda", "--verify"], ["--device 'cuda' asks for a GPU"]),
    # asked for on the command line, a missing GPU is refused whatever the gate mode, as verify and route do
    ("device-cuda-no-gpu-random", RANDOM, ["--device", "cuda"], ["--device 'cuda' asks for a GPU"]),
    ("recipe-device-cuda-no-gpu", HIDDEN + "device: cuda:1\n", [], ["device: 'cuda:1' asks for a GPU"]),
]


@pytest.mark.parametrize("case_id,text,args,words", BUILD_OPTION_CASES, ids=[c[0] for c in BUILD_OPTION_CASES])
def test_build_bad_option_named_as_option(case_id, text, args, words, stories, tmp_path):
    if torch.cuda.is_available() and "asks for a GPU" in words[0]:
        pytest.skip("a GPU is visible")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text.format(base=stories))
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target, *args)
    assert_clean_failure(code, output, target, words)
    assert "cfg.yaml: max_shard_size" not in output and "cfg.yaml: batch_size" not in output
    if "--device" in args:
        assert "device:" not in output  # the recipe holds no device: key
    assert "prompt lint" not in output  # refused before the (slow) lint of the prompts


@pytest.mark.parametrize("args,words", [
    (["{tmp}/a", "-o", "{tmp}/b"], ["OUT is", "and -o/--output is", "give the output folder once"]),
    (["{tmp}/a", "--dry-run", "--verify"], ["--dry-run writes nothing", "--verify"]),
], ids=["out-twice", "dry-run-verify"])
def test_build_conflicting_options(args, words, stories, tmp_path):
    """`build CFG A -o B` built into A and ignored B; `--dry-run --verify` ignored --verify."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(RANDOM.format(base=stories))
    code, output = cli("build", cfg, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert_clean_failure(code, output, tmp_path / "a", words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]


def test_unused_device_does_not_stop_a_random_gate_build(stories, tmp_path):
    """device: is for hidden-state gates; a recipe written on a GPU machine builds on a CPU one."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(RANDOM.format(base=stories) + "device: cuda\n")
    code, output = cli("build", cfg, tmp_path / "moe")
    assert code == 0, output
    assert (tmp_path / "moe" / "config.json").is_file()


@pytest.mark.parametrize("command", ["build", "plan"])
@pytest.mark.parametrize("case_id,make,words", [
    ("folder", lambda p: p.mkdir(), ["is a folder, not a config file"]),
    ("missing", lambda p: None, ["config file not found"]),
    ("empty", lambda p: p.write_text(""), ["must be a YAML mapping", "it is empty (or holds only comments or null)"]),
    ("null", lambda p: p.write_text("null\n"), ["must be a YAML mapping", "it is empty"]),
    ("scalar", lambda p: p.write_text("42\n"), ["must be a YAML mapping", "got a single value, 42"]),
    ("list", lambda p: p.write_text("- base_model: x\n"), ["must be a YAML mapping", "got a list"]),
    ("binary", lambda p: p.write_bytes(bytes(range(256))), ["not a readable YAML file"]),
    ("device", None, ["/dev/zero: is not a regular file"]),
], ids=["folder", "missing", "empty", "null", "scalar", "list", "binary", "device"])
def test_config_path_not_a_recipe(command, case_id, make, words, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    if make is None:
        cfg = Path("/dev/zero")
        if not cfg.exists():
            pytest.skip("no /dev/zero")
    else:
        make(cfg)
    args = [command, cfg] + ([tmp_path / "moe"] if command == "build" else [])
    code, output = cli(*args)
    assert_clean_failure(code, output, tmp_path / "moe", [cfg.name, *words])


@pytest.mark.parametrize("option", ["--prompts", "--labeled"])
def test_route_reads_prompts_from_a_pipe(option, moe_folder):
    """`route OUT --prompts <(grep ... all.txt)` reads the pipe the shell names (/dev/fd/N); before, --labeled
    called it "file not found"."""
    import os

    read, write = os.pipe()
    os.write(write, ("expert_0\tonce upon a time there was a cat\nexpert_1\tthe dog ran home\n" if option == "--labeled"
                     else "once upon a time there was a cat\nthe dog ran home\n").encode())
    os.close(write)
    try:
        code, output = cli("route", moe_folder, option, f"/dev/fd/{read}")
    finally:
        os.close(read)
    text = " ".join(output.split())
    assert code == 0 and "Traceback" not in text, text
    assert "once upon a time" in text and "the dog ran" in text, text


# ---------------------------------------------------------------------------------------------
# prompts grow: the pool file, the limits and -o, all refused before the embedder loads

PROMPTED = ("base_model: {base}\ngate_mode: hidden\nexperts:\n  - source_model: {base}\n    name: stories\n"
            "    positive_prompts: [once upon a time]\n  - source_model: {base}\n    name: maths\n"
            "    positive_prompts: [adding two numbers]\n")

GROW_CASES = [
    ("pool-folder", ["--pool", "{tmp}/a_dir"], ["--pool", "a_dir: is a folder, not a file"]),
    ("pool-missing", ["--pool", "{tmp}/nope.txt"], ["--pool", "nope.txt: file not found"]),
    ("pool-empty", ["--pool", "{tmp}/empty.txt"], ["--pool", "empty.txt: holds no prompt"]),
    ("pool-blank", ["--pool", "{tmp}/blank.txt"], ["--pool", "blank.txt: holds no prompt"]),
    ("pool-binary", ["--pool", "{tmp}/binary.txt"], ["--pool", "binary.txt: not UTF-8 text", "re-save it as UTF-8"]),
    ("pool-latin1", ["--pool", "{tmp}/latin1.txt"], ["--pool", "latin1.txt: not UTF-8 text (byte 0xe9", "re-save it as UTF-8"]),
    ("margin-nan", ["--pool", "{tmp}/prompts.txt", "--margin", "nan"], ["--margin: nan is not a lead", "0 to 2"]),
    ("margin-negative", ["--pool", "{tmp}/prompts.txt", "--margin", "-3"], ["--margin: -3.0"]),
    ("margin-huge", ["--pool", "{tmp}/prompts.txt", "--margin", "5"], ["--margin: 5.0"]),
    ("min-similarity-huge", ["--pool", "{tmp}/prompts.txt", "--min-similarity", "5"],
     ["--min-similarity: 5.0 is not a cosine similarity", "-1 to 1"]),
    ("min-similarity-inf", ["--pool", "{tmp}/prompts.txt", "--min-similarity", "-inf"], ["--min-similarity: -inf"]),
    ("output-folder-forced", ["--pool", "{tmp}/prompts.txt", "-o", "{tmp}/a_dir", "--force"],
     ["-o", "a_dir: is a folder; give the path of the YAML file"]),
    ("output-in-missing-folder", ["--pool", "{tmp}/prompts.txt", "-o", "{tmp}/no/such.yaml"], ["does not exist"]),
    ("pool-format-unknown", ["--pool", "{tmp}/prompts.txt", "--pool-format", "xml"], ["--pool-format: 'xml'"]),
]


@pytest.mark.parametrize("case_id,args,words", GROW_CASES, ids=[c[0] for c in GROW_CASES])
def test_grow_bad_input(case_id, args, words, stories, files):
    cfg = files / "cfg.yaml"
    cfg.write_text(PROMPTED.format(base=stories))
    before = sorted(p.name for p in files.rglob("*"))
    code, output = cli("prompts", "grow", cfg, *[a.replace("{tmp}", str(files)) for a in args])
    assert_clean_failure(code, output, files / "cfg.grown.yaml", words)
    assert sorted(p.name for p in files.rglob("*")) == before  # no grown YAML, no .tmp left
    assert (files / "a_dir").is_dir() and not any((files / "a_dir").iterdir())
    assert "load embedder" not in output


@pytest.mark.parametrize("recipe", ["num_experts: 4\ngate_mode: random\n",
                                    "gate_mode: random\nexperts:\n  - source_model: {base}\n  - source_model: {base}\n"])
def test_grow_without_prompts_is_refused_before_the_embedder(recipe, stories, files):
    """Nothing to grow from (copies, or experts without prompts): refused at once, not after loading the sentence
    embedder (seconds)."""
    cfg = files / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\n" + recipe.format(base=stories))
    code, output = cli("prompts", "grow", cfg, "--pool", files / "prompts.txt")
    assert_clean_failure(code, output, files / "cfg.grown.yaml",
                         ["experts: no expert has positive_prompts, so there is nothing to grow from"])
    assert "load embedder" not in output


@pytest.mark.parametrize("kwargs,words", [
    ({"per_expert": 0}, ["--per-expert: 0 is not a count"]),
    ({"per_expert": 2.5}, ["--per-expert: 2.5"]),
    ({"margin": float("nan"), "min_similarity": 2}, ["--margin: nan", "--min-similarity: 2"]),
])
def test_grow_library_limits(kwargs, words):
    from moe_upcycle.prompts.grow import grow_prompts

    with pytest.raises(ConfigError) as info:
        grow_prompts([], ["a prompt"], object(), **kwargs)  # refused before the experts or the embedder are used
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------------------------------------
# upcycle(): argument types, each refused by name with nothing written


@pytest.mark.parametrize("case_id,make_args,kwargs,words", [
    ("config-int", lambda g, p: (5,), {}, ["config: expected the path of a YAML recipe", "not int"]),
    ("config-none", lambda g, p: (None,), {}, ["config: expected", "not NoneType"]),
    ("config-list", lambda g, p: ([g],), {}, ["config: expected", "not list"]),
    ("config-bytes", lambda g, p: (b"cfg.yaml",), {}, ["config: expected", "not bytes"]),
    ("config-yaml-text", lambda g, p: ("base_model: x\nnum_experts: 2\n",), {}, ["config: got YAML text, not a file path"]),
    ("config-folder", lambda g, p: (p,), {}, ["is a folder, not a config file"]),
    ("config-missing", lambda g, p: (p / "nope.yaml",), {}, ["nope.yaml: config file not found"]),
    ("key-not-a-string", lambda g, p: ({**g, 5: 1},), {}, ["config: key 5 (YAML reads it as a number) is not a name"]),
    ("output-int", lambda g, p: (g, 5), {}, ["output: expected a folder path, not int"]),
    ("force-string", lambda g, p: (g,), {"force": "yes"}, ["force: expected True or False, got 'yes'"]),
    ("dry-run-string", lambda g, p: (g,), {"dry_run": "no"}, ["dry_run: expected True or False, got 'no'"]),
    ("verify-string", lambda g, p: (g,), {"verify": "no"}, ["verify: expected True or False"]),
    ("on-step-not-callable", lambda g, p: (g,), {"on_step": 5}, ["on_step: expected a function"]),
    ("dry-run-and-verify", lambda g, p: (g,), {"dry_run": True, "verify": True}, ["verify: a dry run writes nothing"]),
    ("tensor-policy", lambda g, p: (g,), {"tensor_policy": "bogus"}, ["option tensor_policy (--clone-tensors/--share-tensors): 'bogus' is not allowed"]),
    ("shard-bool", lambda g, p: (g,), {"max_shard_size": True}, ["option max_shard_size"]),
    ("device-int", lambda g, p: (g,), {"device": 5}, ["option device"]),
    ("checksums-string", lambda g, p: (g,), {"checksums": "no"}, ["option checksums (--checksums): 'no' is not a boolean"]),
])
def test_upcycle_argument_types(case_id, make_args, kwargs, words, stories, tmp_path):
    from moe_upcycle import upcycle

    good = {"base_model": str(stories), "num_experts": 2, "gate_mode": "random"}
    args = make_args(good, tmp_path)
    if len(args) == 1:
        args = (*args, tmp_path / "moe")
    with pytest.raises(ConfigError) as info:
        upcycle(*args, **kwargs)
    for word in words:
        assert word in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, lock or staging folder


# ---------------------------------------------------------------------------------------------
# A valid key in the wrong section says where it belongs (it was "unknown key ... valid keys: ...")

WRONG_SECTION = [
    ("prompts-at-top", RANDOM + "positive_prompts: [a]\n", ["positive_prompts: unknown key — it belongs in experts[i]"]),
    ("source-model-at-top", RANDOM + "source_model: x\n", ["source_model: unknown key — it belongs in experts[i]"]),
    ("ratio-at-top", RANDOM + "ratio: 0.5\n", ["ratio: unknown key — it belongs in expert_init; move it there"]),
    ("granularity-at-top", RANDOM + "granularity: 2\n", ["granularity: unknown key — it belongs in expert_init"]),
    ("gate-mode-in-expert", "base_model: {base}\nexperts:\n  - source_model: {base}\n    gate_mode: random\n"
     "  - source_model: {base}\n", ["experts[0].gate_mode: unknown key — it belongs at the top level"]),
    ("ratio-in-expert", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n    ratio: 0.5\n"
     "  - source_model: {base}\n", ["experts[0].ratio: unknown key — it belongs in experts[i].expert_init"]),
    ("seed-in-expert-init", RANDOM + "expert_init:\n  method: drop\n  ratio: 0.5\n  seed: 3\n",
     ["expert_init.seed: unknown key — it belongs at the top level"]),
]


@pytest.mark.parametrize("case_id,text,words", WRONG_SECTION + [
    ("key-true", RANDOM + "on: 3\n", ["cfg.yaml: key true (YAML reads yes/no/on/off/true/false as a boolean) is not a name"]),
    ("key-null", RANDOM + "null: 3\n", ["cfg.yaml: key null", "is not a name"]),
    ("key-number-nested", RANDOM.replace("num_experts: 2\n", "") + "experts:\n  - {{source_model: x, 2.5: 2}}\n",
     ["cfg.yaml: experts[0]: key 2.5 (YAML reads it as a number) is not a name"]),
], ids=[c[0] for c in WRONG_SECTION] + ["key-true", "key-null", "key-number-nested"])
def test_key_in_wrong_section_says_where_it_belongs(case_id, text, words, stories, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text.format(base=stories))
    code, output = cli("build", cfg, tmp_path / "moe", "--no-lint")
    assert_clean_failure(code, output, tmp_path / "moe", words)
    if case_id.startswith("key-"):
        return  # not a key name at all: refused with --allow-unknown-keys too
    code, output = cli("build", cfg, tmp_path / "moe", "--no-lint", "--allow-unknown-keys")
    flat = " ".join(output.split())
    assert "unknown key ignored" in flat and f"belongs {words[0].split('belongs ')[1].split(';')[0]}" in flat


# ---------------------------------------------------------------------------------------------
# Files a recipe names (prompt files, calibration text): named with their field, before any model loads


@pytest.mark.parametrize("name,words", [
    ("a_dir", ["experts[0].positive_prompts_from:", "a_dir' is a folder"]),
    ("binary.txt", ["experts[0].positive_prompts_from:", "binary.txt: not UTF-8 text", "re-save it as UTF-8"]),
    ("empty.txt", ["experts[0].positive_prompts_from:", "empty.txt: contains no prompts"]),
    ("null.yaml", ["experts[0].positive_prompts_from:", "null.yaml: expected a list of prompt strings"]),
], ids=["folder", "binary", "empty", "yaml-null"])
def test_prompt_file_named_with_its_field(name, words, stories, files):
    (files / "null.yaml").write_text("null\n")
    cfg = files / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: hidden\nexperts:\n  - source_model: {stories}\n"
                   f"    positive_prompts_from: {files / name}\n  - source_model: {stories}\n    positive_prompts: [a]\n")
    code, output = cli("build", cfg, files / "moe", "--no-lint")
    assert_clean_failure(code, output, files / "moe", words)


@pytest.mark.parametrize("name,words", [
    ("a_dir", ["calibration_text: folder", "has no .txt, .md or .jsonl files"]),
    ("binary.txt", ["calibration_text:", "binary.txt: not UTF-8 text", "re-save it as UTF-8"]),
    ("empty.txt", ["calibration_text:", "empty.txt contains no text"]),
    ("nope.txt", ["calibration_text:", "nope.txt does not exist"]),
    ("/dev/zero", ["calibration_text: /dev/zero is not a regular file"]),
], ids=["folder", "binary", "empty", "missing", "device"])
@pytest.mark.parametrize("command", ["build", "plan"])
def test_calibration_text_refused_before_the_base_loads(command, name, words, stories, files, monkeypatch):
    import moe_upcycle.gates.hidden_gates as hidden_gates

    def no_load(*args, **kwargs):
        raise AssertionError("the base model was loaded before the calibration text was checked")

    monkeypatch.setattr(hidden_gates, "open_streamed", no_load)
    cfg = files / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: kmeans\nnum_experts: 2\ncalibration_text: {files / name}\n")
    code, output = cli(command, cfg, *([files / "moe"] if command == "build" else []))
    assert_clean_failure(code, output, files / "moe", words)


# ---------------------------------------------------------------------------------------------
# Scales that overflow: they built checkpoints of Inf routers or experts with exit 0


@pytest.mark.parametrize("case_id,extra,words", [
    ("router-std-overflows-fp32", "router_init_std: 1.0e+39\n", ["router_init_std: 1e+39 is too large; write at most 100"]),
    ("router-std-huge", "router_init_std: 1000\n", ["router_init_std:", "100"]),
    ("noise-overflows-fp32", "expert_init: {{method: noise, scale: 1.0e+30}}\n", ["expert_init.scale:", "1e+30 is too large; write at most 10"]),
    ("noise-overflows-fp16", "dtype: float16\nexpert_init: {{method: noise, scale: 1.0e+6}}\n", ["expert_init.scale:"]),
    ("absolute-noise", "expert_init: {{method: noise, scale: 50, absolute: true}}\n", ["expert_init.scale:"]),
    ("gate-scale-huge", "gate_scale: 1.0e+39\n", ["gate_scale: 1e+39 is too large; write at most 100"]),
], ids=["router-std-overflows-fp32", "router-std-huge", "noise-overflows-fp32", "noise-overflows-fp16",
        "absolute-noise", "gate-scale-huge"])
def test_overflowing_scale_refused(case_id, extra, words, stories, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text((RANDOM + extra).format(base=stories))
    code, output = cli("build", cfg, tmp_path / "moe", "--no-lint")
    assert_clean_failure(code, output, tmp_path / "moe", words)


def test_per_expert_scales_bounded(stories, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: random\nexperts:\n  - source_model: {stories}\n"
                   f"    noise_scale: 100.0\n    residual_scale: -1.0e+9\n  - source_model: {stories}\n")
    code, output = cli("build", cfg, tmp_path / "moe", "--no-lint")
    assert_clean_failure(code, output, tmp_path / "moe", ["experts[0].noise_scale: 100.0 is too large; write at most 10",
                                                         "experts[0].residual_scale: -1000000000.0 is too small; write at least -100"])


@pytest.mark.parametrize("kwargs,words", [
    ({"router_init_std": 1e39}, ["router_init_std: 1e+39 is too large; write at most 100"]),
    ({"dtype": "float16", "expert_init": {"method": "noise", "scale": 1e6}}, ["expert_init.scale"]),
])
def test_in_memory_overflowing_scale_refused(kwargs, words, dense):
    with pytest.raises(ConfigError) as info:
        upcycle_model(dense, num_experts=2, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_largest_allowed_scales_stay_finite(dense):
    moe = upcycle_model(dense, num_experts=2, dtype="float16", router_init_std=100.0,
                        expert_init={"method": "noise", "scale": 10.0})
    assert all(bool(torch.isfinite(p).all()) for p in moe.parameters())


# ---------------------------------------------------------------------------------------------
# Paths, names and prompts that look like rich markup are printed as written (a "[/]" in an
# output path was a MarkupError traceback after a successful build; "[bold]" vanished)


def test_markup_in_paths_names_and_prompts_is_printed_literally(stories, tmp_path):
    cfg = tmp_path / "c[bold]fg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: random\nexperts:\n  - source_model: {stories}\n"
                   f"    name: '[/]a'\n  - source_model: {stories}\n    name: '[red]b'\n")
    (tmp_path / "o[").mkdir()
    target = tmp_path / "o[" / "]x[bold]"  # "o[/]x[bold]" on screen
    code, output = cli("plan", cfg, "-o", target)
    flat = " ".join(output.split())
    assert code == 0 and "Traceback" not in output and "[/]a" in flat and "[red]b" in flat, output
    code, output = cli("build", cfg, target, "--no-lint")
    assert code == 0 and f"Built {target}" in " ".join(output.split()), output
    prompts = tmp_path / "p.txt"
    prompts.write_text("[/] closing tag\n[bold]x\n")
    code, output = cli("route", target, "--prompts", prompts)
    assert code == 0 and "[/] closing tag" in output and "[bold]x" in output and "[/]a" in output, output
    code, output = cli("verify", target, "--prompts", prompts, "--max-new-tokens", "1")
    assert code == 0 and "Traceback" not in output and "[/] closing tag" in output, output


def test_control_characters_in_names_are_shown_not_sent(tiny_llama, tmp_path):
    """A checkpoint names its own tensors: an escape sequence in a name would clear the screen or recolour what
    follows, a newline fake a line of the tool's output. Names are shown the way Python writes them."""
    import shutil

    from safetensors.torch import load_file, save_file

    def with_tensor(folder: Path, name: str) -> Path:
        shutil.copytree(tiny_llama, folder)
        state = load_file(str(folder / "model.safetensors"))
        save_file({**state, name: torch.zeros(3)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    def recipe(base: Path) -> Path:
        cfg = tmp_path / f"{base.name}.yaml"
        cfg.write_text(f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n")
        return cfg

    outside = with_tensor(tmp_path / "outside", "\x1b[2J\x1b[32mplan ok\nfake line")  # noted, not copied
    code, output = cli("build", recipe(outside), tmp_path / "moe")
    assert code == 0 and "\x1b" not in output and "fake line\n" not in output, output
    assert "are not copied: '\\x1b[2J\\x1b[32mplan ok\\nfake line'" in " ".join(output.split()), output
    inside = with_tensor(tmp_path / "inside", "model.layers.0.self_attn.\x1b[31mX\r.weight")  # refused
    code, output = cli("plan", recipe(inside))
    assert code == 1 and "\x1b" not in output and "\r" not in output, output
    assert "the base has the tensor ('self_attn.\\x1b[31mX\\r.weight')" in " ".join(output.split()), output
    prompts = tmp_path / "p.txt"  # and text the user gives, echoed back
    prompts.write_text("bell\x07 and \x1b[2J clear\n")
    code, output = cli("route", tmp_path / "moe", "--prompts", prompts)
    assert code == 0 and "\x1b" not in output and "\x07" not in output and "\\x1b[2J clear" in output, output


# ---------------------------------------------------------------------------------------------
# Endless or huge text inputs are refused after 64 MiB, not read until memory runs out


@pytest.mark.parametrize("source", ["sparse-65MiB", "dev-zero"])
@pytest.mark.parametrize("command,option,words", [
    ("verify", "--text", ["--text", "more than 64 MiB"]),
    ("verify", "--prompts", ["--prompts", "more than 64 MiB"]),
    ("route", "--prompts", ["prompt file", "more than 64 MiB"]),
])
def test_endless_text_input_refused(source, command, option, words, moe_folder, tmp_path):
    if source == "dev-zero":
        if not Path("/dev/zero").exists():
            pytest.skip("no /dev/zero")
        path = Path("/dev/zero")
    else:
        path = tmp_path / "huge.txt"
        with open(path, "wb") as f:
            f.truncate(65 * 2**20)  # sparse: no disk used
    code, output = cli(command, moe_folder, option, path)
    assert_clean_failure(code, output, tmp_path / "no-output", words)


def test_huge_pool_refused(stories, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(PROMPTED.format(base=stories))
    pool = tmp_path / "pool.txt"
    with open(pool, "wb") as f:
        f.truncate(65 * 2**20)
    code, output = cli("prompts", "grow", cfg, "--pool", pool)
    assert_clean_failure(code, output, tmp_path / "cfg.grown.yaml", ["--pool", "more than 64 MiB"])


# ---------------------------------------------------------------------------------------------
# lint and prompts grow take --allow-unknown-keys, which their error told users to pass


@pytest.mark.parametrize("command", [["lint"], ["prompts", "grow"]])
def test_unknown_key_error_names_an_option_the_command_has(command, stories, files):
    cfg = files / "cfg.yaml"
    cfg.write_text(PROMPTED.format(base=stories) + "tokenizer_source: union\n")
    extra = ["--pool", files / "prompts.txt"] if command[0] == "prompts" else []
    code, output = cli(*command, cfg, *extra)
    assert_clean_failure(code, output, files / "cfg.grown.yaml", ["tokenizer_source: unknown key",
                                                                 "pass --allow-unknown-keys"])
    code, output = cli(*command, "--help")
    assert "--allow-unknown-keys" in output


def test_grow_keeps_a_mergekit_config_with_unknown_keys(stories, files):
    cfg = files / "cfg.yaml"
    cfg.write_text(PROMPTED.format(base=stories) + "tokenizer_source: union\n")
    code, output = cli("prompts", "grow", cfg, "--pool", files / "prompts.txt", "--allow-unknown-keys")
    assert code == 0, output
    assert "tokenizer_source: unknown key ignored" in " ".join(output.split())
    assert "tokenizer_source: union" in (files / "cfg.grown.yaml").read_text()


DEEP = '{"a":' * 100000 + "1" + "}" * 100000  # JSON nested past Python's recursion limit


@pytest.mark.parametrize("case", ["pool-json", "pool-jsonl", "labeled", "calibration", "prompt-file", "adapter-config",
                                  "adapter-folder-as-model"])
def test_json_nested_too_deeply_is_named_not_a_traceback(case, tiny_llama, tmp_path):
    """json raises RecursionError, not a JSONDecodeError, for such a file: it reached the user as a traceback."""
    from moe_upcycle import upcycle
    from moe_upcycle.check.route_eval import read_labeled
    from moe_upcycle.errors import UpcycleError
    from moe_upcycle.prompts.pool import read_pool_file
    from moe_upcycle.recipe.calibration import read_documents
    from moe_upcycle.recipe.schema import load_config

    deep = tmp_path / ("deep.json" if case == "pool-json" else "deep.jsonl")
    deep.write_text(("[" * 100000 + "]" * 100000) if case == "pool-json" else DEEP + "\n")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(DEEP)
    experts = [{"source_model": str(tiny_llama), "positive_prompts": ["x"]}] * 2
    calls = {
        "pool-json": lambda: read_pool_file(deep),
        "pool-jsonl": lambda: read_pool_file(deep),
        "labeled": lambda: read_labeled(deep),
        "calibration": lambda: read_documents(deep),
        "prompt-file": lambda: load_config({"base_model": str(tiny_llama), "gate_mode": "hidden", "experts": [
            {"source_model": str(tiny_llama), "positive_prompts_from": str(deep)}, experts[1]]}).expert_list()[0]
            .with_prompt_sets("experts[0]"),
        "adapter-config": lambda: upcycle({"base_model": str(tiny_llama), "gate_mode": "random", "experts": [
            {"source_model": f"{tiny_llama}+{adapter}"}, {"source_model": str(tiny_llama)}]}, dry_run=True),
        "adapter-folder-as-model": lambda: upcycle({"base_model": str(adapter), "num_experts": 2,
                                                    "gate_mode": "random"}, dry_run=True),
    }
    with pytest.raises(UpcycleError) as info:
        calls[case]()
    text = str(info.value)
    assert ("nested too deeply" in text or "maximum recursion depth" in text or "PEFT adapter" in text), text


LONG = "n" * 300  # past the 255 bytes a file name may have on common file systems


@pytest.mark.parametrize("args", [
    ["build", "{cfg}", LONG], ["plan", "{cfg}", "-o", LONG], ["build", "{cfg}", "a/" * 2100 + "moe"],
    ["prompts", "grow", "{cfg}", "--pool", "{pool}", "-o", LONG + ".yaml"], ["demo", LONG], ["verify", LONG],
    ["route", "{moe}", "--prompts", LONG + ".txt"], ["route", "{moe}", "--prompts", "{pool}", "--plot", LONG + ".png"],
])
def test_a_name_too_long_for_the_file_system_is_named(args, tiny_llama, tmp_path, monkeypatch):
    """Each was a traceback ending in OSError: [Errno 36] File name too long."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\ngate_mode: hidden\nexperts:\n  - source_model: {tiny_llama}\n"
                   f"    positive_prompts: [code]\n  - source_model: {tiny_llama}\n    positive_prompts: [story]\n")
    pool = tmp_path / "pool.txt"
    pool.write_text("Write a function\nTell a story\n")
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text('{"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 1}')
    before = sorted(p.name for p in tmp_path.iterdir())
    code, output = cli(*[a.format(cfg=cfg, pool=pool, moe=moe) for a in args])
    text = " ".join(output.split())
    assert code == 1 and "Traceback" not in text, text
    assert ("the name is too long for the file system" in text or "and this file system allows 255 per name" in text
            or "and this file system allows 4096" in text), text
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_float64_dense_model_is_refused_with_the_fix_and_converts_when_asked(stories):
    """upcycle_model on a float64 model was a KeyError traceback (no MoE dtype takes float64)."""
    from transformers import AutoModelForCausalLM

    dense64 = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float64)
    with pytest.raises(ConfigError, match=r'dense_model: its parameters are float64, which upcycle_model does not '
                                          r'make; pass dtype="float32"'):
        upcycle_model(dense64, num_experts=2)
    moe = upcycle_model(dense64, num_experts=2, dtype="float32")
    assert {p.dtype for p in moe.parameters()} == {torch.float32}
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        assert (moe(ids).logits.double() - dense64(ids).logits).abs().max().item() < 1e-4


def test_a_dense_model_of_mixed_dtypes_gets_its_main_dtype_and_a_warning(stories):
    """Norms kept in float32 beside bfloat16 weights (peft's prepare_model_for_kbit_training does it): before, the
    first parameter's dtype decided, silently."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle.errors import UpcycleWarning

    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.bfloat16)
    for name, param in dense.named_parameters():
        if "norm" in name:
            param.data = param.data.float()
    with pytest.warns(UpcycleWarning, match=r"dense_model holds parameters of several dtypes: most are bfloat16, some "
                                            r"float32 \(e\.g\. model\.layers\.0\.input_layernorm\.weight\); the MoE is "
                                            r"bfloat16 throughout — pass dtype= to choose"):
        moe = upcycle_model(dense, num_experts=2)
    assert {p.dtype for p in moe.parameters()} == {torch.bfloat16}
    moe32 = upcycle_model(dense, num_experts=2, dtype="float32")  # chosen: no warning needed
    assert {p.dtype for p in moe32.parameters()} == {torch.float32}


def test_float64_base_checkpoint_asks_for_a_dtype(stories, tmp_path):
    """A base saved in float64 made plan and build crash (KeyError: torch.float64) instead of asking for dtype:."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle import upcycle
    from moe_upcycle.errors import PlanError

    base = tmp_path / "base64"
    AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float64).save_pretrained(str(base))
    recipe = {"base_model": str(base), "num_experts": 2, "gate_mode": "random"}
    with pytest.raises(PlanError, match="base_model: the base is float64, which moe-upcycle does not write .* e.g. "
                                        "dtype: float32"):
        upcycle(recipe, tmp_path / "moe")
    assert not (tmp_path / "moe").exists()
    assert upcycle({**recipe, "dtype": "float32"}, tmp_path / "moe").plan.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Paths no one types on purpose (found by a hostile-YAML hunt): the ~ of a user who does not exist (the shell
# leaves it as written) and a NUL were tracebacks; an output name with pasted or blank characters was made as is


@pytest.mark.parametrize("where", ["argument", "yaml"])
@pytest.mark.parametrize("name,words", [
    ("~no-such-user-moe", ["the folder name '~no-such-user-moe'", "who does not exist here",
                           "write ~/no-such-user-moe"]),
    ("o3 ", ["the folder name 'o3 '", "spaces at its start or end"]),
    (" o3", ["the folder name ' o3'", "spaces at its start or end"]),
    ("o3\t", ["the folder name 'o3\\t'", "spaces at its start or end"]),
    ("o3\u200b", ["U+200B zero-width space", "delete it: o3"]),
    ("\u201co3\u201d", ["wrapped in curly quotes", "'o3'"]),
])
def test_output_names_no_one_types_on_purpose_are_refused(where, name, words, stories, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    out_line = f"output: {json.dumps(name)}\n" if where == "yaml" else ""
    cfg.write_text(f"base_model: {stories}\nnum_experts: 2\ngate_mode: random\n{out_line}")
    code, output = cli("build", cfg, *([name] if where == "argument" else []))
    assert_clean_failure(code, output, tmp_path / name, ["output error:", *words])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]  # nothing made


@pytest.mark.parametrize("field,value,words", [
    ("base_model", "~no-such-user-moe/base", ["base_model: model '~no-such-user-moe/base' not found",
                                               "~no-such-user-moe is the home folder of a user", "write ~/"]),
    ("base_model", "./ba\0se", ["base_model: model './ba\\x00se'", "holds a NUL character (\\x00)", "remove it"]),
    ("output", "o3\0", ["output: 'o3\\x00' holds a NUL character"]),
])
def test_impossible_paths_in_the_recipe_are_named(field, value, words, stories, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fields = {"base_model": str(stories), "num_experts": 2, "gate_mode": "random", field: value}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in fields.items()))
    for command in ("plan", "build"):
        code, output = cli(command, cfg, *(["out"] if command == "build" and field != "output" else []))
        assert_clean_failure(code, output, tmp_path / "out", words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]


@pytest.mark.parametrize("folder", ["~no-such-user-moe/d", "d "])
def test_demo_folder_no_one_types_on_purpose_is_refused(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, output = cli("demo", folder)
    assert_clean_failure(code, output, tmp_path / folder, ["output error: demo folder", "nothing is made"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("form", ["string", "mapping"])
def test_mergekit_revision_on_a_local_folder_reads_the_folder(form, stories, tmp_path):
    """mergekit reads `./model@rev` and {path:, revision:} from an existing folder, revision ignored; it was
    'not found' here."""
    base = (f"base_model: {stories}@main\n" if form == "string"
            else f"base_model:\n  model:\n    path: {stories}\n    revision: main\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(base + "num_experts: 2\ngate_mode: random\n")
    code, output = cli("build", cfg, tmp_path / "moe")
    flat = " ".join(output.split())
    assert code == 0 and f"is the folder {stories}; a folder has no revisions, so @main is ignored" in flat, output
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["num_local_experts"] == 2


def test_an_embedder_that_cannot_embed_is_an_embedder_error(stories, tmp_path):
    """sentence-transformers loads any transformers folder (mean pooling), but a causal LM without a pad token
    cannot embed a batch: that was a ValueError traceback."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: hidden\nexperts:\n  - source_model: {stories}\n"
                   f"    positive_prompts: [once upon a time]\n  - source_model: {stories}\n"
                   f"    positive_prompts: [the cat sat]\n")
    code, output = cli("lint", cfg, "--embedder", stories)
    assert_clean_failure(code, output, tmp_path / "no-output", [
        f"embedder error: embedder {stories}: loaded, but it could not embed the prompts", "not a language model"])


@pytest.mark.parametrize("command", ["build", "plan", "grow"])
def test_dash_as_an_output_is_refused_not_made(command, stories, tmp_path, monkeypatch):
    """`-` reads as "standard output"; a model folder or grown recipe named '-' was made instead."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: hidden\nexperts:\n  - source_model: {stories}\n"
                   f"    positive_prompts: [once upon a time]\n  - source_model: {stories}\n"
                   f"    positive_prompts: [the cat sat]\n")
    pool = tmp_path / "pool.txt"
    pool.write_text("a dragon story\nwrite a loop in python\n")
    args = {"build": ["build", cfg, "-"], "plan": ["plan", cfg, "-o", "-"],
            "grow": ["prompts", "grow", cfg, "--pool", pool, "-o", "-"]}[command]
    code, output = cli(*args)
    words = (["-o -: the grown recipe is written to a file, not to standard output", "./- for a file named '-'"]
             if command == "grow" else ["output -: a model is a folder of files, not a stream for standard output",
                                        "./- for a folder named '-'"])
    assert_clean_failure(code, output, tmp_path / "-", words)


def test_two_adapters_on_local_folders_are_named_as_two(stories, tmp_path):
    """'./base+./a+./b' said "there is no folder a" (the second '+' read as part of the adapter's name)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: random\nexperts:\n  - source_model: {stories}\n"
                   f"  - source_model: {stories}+{stories}+{stories}\n")
    code, output = cli("plan", cfg)
    assert_clean_failure(code, output, tmp_path / "no-output", [
        "experts[1].source_model:", "names more than one '+'", "merges one adapter (model+adapter)"])


@pytest.mark.parametrize("value,words", [
    ("''", ["experts[0].positive_prompts_from: '' is empty; name a prompt set"]),
    ("x" * 300, ["experts[0].positive_prompts_from: 'xxx", "cannot be looked up (File name too long)"]),
    ("{fifo}", ["experts[0].positive_prompts_from:", "is not a regular file (a pipe or a device)",
                "write the prompts to a file"]),
])
def test_prompt_file_references_that_cannot_be_files_are_named(value, words, stories, tmp_path):
    """'' was called a folder, a 300-character name an error of the package's own data folder, a pipe "not an
    existing file"; each now names the field and what is wrong."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {stories}\ngate_mode: hidden\nexperts:\n  - source_model: {stories}\n"
                   f"    positive_prompts_from: {value.format(fifo=fifo)}\n  - source_model: {stories}\n"
                   f"    positive_prompts: [the cat sat]\n")
    code, output = cli("plan", cfg)
    assert_clean_failure(code, output, tmp_path / "no-output", words)
    assert "moe_upcycle/data" not in output


def test_a_model_path_too_long_says_so_and_is_not_echoed_whole(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: ./{'x' * 100_000}\nnum_experts: 2\ngate_mode: random\n")
    code, output = cli("plan", cfg)
    assert_clean_failure(code, output, tmp_path / "no-output", [
        "base_model:", "the name is too long for the file system", "choose a shorter name"])
    assert len(output) < 2000 and "readable by you" not in output, len(output)
