"""`upcycle_model`: an in-memory Mixtral for training scripts, built by the same plan/inits machinery."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPT_TEXT
from moe_upcycle import upcycle, upcycle_model
from moe_upcycle.errors import ConfigError, PlanError
from tolerances import assert_close_rel
from test_inits import expert as file_expert
from test_inits import read


def load(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(str(folder))(PROMPT_TEXT, return_tensors="pt")["input_ids"]
    return model, ids


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def dense_stories(stories):
    return load(stories)


def test_copy_is_a_mixtral_equal_to_dense(dense_stories):
    dense, ids = dense_stories
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2)
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.training
    assert moe.config.num_local_experts == 4 and moe.config.num_experts_per_tok == 2
    assert moe.lm_head.weight is moe.model.embed_tokens.weight  # stories ties embeddings
    assert all(p.requires_grad and p.device.type == "cpu" for p in moe.parameters())
    assert_close_rel(logits(moe.eval(), ids), logits(dense, ids))


def test_split_in_memory_is_exact(dense_stories):
    dense, ids = dense_stories
    moe = upcycle_model(dense, num_experts=8, experts_per_token=2, expert_init={"method": "split", "granularity": 2})
    assert moe.config.intermediate_size == 86
    assert_close_rel(logits(moe.eval(), ids), logits(dense, ids))


def test_same_bytes_as_the_file_build(tiny_llama, tmp_path):
    """One implementation: the in-memory experts are the file build's experts, byte for byte."""
    init = {"method": "drop", "ratio": 0.5}
    out = upcycle({"base_model": str(tiny_llama), "num_experts": 4, "gate_mode": "random", "seed": 3,
                   "expert_init": init, "report_init_drift": False}, tmp_path / "moe").output
    dense, _ = load(tiny_llama)
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init=init, seed=3)
    experts = moe.model.layers[1].mlp.experts
    for e in range(4):
        w1, w3 = experts.gate_up_proj[e].detach().chunk(2, dim=0)
        assert torch.equal(w1, file_expert(out, 1, e, "gate_proj"))
        assert torch.equal(w3, file_expert(out, 1, e, "up_proj"))
        assert torch.equal(experts.down_proj[e].detach(), file_expert(out, 1, e, "down_proj"))
    assert torch.equal(moe.model.layers[0].mlp.gate.weight.detach(), read(out, "model.layers.0.block_sparse_moe.gate.weight"))


