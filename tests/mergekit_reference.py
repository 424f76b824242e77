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


def gate_params(path: Path, experts: list[dict], mode: str = "hidden") -> torch.Tensor:
    """(num_layers, num_experts, hidden) as mergekit's get_gate_params returns it (model dtype)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = mergekit_tokenizer(path)
    cfg = AutoConfig.from_pretrained(str(path))
    if mode == "cheap_embed":
        from safetensors.torch import load_file

        embed = load_file(str(Path(path) / "model.safetensors"))["model.embed_tokens.weight"]

        def _do_it(tokenized):
            return get_cheap_embedding(embed, tokenized, cfg.num_hidden_layers, cfg.vocab_size)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()

        def _do_it(tokenized):
            return get_hidden_states(model, tokenized, average=mode == "hidden_avg")

    gate_vecs = []
    for expert in experts:
        hidden_states = _do_it(tokenize_prompts(expert["positive_prompts"], tokenizer))
        if expert.get("negative_prompts"):
            hidden_states -= _do_it(tokenize_prompts(expert["negative_prompts"], tokenizer))
        hidden_states /= hidden_states.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8)
        gate_vecs.append(hidden_states)
    return torch.stack(gate_vecs, dim=0).permute(1, 0, 2)  # (L, E, H)
