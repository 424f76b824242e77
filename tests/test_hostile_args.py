"""Hostile arguments to the Python API and to every command's options: each is refused with an
`UpcycleError` (the CLI: exit 1, no traceback, nothing written) that names the argument or option,
and a call that succeeds leaves the dense model exactly as it was.

Broken checkpoints, output-folder safety and published configs are covered elsewhere
(test_bad_inputs, test_trust_*, test_mergekit_configs)."""

from __future__ import annotations

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


@pytest.mark.parametrize("case_id,make,words", [
    ("path-string", lambda d, s: str(s), ["dense_model: got a str", "AutoModelForCausalLM.from_pretrained",
                                          "moe_upcycle.upcycle"]),
    ("path-object", lambda d, s: s, ["dense_model: got a PosixPath", "moe_upcycle.upcycle"]),
    ("none", lambda d, s: None, ["dense_model: got a NoneType, not a loaded transformers model"]),
    ("bare-module", lambda d, s: torch.nn.Linear(4, 4), ["dense_model: got a Linear"]),
    ("decoder-without-lm-head", lambda d, s: d.model, ["dense_model: a LlamaModel is not a causal language model",
                                                       "ForCausalLM"]),
], ids=["path-string", "path-object", "none", "bare-module", "decoder-without-lm-head"])
def test_not_a_causal_lm_is_named(case_id, make, words, dense, stories):
    before = snapshot(dense)
    with pytest.raises(ConfigError) as info:
        upcycle_model(make(dense, stories), num_experts=2)
    for word in words:
        assert word in str(info.value)
    assert_unchanged(dense, before)


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
