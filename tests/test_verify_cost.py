"""What `verify` costs: each model loaded once, one at a time; prompts and continuations batched, same numbers.

The speed-ups of issue 17 must not change what verify reports: batched prompts give each prompt's
own logits, a 16-bit output upcast in place gives an fp32 load's logits bit for bit, and a
continuation read off another model's draft is the model's own greedy continuation.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tolerances import assert_close_rel

from moe_upcycle import upcycle
from moe_upcycle.check import verify as verify_module
from moe_upcycle.check.compare import (
    compare_logits,
    encode_inputs,
    load_causal_lm,
    prompt_logits,
    run_model,
    upcast_to_fp32,
)
from moe_upcycle.check.continuations import continue_prompts
from moe_upcycle.check.verify import default_prompts, default_text, verify


@pytest.fixture(scope="module")
def stories_bf16_moe(stories, tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "moe"
    upcycle({"base_model": str(stories), "num_experts": 4, "gate_mode": "random", "dtype": "bfloat16"}, out)
    return out


def test_batched_prompt_logits_are_each_prompts_own(tiny_llama):
    loaded = load_causal_lm(tiny_llama)
    prompts = encode_inputs(loaded.tokenizer, default_prompts()).prompts
    assert len({p.shape[1] for p in prompts}) > 1  # the batch really pads
    batched = prompt_logits(loaded.model, prompts, "cpu")
    with torch.inference_mode():
        for ids, got in zip(prompts, batched):
            assert_close_rel(got, loaded.model(input_ids=ids).logits[0])


def test_batched_continuations_match_one_prompt_at_a_time(tiny_llama):
    loaded = load_causal_lm(tiny_llama)
    prompts = encode_inputs(loaded.tokenizer, default_prompts()[:3]).prompts
    with torch.inference_mode():
        batched = continue_prompts(loaded.model, prompts, 6, 2, "cpu")
        for ids, got in zip(prompts, batched):
            alone = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                          do_sample=False, pad_token_id=2)[0, ids.shape[1]:]
            assert got.tolist() == alone[:len(got)].tolist() and len(got) >= 1


@pytest.mark.parametrize("draft_kind", ["own", "wrong", "short"])
def test_a_draft_gives_the_models_own_greedy_continuation(tiny_llama, draft_kind, monkeypatch):
    loaded = load_causal_lm(tiny_llama)
    prompts = default_prompts()[:3]
    plain = run_model(loaded, prompts, max_new_tokens=6)
    drafts = {"own": plain.continuation_ids,
              "wrong": [(ids + 1) % 300 for ids in plain.continuation_ids],  # departs at the first token
              "short": [ids[:2] for ids in plain.continuation_ids]}[draft_kind]
    calls = []
    generate = loaded.model.generate
    monkeypatch.setattr(loaded.model, "generate", lambda *a, **k: calls.append(k["max_new_tokens"]) or generate(*a, **k))
    drafted = run_model(loaded, prompts, max_new_tokens=6, drafts=drafts)
    assert [c.tolist() for c in drafted.continuation_ids] == [c.tolist() for c in plain.continuation_ids]
    assert drafted.continuations == plain.continuations
    # agreeing with the draft costs no decoding step; departing costs only the steps after it
    assert calls == {"own": [], "wrong": [5], "short": [3]}[draft_kind]


def test_upcast_in_place_gives_an_fp32_loads_logits_bit_for_bit(stories_bf16_moe):
    ref = load_causal_lm(stories_bf16_moe)  # fp32 load
    moe = load_causal_lm(stories_bf16_moe, dtype="auto")
    assert moe.model.dtype == torch.bfloat16
    upcast_to_fp32(moe.model)
    assert {p.dtype for p in moe.model.parameters()} == {torch.float32}
    inputs = encode_inputs(ref.tokenizer, default_prompts(), default_text(), 256)
    a = run_model(ref, default_prompts(), default_text(), continuation_prompts=0, inputs=inputs)
    b = run_model(moe, default_prompts(), default_text(), continuation_prompts=0, inputs=inputs)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    assert a.text_nll == b.text_nll


def test_verify_loads_each_model_once_and_never_holds_both(stories_bf16_moe, stories, monkeypatch):
    loads, alive = [], []
    real = verify_module.load_causal_lm

    def counting(folder, dtype=torch.float32, device="cpu", adapter=None, overrides=None):
        gc.collect()
        alive.append([ref() is not None for ref in loads_refs])  # models from earlier loads still in memory
        loaded = real(folder, dtype=dtype, device=device, adapter=adapter, overrides=overrides)
        loads.append((folder.name, dtype))
        loads_refs.append(weakref.ref(loaded.model))
        return loaded

    loads_refs: list = []
    monkeypatch.setattr(verify_module, "load_causal_lm", counting)
    result = verify(stories_bf16_moe, hashes=False)
    assert result.ok, result.problems
    assert loads == [("moe", "auto"), (stories.name, torch.float32)]  # the bf16 MoE is not loaded again in fp32
    assert alive == [[], [False]]  # the MoE was freed before the dense base was loaded
    # the comparison is still in fp32 (bf16 weights, fp32 arithmetic) and as close as before
    assert result.loaded_dtype == "bfloat16" and 0 < result.comparison.mean_kl < 1e-3
    assert len(result.continuations) == 3 and all(c["moe"] and c["dense"] for c in result.continuations)


def test_verify_comparison_equals_fresh_fp32_loads(stories_bf16_moe, stories):
    """verify's numbers for a bf16 output are those of the MoE loaded in fp32 and the dense base, run on the same ids."""
    result = verify(stories_bf16_moe, hashes=False)
    moe, dense = load_causal_lm(stories_bf16_moe), load_causal_lm(stories)
    prompts = default_prompts()
    inputs = encode_inputs(moe.tokenizer, prompts, default_text(), moe.model.config.max_position_embeddings)
    m = run_model(moe, prompts, default_text(), continuation_prompts=0, inputs=inputs)
    d = run_model(dense, prompts, default_text(), continuation_prompts=0, inputs=inputs)
    assert result.comparison == compare_logits(d.logits, m.logits)
    assert (result.perplexity_moe, result.perplexity_dense) == (m.perplexity, d.perplexity)