def test_optimizer_step_on_expert_0_leaves_other_experts_unchanged(dense_stories):
    dense, ids = dense_stories
    dense_before = {k: v.clone() for k, v in dense.state_dict().items()}
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2)  # copy: experts start identical
    experts = [layer.mlp.experts for layer in moe.model.layers]
    before = [(m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for m in experts]
    mask = torch.zeros(4, 1, 1)
    mask[0] = 1.0  # train expert 0 only
    params = [p for m in experts for p in (m.gate_up_proj, m.down_proj)]
    for p in params:
        p.register_hook(lambda grad: grad * mask)
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    loss = moe.train()(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    moved = 0
    for (gu0, d0), m in zip(before, experts):
        moved += int(not torch.equal(m.gate_up_proj[0], gu0[0]))
        assert torch.equal(m.gate_up_proj[1:], gu0[1:]) and torch.equal(m.down_proj[1:], d0[1:])
    assert moved == len(experts)  # expert 0 trained in every layer ...
    for k, v in dense.state_dict().items():  # ... and the dense model was never touched
        assert torch.equal(v, dense_before[k]), k
    # no MoE parameter shares storage with the dense model
    dense_ptrs = {t.untyped_storage().data_ptr() for t in dense.state_dict().values()}
    assert not dense_ptrs & {p.untyped_storage().data_ptr() for p in moe.parameters()}


def test_full_training_step_changes_no_dense_weight(tiny_llama):
    dense, ids = load(tiny_llama)
    snapshot = {k: v.clone() for k, v in dense.state_dict().items()}
    moe = upcycle_model(dense, num_experts=4, experts_per_token=1, expert_init={"method": "noise", "scale": 0.01},
                        router_jitter_noise=0.01, output_router_logits=True, router_aux_loss_coef=0.02)
    # output_router_logits is passed to the training calls, never kept in the config save_pretrained writes
    assert (moe.config.router_jitter_noise, moe.config.output_router_logits) == (0.01, False)
    out = moe.train()(input_ids=ids, labels=ids)
    assert out.aux_loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    torch.optim.SGD(moe.parameters(), lr=0.1).step()
    for k, v in dense.state_dict().items():
        assert torch.equal(v, snapshot[k]), k


def test_errors_name_the_argument(dense_stories):
    dense, _ = dense_stories
    with pytest.raises(ConfigError, match="gate: 'cheap_embed' is not available in memory"):
        upcycle_model(dense, gate="cheap_embed")
    with pytest.raises(ConfigError, match="experts_per_token is 5 but there are only 4 experts"):
        upcycle_model(dense, num_experts=4, experts_per_token=5)
    with pytest.raises(PlanError, match="granularity: 3 does not divide intermediate_size 172"):
        upcycle_model(dense, num_experts=6, experts_per_token=3, expert_init={"method": "split", "granularity": 3})


# ---------------------------------------------------------------- the states researchers hand it over in


def test_frozen_parameters_stay_frozen_and_routers_train(tiny_llama):
    """Whatever the dense model froze (requires_grad=False) is frozen in the MoE: the embedding, attention, and
    the experts of a frozen FFN (every expert copies it); routers are new and train; a parameter fed by any
    trainable source trains."""
    dense, ids = load(tiny_llama)
    dense.model.embed_tokens.weight.requires_grad_(False)
    for p in dense.model.layers[0].self_attn.parameters():
        p.requires_grad_(False)
    for p in dense.model.layers[1].mlp.parameters():
        p.requires_grad_(False)
    moe = upcycle_model(dense, num_experts=3)
    frozen = sorted(n for n, p in moe.named_parameters() if not p.requires_grad)
    experts = [n for n in frozen if ".experts." in n]
    assert "model.embed_tokens.weight" in frozen
    assert {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} <= set(frozen)
    assert experts and all(n.startswith("model.layers.1.") for n in experts), experts
    assert not any("gate.weight" in n or "router" in n for n in frozen), frozen
    assert all(p.requires_grad for n, p in moe.named_parameters() if n.startswith("model.layers.0.mlp"))
    moe(input_ids=ids, labels=ids).loss.backward()  # trains as it stands
    assert moe.model.embed_tokens.weight.grad is None


def test_a_half_frozen_ffn_trains_and_says_so(tiny_llama):
    """transformers 5 holds a layer's experts' gate and up projections in one fused gate_up_proj: with only the
    dense gate_proj frozen, it cannot be half frozen and trains — said, with the parameter and its sources (before:
    silent, against the README's "what the dense model froze stays frozen"). A wholly frozen FFN warns nothing."""
    import warnings

    from moe_upcycle.errors import UpcycleWarning

    dense, ids = load(tiny_llama)
    dense.model.layers[1].mlp.gate_proj.weight.requires_grad_(False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        moe = upcycle_model(dense, num_experts=2, experts_per_token=1, gate="random")
    said = [w for w in said if issubclass(w.category, UpcycleWarning)]
    params = dict(moe.named_parameters())
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    if fused not in params:  # transformers 4.57: per-expert w1 from gate_proj alone stays frozen, nothing mixed
        assert not any("half frozen" in str(w.message) for w in said)
        return
    assert params[fused].requires_grad
    assert [str(w.message) for w in said if "half frozen" in str(w.message)] == [
        f"1 MoE parameter(s) hold frozen and trainable dense weights together, and one parameter cannot be half "
        f"frozen, so they train: {fused} (from model.layers.1.mlp.gate_proj.weight, frozen, and "
        f"model.layers.1.mlp.up_proj.weight, not). Freeze or unfreeze the whole FFN of those layers before upcycling, "
        f"or set requires_grad on the MoE's parameters after it"]
    assert said[0].filename == __file__  # at the caller's line
    dense.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    dense.model.layers[1].mlp.down_proj.weight.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UpcycleWarning)
        whole = upcycle_model(dense, num_experts=2, experts_per_token=1, gate="random")
    assert not dict(whole.named_parameters())[fused].requires_grad


def test_gradient_checkpointing_carries_over_and_trains(tiny_llama):
    """Activation (gradient) checkpointing on in the dense model is on in the MoE (transformers 5's name for it,
    without its deprecation warning), and a backward pass runs through it."""
    import warnings

    dense, ids = load(tiny_llama)
    dense.activation_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        moe = upcycle_model(dense, num_experts=2)
    assert moe.is_activation_checkpointing and moe.training
    moe(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in moe.named_parameters() if "embed" in n)
    plain = upcycle_model(load(tiny_llama)[0], num_experts=2)
    assert not plain.is_activation_checkpointing


def test_a_torch_compiled_model_is_upcycled_as_the_model_it_wraps(tiny_llama):
    dense, ids = load(tiny_llama)
    moe = upcycle_model(torch.compile(dense), num_experts=2)
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert_close_rel(logits(moe.eval(), ids), logits(dense, ids))


def test_layers_removed_without_the_config_are_named_and_work_once_it_is_set(tiny_llama):
    """A layer-pruning experiment that cut model.model.layers but not config.num_hidden_layers: named, with the
    line to add; once added, the MoE has the layers the model has and computes what it computes."""
    dense, ids = load(tiny_llama)
    dense.model.layers = dense.model.layers[:1]
    with pytest.raises(ConfigError, match=r"dense_model: config.num_hidden_layers is 2 but the model has 1 layers "
                                          r"\(model.model.layers\); .*set model.config.num_hidden_layers = "
                                          r"len\(model.model.layers\)"):
        upcycle_model(dense, num_experts=2)
    dense.config.num_hidden_layers = 1
    if getattr(dense.config, "layer_types", None):
        dense.config.layer_types = dense.config.layer_types[:1]
    moe = upcycle_model(dense, num_experts=2)
    assert len(moe.model.layers) == 1 and moe.config.num_hidden_layers == 1
    assert_close_rel(logits(moe.eval(), ids), logits(dense, ids))


@pytest.mark.parametrize("kwargs, words", [
    (dict(expert_init={"method": "noise", "std": 0.1}),
     "upcycle_model: expert_init.std: unknown key — remove it; valid keys: absolute, granularity, method, ratio"),
    (dict(num_experts=0), "upcycle_model: num_experts: 0 is too small; write at least 1"),
    (dict(seed=None), "upcycle_model: seed=None is not a value it takes; pass 0 (its default), or leave the argument out"),
    (dict(expert_init=None), "upcycle_model: expert_init=None is not a value it takes; pass 'copy' (its default)"),
    (dict(output_router_logits="yes"), "upcycle_model: output_router_logits='yes' is not a bool; pass True or False"),
])
def test_argument_errors_name_upcycle_model_and_offer_no_cli_flag(kwargs, words, tiny_llama):
    """upcycle_model has no --allow-unknown-keys (nor allow_unknown_keys=): its messages do not offer one, and
    they are headed by the function, not by a "config" the caller never wrote."""
    dense, _ = load(tiny_llama)
    with pytest.raises(ConfigError) as caught:
        upcycle_model(dense, **kwargs)
    assert words in str(caught.value) and "allow-unknown-keys" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("architecture", [None, "qwen2_moe"])
def test_the_dense_models_attention_implementation_is_kept(impl, architecture, stories):
    """A dense model loaded with attn_implementation="eager" gives an eager MoE (before: transformers'
    default, sdpa), whatever the output architecture; the copy-init MoE still computes the dense logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float32, attn_implementation=impl).eval()
    ids = AutoTokenizer.from_pretrained(str(stories))(PROMPT_TEXT, return_tensors="pt")["input_ids"]
    moe = upcycle_model(dense, num_experts=2, architecture=architecture).eval()
    assert moe.config._attn_implementation == impl
    assert_close_rel(logits(moe, ids), logits(dense, ids), 1e-5)


def test_the_dense_models_generation_config_is_kept(stories, tmp_path):
    """A chat model's stop tokens and sampling defaults (its generation_config.json) carry over to the MoE, as a
    copy, and save_pretrained writes them; before, the MoE got defaults derived from config.json (eos 2 only)."""
    import json

    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float32)
    dense.generation_config.eos_token_id = [2, 7]
    dense.generation_config.do_sample, dense.generation_config.temperature = True, 0.6
    moe = upcycle_model(dense, num_experts=2)
    assert moe.generation_config.eos_token_id == [2, 7] and moe.generation_config.temperature == 0.6
    moe.generation_config.temperature = 0.9
    assert dense.generation_config.temperature == 0.6  # a copy: the dense model is left as it was
    moe.save_pretrained(tmp_path / "moe")
    saved = json.loads((tmp_path / "moe" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == [2, 7] and saved["do_sample"] is True and saved["temperature"] == 0.9


def test_a_head_untied_in_memory_under_a_tied_config_is_refused(stories):
    """config.tie_word_embeddings is true but lm_head was replaced by a trained copy: the MoE (tied) would compute
    with the embedding, 5.7 logits away (measured before this check), so it is refused with both fixes; each fix
    then gives an MoE equal to the dense model, and an equal copy needs none."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 20, 7, 3]])
    dense.lm_head.weight = torch.nn.Parameter(dense.lm_head.weight.detach().clone() + 0.5)
    with pytest.raises(PlanError) as info:
        upcycle_model(dense, num_experts=2)
    assert str(info.value) == (
        "dense_model: its config ties the output head to the embedding (tie_word_embeddings: true), but "
        "lm_head.weight is another tensor than model.embed_tokens.weight (max |difference| 0.5), so the MoE, which "
        "ties them, would not compute what the dense model computes. If the separate head is the model's, set "
        "dense_model.config.tie_word_embeddings = False first; if the embedding is, call dense_model.tie_weights()")
    dense.config.tie_word_embeddings = False  # the separate head is the model's
    moe = upcycle_model(dense, num_experts=2).eval()
    assert moe.lm_head.weight is not moe.model.embed_tokens.weight
    assert_close_rel(logits(moe, ids), logits(dense, ids), 1e-5)
    dense.config.tie_word_embeddings = True
    dense.lm_head.weight = torch.nn.Parameter(dense.model.embed_tokens.weight.detach().clone())  # an equal copy
    moe = upcycle_model(dense, num_experts=2).eval()
    assert moe.lm_head.weight is moe.model.embed_tokens.weight
    assert_close_rel(logits(moe, ids), logits(dense, ids), 1e-5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool])
def test_integer_parameters_are_refused_as_files_are(dtype, stories):
    """A build refuses integer weights; in memory they were copied into the float experts as numbers (an int8
    up_proj full of 3s gave experts of 3.0), with no word."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float32).eval()
    mlp = dense.model.layers[1].mlp
    mlp.up_proj.weight = torch.nn.Parameter(torch.ones_like(mlp.up_proj.weight, dtype=dtype), requires_grad=False)
    with pytest.raises(PlanError) as info:
        upcycle_model(dense, num_experts=2)
    assert str(info.value) == (
        f"dense_model: parameter 'model.layers.1.mlp.up_proj.weight' is {str(dtype).removeprefix('torch.')}, but "
        f"weights must be floating point; upcycle the model before quantizing it, or give the parameter a float dtype")


@pytest.mark.parametrize("change, words", [
    ("embedding", ["parameter 'model.embed_tokens.weight' has shape [", "but model.config implies [",
                   "(vocab_size, hidden_size)"]),
    ("ffn", ["parameter 'model.layers.1.mlp.gate_proj.weight' has shape [", "(intermediate_size, hidden_size)"]),
])
def test_modules_replaced_without_their_config_are_named(change, words, stories):
    """A module swapped in memory without updating model.config (a bigger embedding, a pruned FFN) is a PlanError
    naming the parameter, its shape and what the config implies; before, a RuntimeError about tensor sizes."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.float32)
    hidden, inter = dense.config.hidden_size, dense.config.intermediate_size
    if change == "embedding":
        dense.model.embed_tokens = torch.nn.Embedding(dense.config.vocab_size + 10, hidden)
    else:
        mlp = dense.model.layers[1].mlp
        mlp.gate_proj, mlp.up_proj = (torch.nn.Linear(hidden, inter // 2, bias=False) for _ in range(2))
        mlp.down_proj = torch.nn.Linear(inter // 2, hidden, bias=False)
    with pytest.raises(PlanError) as info:
        upcycle_model(dense, num_experts=2)
    text = str(info.value)
    for word in words + ["the config does not describe the model's weights (a module replaced without updating "
                         "model.config?) — make them agree"]:
        assert word in text, (word, text)


def test_what_makes_the_moe_start_elsewhere_is_warned_as_build_prints_it(tiny_llama):
    """A build prints these as notes; upcycle_model used to drop them, so a split that cannot be exact, or uniform
    gates whose ties pick the experts, gave other logits without a word."""
    import warnings

    from moe_upcycle.errors import UpcycleWarning

    dense, ids = load(tiny_llama)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moe = upcycle_model(dense, num_experts=4, experts_per_token=1, expert_init={"method": "split", "granularity": 2})
        upcycle_model(dense, num_experts=4, experts_per_token=2, gate="uniform",
                      expert_init={"method": "drop", "ratio": 0.5})  # experts differ: the ties pick which run
        upcycle_model(dense, num_experts=4, experts_per_token=2, gate="uniform")  # identical copies: ties are harmless
        upcycle_model(dense, num_experts=4, experts_per_token=2)  # exact: nothing to say
    said = [str(w.message) for w in caught if issubclass(w.category, UpcycleWarning)]
    assert len(said) == 2, said
    assert said[0].startswith("expert_init split is NOT function-preserving at init: experts_per_token 1 is not a "
                              "multiple of granularity 2")
    assert said[1].startswith("gate_mode uniform: every expert scores the same for every token, so the top-2 of 4")
    assert all(w.filename == __file__ for w in caught if issubclass(w.category, UpcycleWarning))  # the caller's line
    assert (logits(moe.eval(), ids) - logits(dense, ids)).abs().max() > 1e-3  # what the warning says


def test_a_parameter_the_moe_has_no_place_for_is_refused(tiny_llama):
    """lm_head.bias added to a Llama: from files a loader skips it too, but this model adds it to every logit."""
    dense, _ = load(tiny_llama)
    head = dense.lm_head
    dense.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with pytest.raises(ConfigError, match=r"dense_model: parameter\(s\) 'lm_head.bias' have no place in a mixtral "
                                          r"model, so the MoE would compute other logits than dense_model"):
        upcycle_model(dense, num_experts=2)


def test_stale_layer_types_after_removing_a_layer_are_named(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32)
    if not isinstance(getattr(dense.config, "layer_types", None), list):
        pytest.skip("this transformers' Qwen2Config has no layer_types")
    del dense.model.layers[0]
    dense.config.num_hidden_layers = len(dense.model.layers)
    with pytest.raises(ConfigError, match=r"dense_model: config.layer_types lists 2 layers but the model has 1 "
                                          r"\(model.model.layers\); .* set model.config.layer_types to the types"):
        upcycle_model(dense, num_experts=2)
    dense.config.layer_types = dense.config.layer_types[1:]
    assert type(upcycle_model(dense, num_experts=2)).__name__ == "Qwen2MoeForCausalLM"


def test_a_prompt_tuning_peft_model_is_named_as_a_wrapper(tiny_llama):
    peft = pytest.importorskip("peft")
    dense, _ = load(tiny_llama)
    wrapped = peft.get_peft_model(dense, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ConfigError, match=r"dense_model: a PeftModelForCausalLM wrapper whose adapter \(PROMPT_TUNING\) "
                                          r"adds no weights an MoE could hold; pass the model it wraps "
                                          r"\(peft_model.get_base_model\(\)\)"):
        upcycle_model(wrapped, num_experts=2)
    assert type(upcycle_model(wrapped.get_base_model(), num_experts=2)).__name__ == "MixtralForCausalLM"


def test_dtype_auto_keeps_the_dense_models_dtype(tiny_llama):
    """from_pretrained's dtype="auto" means "as stored"; here it is the dense model's dtype, as dtype=None."""
    dense, _ = load(tiny_llama)
    dense = dense.to(torch.bfloat16)
    assert {p.dtype for p in upcycle_model(dense, num_experts=2, dtype="auto").parameters()} == {torch.bfloat16}


# ---------------------------------------------------------------- the README's training recipe, then publishing


def test_readme_training_recipe_saves_a_model_that_generates_and_verifies(stories, tmp_path):
    """The README recipe: `output_router_logits=True`, fp32 master weights, a few AdamW steps, `save_pretrained` in
    bf16. Before, the flag was saved into config.json and transformers 5.24 failed a batched, padded `generate` of
    the reloaded model ("The size of tensor a (2) must match the size of tensor b (16)"); now the training calls
    get router logits and the aux loss, the saved config says false, and the folder generates and verifies."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_upcycle.check.verify import verify

    tok = AutoTokenizer.from_pretrained(str(stories))
    dense = AutoModelForCausalLM.from_pretrained(str(stories), dtype=torch.bfloat16)
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, expert_init={"method": "drop", "ratio": 0.5},
                        gate="random", router_aux_loss_coef=0.01, output_router_logits=True, dtype="float32")
    assert moe.config.output_router_logits is False and moe.training
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    for text in ["Once upon a time, there was a little girl", "The dog ran to the park and"]:
        batch = tok(text, return_tensors="pt")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(**batch, labels=batch["input_ids"])
            plain = moe(**batch, labels=batch["input_ids"], output_router_logits=False)  # the caller's word wins
        # the loss is the language-model loss plus router_aux_loss_coef x aux loss, as transformers' flag gives it
        assert out.aux_loss is not None and plain.aux_loss is None and out.router_logits is not None
        assert_close_rel(out.loss, plain.loss + 0.01 * out.aux_loss)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # an evaluation pass (no gradients): no aux loss, as in eval mode
        assert moe(**tok("Lily", return_tensors="pt")).aux_loss is None
    assert moe.eval()(**tok("Lily", return_tensors="pt")).aux_loss is None
    folder = tmp_path / "my-moe-trained"
    moe.to(torch.bfloat16).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    assert json.loads((folder / "config.json").read_text())["output_router_logits"] is False

    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto").eval()
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.unk_token or tok.eos_token
    batch = tok(["Once upon a time, there was a little girl named", "Lily"], return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # the second row is padded
    new = reloaded.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert new.shape == (2, batch["input_ids"].shape[1] + 4)

    result = verify(folder, stories, max_new_tokens=4)
    assert result.ok, result.problems
    # a folder carrying the flag (as transformers' own save_pretrained writes it when the config says so) fails,
    # named with its fix, and every other check still ran
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "output_router_logits": True}))
    flagged = verify(folder, stories, max_new_tokens=4)
    assert not flagged.ok and len(flagged.problems) == 1, flagged.problems
    assert flagged.problems[0].startswith("config.json: output_router_logits is true, and published so: transformers "
                                          "then adds the router aux loss in every forward pass, generate included")
    assert flagged.problems[0].endswith('Set "output_router_logits": false in config.json (from a training script: '
                                        'model.config.output_router_logits = False before save_pretrained); the '
                                        'other checks ran with it false')
    assert flagged.comparison is not None and flagged.continuations


def test_a_model_with_the_flag_in_its_config_fails_a_padded_generate(stories, tmp_path):
    """Why the flag must not be published, measured in the installed transformers: the same weights with
    output_router_logits true in config.json fail a padded batch (prompts of equal length pass, which is why
    verify pads its continuation batch itself)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_upcycle.check.continuations import continue_prompts

    tok = AutoTokenizer.from_pretrained(str(stories))
    dense = AutoModelForCausalLM.from_pretrained(str(stories))
    upcycle_model(dense, num_experts=2, output_router_logits=True).save_pretrained(str(tmp_path / "m"))
    flagged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), output_router_logits=True).eval()
    same_length = [tok(p, return_tensors="pt")["input_ids"] for p in ("The capital of France is", "def fibonacci(n):")]
    assert same_length[0].shape == same_length[1].shape == (1, 16)
    with pytest.raises(RuntimeError, match="The size of tensor a"):
        continue_prompts(flagged, same_length, 2, 0, "cpu")  # the extra, shorter row pads the batch
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    assert [c.shape for c in continue_prompts(saved, same_length, 2, 0, "cpu")] == [(2,), (2,)]


def test_buffers_are_computed_anew_and_ties_are_one_parameter(tiny_qwen2_tied, monkeypatch):
    """One process: the MoE's rotary buffers are new tensors (not those the empty MoE was constructed with) holding
    inv_freq[i] = 1 / theta ** (2i / d) on the parameters' device, and its tied head is one parameter with the
    embedding's values."""
    from transformers import AutoModelForCausalLM

    made = []
    original = AutoModelForCausalLM.from_config.__func__

    def from_config(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        made.append({id(b) for b in model.buffers()})
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", classmethod(from_config))
    dense, ids = load(tiny_qwen2_tied)
    moe = upcycle_model(dense, num_experts=4, experts_per_token=2, seed=5)
    monkeypatch.undo()
    buffers = dict(moe.named_buffers())
    assert set(buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert not {id(b) for b in buffers.values()} & made[-1]
    d, theta = moe.config.head_dim, float(moe.config.rope_parameters["rope_theta"])
    formula = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    for name, buf in buffers.items():
        assert buf.device == moe.model.embed_tokens.weight.device and buf.dtype == torch.float32, name
        torch.testing.assert_close(buf.double(), formula, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    assert buffers["model.rotary_emb.inv_freq"].data_ptr() != buffers["model.rotary_emb.original_inv_freq"].data_ptr()
    assert moe.lm_head.weight is moe.model.embed_tokens.weight
    assert torch.equal(moe.lm_head.weight, dense.model.embed_tokens.weight)
    assert_close_rel(logits(moe.eval(), ids), logits(dense, ids))
