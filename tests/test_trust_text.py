"""Text and paths a user gives (issue 13): invalid Unicode in prompts, non-UTF-8 prompt files, a
tokenizer that emits ids past the model's vocabulary, symlink loops — each a named error with
exit code 1, no traceback and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from failure_checks import assert_clean_failure, cli, run_module

STORIES_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def foreign_tokenizer_llama(tiny_llama, stories, tmp_path) -> Path:
    """tiny_llama (300 embedding rows) with stories260K's tokenizer (512 ids) copied over its own."""
    folder = tmp_path / "llama-wrong-tok"
    shutil.copytree(tiny_llama, folder)
    for name in STORIES_TOKENIZER:
        shutil.copy(stories / name, folder / name)
    return folder


def test_invalid_unicode_prompt_in_recipe(tiny_llama, tmp_path):
    cfg = _write(tmp_path / "cfg.yaml", f'base_model: {tiny_llama}\ngate_mode: cheap_embed\nexperts:\n'
                                        f'  - source_model: {tiny_llama}\n    positive_prompts: ["ok", "bad \\ud800 text"]\n'
                                        f'  - source_model: {tiny_llama}\n    positive_prompts: [fine]\n')
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target)
    assert_clean_failure(code, output, target, ["experts[0].positive_prompts: prompt 1 contains an invalid Unicode",
                                                "lone surrogate U+D800 at position 4"])


def test_invalid_unicode_in_prompt_file(tiny_llama, tmp_path):
    prompts = _write(tmp_path / "p.json", json.dumps(["fine", "bad \ud800"]))
    cfg = _write(tmp_path / "cfg.yaml", f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n"
                                        f"  - source_model: {tiny_llama}\n    positive_prompts_from: {prompts}\n"
                                        f"  - source_model: {tiny_llama}\n")
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target)
    assert_clean_failure(code, output, target, [f"{prompts}: prompt 1", "lone surrogate U+D800"])


def test_non_utf8_prompt_file(tiny_llama, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"caf\xe9 au lait\nsecond prompt\n")  # Latin-1, not UTF-8
    cfg = _write(tmp_path / "cfg.yaml", f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n"
                                        f"  - source_model: {tiny_llama}\n    positive_prompts_from: {prompts}\n"
                                        f"  - source_model: {tiny_llama}\n")
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target)
    assert_clean_failure(code, output, target, [f"{prompts}: not UTF-8 text (byte 0xe9 at position 3 is not UTF-8",
                                                "re-save it as UTF-8"])


