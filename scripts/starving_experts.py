"""Why an expert starves: the routing self-check of a recipe under variants of the gate math, from one capture.

Runs the recipe's prompts once through its base model (streamed, as a build does), keeps the positive prompts'
router inputs, and counts each expert's wins among its own prompts (`gates.self_check`, counted as
`route --labeled` counts) for the rows the recipe makes and for variants: without negative prompts, without
gate_center, and the negative mean scaled before it is subtracted. Prints one table row per variant.

    python scripts/smollm2_from_gguf.py ... smollm2-135m     # a real small model
    python scripts/starving_experts.py frankenmoe.yaml        # the recipe, its models pointing at it
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--capture", help="a .pt file: the capture is saved there, or read from it when it exists")
    args = parser.parse_args()

    from moe_upcycle.build import prepare
    from moe_upcycle.gates.hidden_gates import gate_rows, prompt_router_inputs, prompt_texts
    from moe_upcycle.gates.self_check import KeptInputs, route_own_prompts
    from moe_upcycle.gates.batches import load_tokenizer
    from moe_upcycle.gates.stream import open_streamed
    from moe_upcycle.recipe.resolve import gate_params

    from pathlib import Path

    config, sources, plan = prepare(args.recipe)
    params = gate_params(config)
    base = sources[config.base_model]
    if args.capture and Path(args.capture).is_file():
        own, negative, token_norm, kept = torch.load(args.capture, weights_only=False)
    else:
        streamed = open_streamed(base, "cpu", "float32", load_tokenizer(base.path))
        own, negative, inputs = prompt_router_inputs(streamed, params.experts, "mean", args.batch_size,
                                                     keep_positives=True)
        token_norm = inputs.token_norm
        kept = KeptInputs(inputs.kept, inputs.kept_text, inputs.kept_tokens)
        if args.capture:
            torch.save((own, negative, token_norm, kept), args.capture)
    n = len(params.experts)
    _, groups, _ = prompt_texts(params.experts)
    text_expert = [g if g < n else -1 for g in groups]
    has_negative = torch.tensor([bool(e.negative) for e in params.experts])
    layers = list(plan.moe_layers)

    def wins(direction: torch.Tensor, center: bool) -> list[int]:
        rows = gate_rows(direction, own, token_norm, center=center, scale=1.0)
        return route_own_prompts(kept, {layer: rows[layer] for layer in layers}, layers, text_expert,
                                 n).diagonal().tolist()

    names = [e.name for e in params.experts]
    sizes = [len(e.positive) for e in params.experts]
    print(f"{'variant':<40}" + "".join(f"{name:>10}" for name in names))
    print(f"{'own prompts':<40}" + "".join(f"{s:>10}" for s in sizes))
    mask = has_negative[None, :, None].float()
    for weight in (1.0, 0.5, 0.25, 0.0):
        direction = own - weight * negative * mask
        for center in (True, False):
            label = f"negatives x{weight:g}, centred after"
            label = label if center else f"negatives x{weight:g}, no gate_center"
            print(f"{label:<40}" + "".join(f"{w:>10}" for w in wins(direction, center)))
    shared = own.mean(dim=1, keepdim=True)
    own_c, neg_c = own - shared, negative - shared
    print(f"{'mean taken from both, then subtracted':<40}" + "".join(
        f"{w:>10}" for w in wins(own_c - neg_c * mask, False)))
    along = torch.nn.functional.normalize(own_c, dim=-1)
    orthogonal = neg_c - (neg_c * along).sum(-1, keepdim=True) * along  # the negative mean's part off the own mean
    print(f"{'negative off the own mean, centred':<40}" + "".join(
        f"{w:>10}" for w in wins(own_c - orthogonal * mask, False)))
    # how far the math row's negative term moves it: cosine of the mean router inputs of the sets
    unit = torch.nn.functional.normalize(own, dim=-1)
    cos = torch.einsum("leh,lfh->lef", unit, unit).mean(0)
    print("mean cosine over layers of the experts' mean router inputs:")
    for i, name in enumerate(names):
        print(f"  {name:<8}" + "".join(f"{float(c):>8.3f}" for c in cos[i]))


if __name__ == "__main__":
    main()
