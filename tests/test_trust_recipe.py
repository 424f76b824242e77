"""The recipe means exactly one thing (issue 13): duplicate keys, alias bombs and recursive aliases,
booleans for numbers (and numbers for booleans), absurd counts and sizes — each a named error, fast,
with nothing written."""

from __future__ import annotations

import resource
import time

import pytest

from failure_checks import assert_clean_failure, cli

GOOD = "base_model: {base}\nnum_experts: 2\ngate_mode: random\n"


# (id, YAML text with {base}, words the message must contain)
CASES = [
    ("duplicate-top-key", GOOD + "num_experts: 3\n", ["cfg.yaml:4:", "key 'num_experts' is given twice", "line 2 and line 4"]),
    ("duplicate-nested-key", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n"
     "    name: a\n    name: b\n  - source_model: {base}\n", ["cfg.yaml:6:", "key 'name' is given twice", "line 5 and line 6"]),
    ("duplicate-as-yaml-reads-it", "base_model: {base}\nnum_experts: 2\ngate_mode: random\nexpert_init:\n"
     "  method: copy\n  'method': copy\n", ["key 'method' is given twice", "line 5 and line 6"]),
    ("recursive-alias", "base_model: {base}\nnum_experts: 2\nextra: &a [1, *a]\n", ["recursive anchor"]),
    ("bool-experts-per-token", GOOD + "experts_per_token: yes\n",
     ["experts_per_token: true is a boolean, not a number"]),
    ("bool-num-experts", GOOD.replace("num_experts: 2", "num_experts: on"), ["num_experts: true is a boolean"]),
    ("bool-seed", GOOD + "seed: no\n", ["seed: false is a boolean, not a number"]),
    ("bool-in-layers", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n"
     "    layers: [false, 2]\n  - source_model: {base}\n", ["experts[0].layers: false is a boolean"]),
    ("bool-granularity", GOOD + "expert_init: {{method: split, granularity: yes}}\n",
     ["expert_init.granularity: true is a boolean"]),
    ("bool-scale", GOOD + "gate_scale: yes\n", ["gate_scale: true is a boolean"]),
    ("number-for-bool", GOOD + "checksums: 1\n", ["checksums: 1 is not a boolean; write true or false"]),
    ("string-for-bool", GOOD + "output_router_logits: 'off'\n", ["output_router_logits: 'off' is not a boolean"]),
    ("huge-experts-per-token", GOOD + "experts_per_token: 1000000\n", ["experts_per_token"]),
    ("huge-batch", GOOD + "batch_size: 100000000\n", ["batch_size", "100000000 is too large; write at most 65536"]),
    ("huge-num-experts", GOOD.replace("num_experts: 2", "num_experts: 1000000000"), ["num_experts", "1024"]),
    ("too-many-experts", "base_model: {base}\ngate_mode: random\nexperts:\n" + "  - source_model: {base}\n" * 1025,
     ["experts: List should have at most 1024 items"]),
    ("shard-bare-fraction", GOOD + "max_shard_size: 1.9\n", ["max_shard_size: 1.9 is not a whole number of bytes",
                                                              "1.9GB"]),
    ("shard-string-fraction", GOOD + "max_shard_size: '1.9'\n", ["'1.9' is not a whole number of bytes"]),
    ("shard-tiny", GOOD + "max_shard_size: 5\n", ["max_shard_size: 5 is 5 bytes", "5GB"]),
    ("shard-bool", GOOD + "max_shard_size: yes\n", ["max_shard_size"]),
    ("empty-base-model", GOOD.replace("base_model: {base}", "base_model: ''"), ["base_model: empty text; write the model: org/name (a hub id) or a folder"]),
    # numbers, booleans and lists where text goes: pydantic said "Input should be a valid string"
    ("number-device", GOOD + "device: 0\n", ["device: 0 is a number, not text", "cuda:0 for GPU 0"]),
    ("number-output", GOOD + "output: 2024\n", ["output: 2024 is a number, not text", "output: '2024'"]),
    ("octal-looking-output", GOOD + "output: 017\n", ["output: 15 is a number, not text", "output: '15'"]),
    ("list-output", GOOD + "output: [a, b]\n", ["output: a list of 2 items, not text; write one name or path"]),
    ("number-base-model", GOOD.replace("base_model: {base}", "base_model: 7"), ["base_model: 7 is a number"]),
    ("number-expert-init", GOOD + "expert_init: 2\n", ["expert_init: 2 is not an init",
                                                       "copy, noise, drop, split", "{method: drop, ratio: 0.5}"]),
    ("list-expert-init-in-expert", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n"
     "    expert_init: [drop, 0.5]\n  - source_model: {base}\n", ["experts[0].expert_init: a list of 2 items is not an init"]),
    ("string-in-layers", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n"
     "    layers: [0, end]\n  - source_model: {base}\n",
     ["experts[0].layers: item 1 is \"end\", so it is not a layer range", "[0, 24]"]),
    ("one-number-layers", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n"
     "    layers: 4\n  - source_model: {base}\n", ["experts[0].layers: 4 is not a layer range; write two whole numbers"]),
    # YAML 1.1 reads 2024-01-01 as a date and !!binary as bytes: named as such, not as Python's repr
    ("date-prompt", "base_model: {base}\ngate_mode: hidden\nexperts:\n  - source_model: {base}\n"
     "    positive_prompts: [2024-01-01, hello]\n  - source_model: {base}\n    positive_prompts: [x]\n",
     ["experts[0].positive_prompts: prompt 0 is 2024-01-01 (a date to YAML), not text; put the prompt in quotes"]),
    ("date-output", GOOD + "output: 2024-01-01\n", ["output: 2024-01-01 is a date to YAML, not text; write it in "
                                                     "quotes, output: '2024-01-01'"]),
    ("date-seed", GOOD + "seed: 2024-01-01\n", ["seed: 2024-01-01 (a date to YAML) is not a number"]),
    ("binary-seed", GOOD + "seed: !!binary aGVsbG8=\n", ["seed: 5 bytes of binary data (YAML's !!binary)"]),
    ("nan-scale", GOOD + "router_init_std: .nan\n", ["router_init_std: .nan (not a number, or infinity) is not a "
                                                      "finite number; write an ordinary number"]),
    # text pydantic reads as a float: before, TypeError '>' not supported between 'str' and 'int' (fuzz_inputs.py)
    ("nan-text-scale", GOOD + "router_init_std: NaN\n", ["router_init_std: 'NaN' (not a number, or infinity) is not "
                                                          "a finite number; write an ordinary number"]),
    ("inf-text-scale", GOOD + "gate_scale: -Infinity\n", ["gate_scale: '-Infinity' (not a number, or infinity)"]),
    ("inf-noise", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n"
     "    noise_scale: -.inf\n  - source_model: {base}\n", ["experts[0].noise_scale: -.inf (not a number, or infinity)"]),
    ("short-layers", "base_model: {base}\ngate_mode: random\nexperts:\n  - source_model: {base}\n"
     "    layers: [4]\n  - source_model: {base}\n", ["experts[0].layers: [4] is not a layer range"]),
]