def test_non_utf8_route_prompts(tiny_llama, tmp_path):
    cfg = _write(tmp_path / "cfg.yaml", f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n")
    assert cli("build", cfg, tmp_path / "moe")[0] == 0
    prompts = tmp_path / "p.txt"
    prompts.write_bytes("Once upon a time\n".encode("utf-16"))  # Notepad's "Unicode"
    code, output = cli("route", tmp_path / "moe", "--prompts", prompts)
    assert code == 1 and "Traceback" not in output
    assert "not UTF-8 text (it is UTF-16, what Windows calls 'Unicode'); re-save it as UTF-8" in " ".join(output.split())


BOM = b"\xef\xbb\xbf"  # what Notepad writes at the start of a UTF-8 file


@pytest.mark.parametrize("name,data", [
    ("p.txt", BOM + b"Once upon a time\nThe cat sat\n"),
    ("p.jsonl", BOM + b'{"text": "Once upon a time"}\n{"text": "The cat sat"}\n'),
    ("p.json", BOM + b'["Once upon a time", "The cat sat"]'),
    ("p.yaml", BOM + b"- Once upon a time\n- The cat sat\n"),
])
def test_a_byte_order_mark_is_not_part_of_the_first_prompt(name, data, tmp_path):
    """Before, a UTF-8 text file saved with a byte-order mark gave a first prompt starting with U+FEFF, which the
    tokenizer reads as a token of its own: the expert's router row was computed from another text."""
    from moe_upcycle.check.route_eval import read_labeled
    from moe_upcycle.prompts.pool import read_pool_file
    from moe_upcycle.recipe.calibration import read_documents
    from moe_upcycle.recipe.prompt_sets import read_prompt_file

    path = tmp_path / name
    path.write_bytes(data)
    expected = ["Once upon a time", "The cat sat"]
    if name != "p.jsonl":
        assert read_prompt_file(path) == expected
    if name in ("p.txt", "p.jsonl"):
        assert read_pool_file(path).prompts == expected
        assert read_documents(path) == (expected if name == "p.jsonl" else ["Once upon a time\nThe cat sat"])
        labeled = tmp_path / "labeled.txt"
        labeled.write_bytes(BOM + b"story\tOnce upon a time\n")
        assert read_labeled(labeled) == (["Once upon a time"], ["story"])


@pytest.mark.parametrize("gate_mode", ["cheap_embed", "hidden"])
def test_tokenizer_ids_past_vocab_refused(gate_mode, foreign_tokenizer_llama, tmp_path):
    base = foreign_tokenizer_llama
    cfg = _write(tmp_path / "cfg.yaml", f"base_model: {base}\ngate_mode: {gate_mode}\ndevice: cpu\nexperts:\n"
                                        f"  - source_model: {base}\n    positive_prompts: [Once upon a time a dragon loved math]\n"
                                        f"  - source_model: {base}\n    positive_prompts: [Write code in Python for a list]\n")
    target = tmp_path / "moe"
    code, output = cli("build", cfg, target)
    assert_clean_failure(code, output, target, [f"tokenizer {base} produced token id", "only 300 embedding rows",
                                                "do not belong to this model"])


def test_route_and_verify_with_foreign_tokenizer_refused(tiny_llama, stories, tmp_path):
    cfg = _write(tmp_path / "cfg.yaml", f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n")
    moe = tmp_path / "moe"
    assert cli("build", cfg, moe)[0] == 0
    for name in STORIES_TOKENIZER:
        shutil.copy(stories / name, moe / name)
    prompts = _write(tmp_path / "p.txt", "Once upon a time a dragon loved math\n")
    code, output = cli("route", moe, "--prompts", prompts, "--device", "cpu")
    assert code == 1 and "produced token id" in output and "only 300 embedding rows" in " ".join(output.split())
    assert "Traceback" not in output
    code, output = cli("verify", moe, "--base", tiny_llama, "--prompts", prompts, "--skip-hashes")
    assert code == 1 and "produced token id" in output and "Traceback" not in output, output


def _loop(folder: Path) -> Path:
    (folder / "loop_a").symlink_to(folder / "loop_b")
    (folder / "loop_b").symlink_to(folder / "loop_a")
    return folder / "loop_a"


@pytest.mark.parametrize("where", ["base_model", "expert", "output", "output-force", "output-child", "verify",
                                   "demo", "prompt-file", "config-file"])
def test_symlink_loop_named(where, tiny_llama, tmp_path):
    loop = _loop(tmp_path)
    good = f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n"
    target = tmp_path / "moe"
    args: list = []
    if where == "base_model":
        args = ["build", _write(tmp_path / "cfg.yaml", good.replace(str(tiny_llama), str(loop))), target]
    elif where == "expert":
        args = ["build", _write(tmp_path / "cfg.yaml", f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n"
                                                       f"  - source_model: {tiny_llama}\n  - source_model: {loop}\n"),
                target]
    elif where.startswith("output"):
        out = loop / "x" if where == "output-child" else loop
        args = ["build", _write(tmp_path / "cfg.yaml", good), out] + (["--force"] if where == "output-force" else [])
    elif where == "verify":
        args = ["verify", loop]
    elif where == "demo":
        args = ["demo", loop]
    elif where == "prompt-file":
        args = ["build", _write(tmp_path / "cfg.yaml", f"base_model: {tiny_llama}\ngate_mode: random\nexperts:\n"
                                                       f"  - source_model: {tiny_llama}\n    positive_prompts_from: {loop}\n"
                                                       f"  - source_model: {tiny_llama}\n"), target]
    else:
        args = ["build", loop, target]
    code, output = cli(*args)
    flat = " ".join(output.split())
    assert code == 1, output
    assert "Traceback" not in output and str(loop) in flat
    assert "symlink loop" in flat
    assert not target.exists() and (tmp_path / "loop_a").is_symlink()


def test_symlink_loop_real_process_no_traceback(tiny_llama, tmp_path):
    loop = _loop(tmp_path)
    code, output = run_module("build", _write(tmp_path / "cfg.yaml", f"base_model: {tiny_llama}\nnum_experts: 2\n"
                                                                      f"gate_mode: random\n"), loop)
    assert code == 1 and "symlink loop" in output and "Traceback" not in output, output


@pytest.mark.parametrize("folder", ["tiny", "stories"])
def test_verify_dense_folder_fails(folder, tiny_llama, stories):
    dense = tiny_llama if folder == "tiny" else stories
    code, output = cli("verify", dense, "--base", dense)
    flat = " ".join(output.split())
    assert code == 1, output
    assert "is a dense model (model_type 'llama'" in flat and "not a Mixture-of-Experts" in flat
    assert "PASSED" not in output and "Traceback" not in output
