"""mergekit-moe 0.1.5's router computation, re-implemented for tests from its source.

Written from mergekit/moe/router.py (``get_hidden_states``, ``get_cheap_embedding``,
``tokenize_prompts``, ``get_gate_params``) and mergekit/scripts/moe.py (tokenizer set-up), with
transformers called directly — deliberately not through moe_upcycle, so a test comparing the two
compares two independent code paths. Only the pieces a test needs: hidden/hidden_avg/hidden_last
and cheap_embed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from routing_prompts import CODE, STORY

# a 4-expert config in the shape of a published frankenMoE card (keyword prompts as in
# Beyonder-4x7B-v2, a negative prompt, and an empty "default expert" prompt)
PUBLISHED_4X = [
    {"positive_prompts": ["chat", "assistant", "tell me", "explain", "I want"]},
    {"positive_prompts": ["code", "python", "javascript", "programming", "algorithm"],
     "negative_prompts": ["Once upon a time"]},
    {"positive_prompts": ["storywriting", "write", "scene", "story", "character"]},
    {"positive_prompts": [""]},
]
CHAT = ["Hi! How are you today?", "Can you tell me what to do?", "Please explain why the sky is blue.",
        "I want to know more about dogs."]
# held-out texts (none is a prompt above) and the expert each should go to
HELD_OUT = [(t, 0) for t in CHAT] + [(t, 1) for t in CODE[6:]] + [(t, 2) for t in STORY[6:]]
# a 2-expert config with whole example sentences as prompts (code vs stories), held out: the rest
SENTENCES_2X = [{"positive_prompts": CODE[:6]}, {"positive_prompts": STORY[:6]}]
HELD_OUT_2X = [(t, 0) for t in CODE[6:]] + [(t, 1) for t in STORY[6:]]


def mergekit_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    tokenizer.pad_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenize_prompts(prompts: list[str], tokenizer):
    return tokenizer([(tokenizer.bos_token or "") + p for p in prompts], return_tensors="pt", padding=True,
                     add_special_tokens=False)


def get_hidden_states(model, tokenized, average: bool = True) -> torch.Tensor:
    with torch.no_grad():
        output = model(**tokenized.to(model.device), output_hidden_states=True, return_dict=True)
    hidden_states = torch.stack(output.hidden_states[:-1])  # (num_layers, batch_size, seq_len, hidden_size)
    if average:
        hidden_states = hidden_states.sum(dim=2) / hidden_states.shape[2]
    else:
        hidden_states = hidden_states[:, :, -1, :]
    return hidden_states.sum(dim=1) / hidden_states.shape[1]


def get_cheap_embedding(embed: torch.Tensor, tokenized, num_layers: int, vocab_size: int) -> torch.Tensor:
    onehot = torch.nn.functional.one_hot(tokenized["input_ids"], num_classes=vocab_size)  # (B, T, V)
    h = onehot.float() @ embed.float()  # (B, T, H)
    embedded = (h * tokenized["attention_mask"].unsqueeze(-1)).sum(dim=1).sum(dim=0, keepdim=True)  # (1, H)
    res = embedded / embedded.norm(dim=-1, keepdim=True).clamp(min=1e-8)
    return res.repeat(num_layers, 1)


def gate_params(path: Path, experts: list[dict], mode: str = "hidden", dtype: torch.dtype = torch.bfloat16,
                device: str = "cpu") -> torch.Tensor:
    """(num_layers, num_experts, hidden) as mergekit's get_gate_params returns it (model dtype: mergekit's bf16, or
    `dtype`), the model on `device`, the rows on the CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = mergekit_tokenizer(path)
    cfg = AutoConfig.from_pretrained(str(path))
    if mode == "cheap_embed":
        from safetensors.torch import load_file

        embed = load_file(str(Path(path) / "model.safetensors"))["model.embed_tokens.weight"]

        def _do_it(tokenized):
            return get_cheap_embedding(embed, tokenized, cfg.num_hidden_layers, cfg.vocab_size)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()

        def _do_it(tokenized):
            return get_hidden_states(model, tokenized, average=mode == "hidden_avg")

    gate_vecs = []
    for expert in experts:
        hidden_states = _do_it(tokenize_prompts(expert["positive_prompts"], tokenizer))
        if expert.get("negative_prompts"):
            hidden_states -= _do_it(tokenize_prompts(expert["negative_prompts"], tokenizer))
        hidden_states /= hidden_states.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        gate_vecs.append(hidden_states)
    return torch.stack(gate_vecs, dim=0).permute(1, 0, 2).cpu()  # (L, E, H)


def router_inputs(path: Path, texts: list[str]) -> list[torch.Tensor]:
    """Per layer, (N, H) fp32: the router's input (post_attention_layernorm output) at every token of
    `texts`, each text run alone through the dense model — what the routers of an MoE made of
    copies of this model score."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    layers = model.model.layers
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = [layer.post_attention_layernorm.register_forward_hook(
        lambda mod, args, out, i=i: captured[i].append(out[0].float())) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for text in texts:
                model(**tokenizer(text, return_tensors="pt"))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(c) for c in captured]


def top1_agreement(rows_a: torch.Tensor, rows_b: torch.Tensor, inputs: list[torch.Tensor]) -> float:
    """Fraction of (layer, token) pairs whose top-1 expert is the same under both routers.

    Args:
        rows_a, rows_b: (L, E, H) router weights.
        inputs: per layer (N, H) router inputs.
    """
    same = total = 0
    for layer, x in enumerate(inputs):
        a = (x @ rows_a[layer].float().T).argmax(dim=-1)
        b = (x @ rows_b[layer].float().T).argmax(dim=-1)
        same += int((a == b).sum())
        total += a.numel()
    return same / total
