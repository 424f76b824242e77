"""Every --json result is one JSON document that strict parsers read: whatever stdout's encoding (non-ASCII text
escaped as JSON escapes, not the stream's \\xe9), with NaN/inf as null, and also when there is nothing to report
(lint of a recipe whose gates use no prompts printed a sentence on stdout)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from moe_upcycle import upcycle
from moe_upcycle.terminal.json_text import json_text


def strict(text: str):
    """json.loads that refuses NaN/Infinity, as JSON.parse and jq do."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def cli(*args, encoding: str = "utf-8") -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": encoding}
    return subprocess.run([sys.executable, "-m", "moe_upcycle", *map(str, args)], capture_output=True, timeout=300,
                          env=env)


def test_json_text_is_strict_ascii_json():
    text = json_text({"kl": float("nan"), "ppl": float("inf"), "name": "caf\u00e9 \U0001f680", "n": [1, -math.inf]})
    assert text.isascii()
    assert strict(text) == {"kl": None, "ppl": None, "name": "caf\u00e9 \U0001f680", "n": [1, None]}


@pytest.fixture(scope="module")
def unicode_build(tmp_path_factory, stories_module):
    folder = tmp_path_factory.mktemp("json")
    recipe = folder / "uni.yaml"
    recipe.write_text(
        f"base_model: {stories_module}\nexperts_per_token: 1\ngate_mode: hidden\ndevice: cpu\nexperts:\n"
        f"  - {{source_model: {stories_module}, name: caf\u00e9, positive_prompts: [\"The caf\u00e9 sold coffee.\"]}}\n"
        f"  - {{source_model: {stories_module}, name: \"rocket\U0001f680\", positive_prompts: [\"The rocket flew.\"]}}\n",
        encoding="utf-8")
    upcycle(recipe, folder / "moe")
    (folder / "prompts.txt").write_text("The caf\u00e9 sold coffee.\nOnce upon a time\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def stories_module():
    from pathlib import Path
    return Path(__file__).resolve().parent / "data" / "stories260K"


@pytest.mark.parametrize("command", ["plan", "route", "verify"])
def test_json_is_valid_on_an_ascii_stdout(command, unicode_build):
    args = {"plan": ["plan", unicode_build / "uni.yaml", "--json"],
            "route": ["route", unicode_build / "moe", "--prompts", unicode_build / "prompts.txt", "--json",
                      "--device", "cpu"],
            "verify": ["verify", unicode_build / "moe", "--json", "--device", "cpu", "--skip-hashes"]}[command]
    done = cli(*args, encoding="ascii")
    assert done.returncode == 0, done.stderr.decode()
    data = strict(done.stdout.decode("ascii"))
    text = json.dumps(data, ensure_ascii=False)
    assert "caf\u00e9" in text if command != "verify" else data["ok"] is True


def test_verify_json_has_no_nan_and_a_nan_kl_fails_a_threshold(unicode_build, tmp_path, stories_module):
    """A dense base with an inf weight gives NaN KL and perplexity: the JSON says null, and a NaN KL no longer
    slips past --max-kl (NaN > 0.001 is False, so verify said PASSED, exit 0)."""
    import shutil

    dense = tmp_path / "dense"
    shutil.copytree(stories_module, dense)
    weights = load_file(dense / "model.safetensors")
    weights["model.norm.weight"][0] = float("inf")
    save_file(weights, dense / "model.safetensors", metadata={"format": "pt"})
    done = cli("-q", "verify", unicode_build / "moe", "--base", dense, "--json", "--max-kl", "0.001",
               "--min-agreement", "0", "--skip-hashes", "--device", "cpu")
    data = strict(done.stdout.decode())
    assert done.returncode == 1 and data["ok"] is False
    assert data["comparison"]["mean_kl"] is None
    assert any("mean KL(dense\u2016moe) is nan, not a number to check a threshold against" in p
               for p in data["problems"]), data["problems"]


def test_lint_json_when_nothing_is_linted(tmp_path, stories_module):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {stories_module}\nnum_experts: 4\ngate_mode: random\n")
    done = cli("lint", recipe, "--json")
    assert done.returncode == 0
    data = strict(done.stdout.decode())
    assert data["nothing_to_lint"] == "gate_mode random makes routers without prompts (random rows)"
    assert [data[k] for k in ("experts", "pairs", "offenders", "skipped", "flagged_pairs", "problems")] == [[]] * 6
    # the same keys as a report of a recipe that is linted, so a script reads either
    from moe_upcycle.prompts.lint import LintReport, PAIR_THRESHOLD

    linted = {**LintReport([], [], [], PAIR_THRESHOLD, 0.9, "x").to_dict(), "nothing_to_lint": None}
    assert set(data) == set(linted) and data["pair_threshold"] == PAIR_THRESHOLD
    human = cli("lint", recipe)
    assert human.stdout.decode().strip() == "Nothing to lint: gate_mode random makes routers without prompts " \
                                            "(random rows)."


def test_quiet_verify_prints_no_notes(tmp_path, stories_module):
    """-q: results, warnings and errors only; verify printed its notes anyway (here: the base is gone, so the
    comparison is skipped and said to be)."""
    import shutil

    shutil.copytree(stories_module, tmp_path / "st")
    recipe = tmp_path / "st.yaml"
    recipe.write_text(f"base_model: {tmp_path / 'st'}\nnum_experts: 4\ngate_mode: random\n")
    upcycle(recipe, tmp_path / "moe")
    (tmp_path / "st").rename(tmp_path / "st_gone")
    loud = cli("verify", tmp_path / "moe", "--skip-hashes", "--device", "cpu")
    quiet = cli("-q", "verify", tmp_path / "moe", "--skip-hashes", "--device", "cpu")
    assert loud.returncode == quiet.returncode == 0, loud.stderr.decode()
    assert "note: dense comparison skipped" in loud.stderr.decode()
    assert quiet.stderr.decode() == ""
    assert "PASSED (not compared with a dense base)" in quiet.stdout.decode()


def test_identical_logits_with_masked_entries_compare_as_identical():
    """-inf at the same vocabulary entry in both models (a masked token) is no difference: 0 * log 0 counts 0, and
    -inf - -inf is not NaN here (a NaN KL would now fail verify's thresholds)."""
    import torch

    from moe_upcycle.check.compare import compare_logits

    t = torch.tensor([[1.0, 2.0, -float("inf")], [0.5, -float("inf"), 0.1]])
    same = compare_logits([t], [t.clone()])
    assert (same.max_abs_diff, same.mean_kl, same.max_kl, same.top1_agreement) == (0.0, 0.0, 0.0, 1.0)
    other = t.clone()
    other[0, 2] = 0.0  # the MoE gives the masked token some probability: a finite KL, p = 0 there
    assert math.isfinite(compare_logits([t], [other]).mean_kl) and compare_logits([t], [other]).mean_kl > 0