@pytest.mark.parametrize("case_id,text,words", CASES, ids=[c[0] for c in CASES])
def test_ambiguous_recipe_refused(case_id, text, words, tiny_llama, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text.format(base=tiny_llama))
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target)
    assert_clean_failure(code, output, target, words)


def test_cli_max_shard_size_fraction_refused(tiny_llama, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(GOOD.format(base=tiny_llama))
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target, "--max-shard-size", "1.9")
    assert_clean_failure(code, output, target, ["'1.9' is not a whole number of bytes"])


def _bomb_levels(levels: int) -> list[str]:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return lines


@pytest.mark.parametrize("where", ["unknown-key", "in-a-field", "nested-in-expert", "prompt-list", "enum-field"])
def test_alias_bomb_fails_fast_with_bounded_memory(where, tiny_llama, tmp_path):
    """10^12 values if expanded: refused in well under a second, without the memory growing."""
    bomb = _bomb_levels(12)
    last = "*l11"
    if where == "unknown-key":  # the unknown key's value must not be expanded to format the error
        text = f"base_model: {tiny_llama}\nnum_experts: 2\n" + "\n".join(bomb) + "\n"
    elif where == "enum-field":  # a literal_error quotes its input: it must not be expanded to do so
        text = "\n".join(bomb) + f"\nbase_model: {tiny_llama}\nnum_experts: 2\ngate_mode: {last}\n"
    elif where == "in-a-field":
        text = "anchors:\n" + "\n".join("  " + b for b in bomb) + f"\nbase_model: {tiny_llama}\nnum_experts: {last}\n"
    elif where == "nested-in-expert":
        text = ("x: &x\n" + "\n".join("  " + b for b in bomb) + f"\nbase_model: {tiny_llama}\ngate_mode: random\n"
                f"experts:\n  - source_model: {tiny_llama}\n    positive_prompts: {last}\n")
    else:
        text = ("\n".join(bomb) + f"\nbase_model: {tiny_llama}\ngate_mode: random\nexperts:\n"
                f"  - source_model: {tiny_llama}\n    positive_prompts: [" + ", ".join(["*l11"] * 3) + "]\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    target = tmp_path / "moe"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    code, output = cli("build", cfg, target)
    assert time.monotonic() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: < 200 MB more
    assert_clean_failure(code, output, target, ["expands to more than 200000 values", "anchors and aliases"])
    assert len(output) < 2000


def test_alias_bomb_in_prompt_file_refused(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text("\n".join(_bomb_levels(12)) + "\nprompts: *l11\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n  - source_model: {tiny_llama}\n"
                   f"    positive_prompts_from: {prompts}\n  - source_model: {tiny_llama}\n")
    target = tmp_path / "moe"
    start = time.monotonic()
    code, output = cli("build", cfg, target)
    assert time.monotonic() - start < 5
    assert_clean_failure(code, output, target, ["prompts.yaml", "expands to more than 200000 values"])


def test_small_aliases_and_merge_keys_still_work(tiny_llama, tmp_path):
    """Anchors, aliases and merge keys are fine; a merge key overridden by an explicit key is not a duplicate."""
    from moe_upcycle.recipe.schema import load_config

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n  - &first\n    source_model: {tiny_llama}\n"
                   f"    name: a\n    positive_prompts: [a, b]\n  - <<: *first\n    name: b\n")
    config = load_config(cfg)
    assert [e.name for e in config.experts] == ["a", "b"]
    assert config.experts[1].positive_prompts == ["a", "b"]
