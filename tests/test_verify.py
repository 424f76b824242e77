"""`moe-upcycle verify`: passes on good outputs, fails (exit 1, named cause) on damaged ones."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_upcycle import upcycle
from moe_upcycle.cli import app
from moe_upcycle.check.compare import compare_logits
from moe_upcycle.check.verify import IDENTITY_MAX_KL, verify

runner = CliRunner()
SHARD = "model-00001-of-00001.safetensors"
EXPERT_W2 = "model.layers.0.block_sparse_moe.experts.1.w2.weight"


@pytest.fixture(scope="module")
def tiny_moe(tiny_llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "moe"
    upcycle({"base_model": str(tiny_llama), "num_experts": 4, "experts_per_token": 2, "gate_mode": "random"}, out)
    return out


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("# two prompts keep damaged-model tests fast\nOnce upon a time\nThe cat sat on the mat.\n")
    return path


def _damaged_copy(folder: Path, tmp_path: Path, edit) -> Path:
    """Copy a built folder and rewrite its only shard with `edit(tensors)` applied."""
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    tensors = load_file(str(copy / SHARD))
    edit(tensors)
    save_file(tensors, str(copy / SHARD), metadata={"format": "pt"})
    return copy


def _verify_cli(*args: str):
    return runner.invoke(app, ["verify", *map(str, args)])


def test_compare_logits_numbers():
    ref = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])]
    other = [torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]])]
    c = compare_logits(ref, other)
    p = torch.softmax(ref[0][0].double(), -1)
    q = torch.softmax(other[0][0].double(), -1)
    kl0 = float((p * (p / q).log()).sum())
    assert c.positions == 2 and c.max_abs_diff == 2.0 and c.top1_agreement == 0.5
    assert c.mean_kl == pytest.approx(kl0 / 2, rel=1e-12) and c.max_kl == pytest.approx(kl0, rel=1e-12)


def test_verify_passes_on_copy_upcycled_tiny_model(tiny_moe, tiny_llama):
    result = verify(tiny_moe)  # base taken from the recorded recipe
    assert result.ok, result.problems
    assert result.base == str(tiny_llama) and result.loaded_class == "MixtralForCausalLM"
    assert result.num_tensors == result.planned_tensors == 2 + 2 * (6 + 1 + 4 * 3) + 1  # embed, norm, head
    assert (result.num_experts, result.experts_per_token) == (4, 2)
    c = result.comparison
    assert c.max_abs_diff < 1e-5 and c.top1_agreement == 1.0 and c.mean_kl < 1e-10 and c.positions > 50
    assert result.perplexity_moe == pytest.approx(result.perplexity_dense, rel=1e-5)
    assert result.text_tokens == 256  # the shipped text, cut to max_position_embeddings
    assert len(result.continuations) == 3
    assert all(c["dense"] == c["moe"] and c["moe"] for c in result.continuations)
    # function-preserving recipe: the identity thresholds apply by default
    assert (result.max_kl, result.min_agreement) == (IDENTITY_MAX_KL, 0.95)


def test_a_base_other_than_the_recorded_one_is_said(tiny_moe, tiny_llama, tiny_mistral, tmp_path):
    """verify --base ANOTHER measures the distance to that model: a note says so (before, nothing told a
    PASSED against the wrong model from one against the MoE's own base); the same base spelt otherwise, none."""
    other = verify(tiny_moe, base=tiny_mistral, max_new_tokens=1)
    assert [n for n in other.notes if n.startswith("--base")] == [
        f"--base {tiny_mistral} is not the base_model this MoE was built from ({tiny_llama}, as moe_upcycle.json "
        f"records it): the comparison below measures how far the MoE is from {tiny_mistral}, not from its own base"]
    (tmp_path / "link").symlink_to(tiny_llama)
    same = verify(tiny_moe, base=tmp_path / "link", max_new_tokens=1)
    assert same.ok and not [n for n in same.notes if n.startswith("--base")], same.notes


def test_verify_cli_passes_on_stories(stories, tmp_path):
    out = tmp_path / "moe"
    upcycle({"base_model": str(stories), "num_experts": 4, "gate_mode": "random", "dtype": "bfloat16"}, out)
    res = _verify_cli(out, "--json", "--max-new-tokens", "8")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] is True and data["problems"] == []
    assert data["planned_tensors"] == data["num_tensors"] == 97
    c = data["comparison"]
    # bf16 experts vs the fp32 dense model: close, not equal
    assert 0 < c["mean_kl"] < 1e-3 and c["top1_agreement"] >= 0.95
    assert data["perplexity_moe"] == pytest.approx(data["perplexity_dense"], rel=0.02)
    assert data["continuations"][0]["dense"].strip() != ""


def test_verify_fails_when_a_tensor_is_deleted(tiny_moe, tmp_path, prompts_file):
    gone = "model.layers.1.self_attn.k_proj.weight"

    def delete(tensors):
        del tensors[gone]

    damaged = _damaged_copy(tiny_moe, tmp_path, delete)
    index = json.loads((damaged / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    (damaged / "model.safetensors.index.json").write_text(json.dumps(index))
    res = _verify_cli(damaged, "--prompts", prompts_file, "--max-new-tokens", "2")
    assert res.exit_code == 1
    assert f"1 planned tensor(s) missing from the output: {gone}" in res.stderr
    assert "missing key(s) when loading" in res.stderr and gone in res.stderr


def test_verify_fails_when_a_shard_is_truncated(tiny_moe, tmp_path):
    damaged = tmp_path / "truncated"
    shutil.copytree(tiny_moe, damaged)
    shard = damaged / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    res = _verify_cli(damaged, "--json")
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["ok"] is False and data["loaded_class"] is None
    text = "\n".join(data["problems"])
    assert f"{SHARD}: truncated" in text
    assert f"{SHARD}: sha256 differs" in text
    # the damaged file is the finding, said once: not again as its tensors missing, nor as transformers' failure
    assert "planned tensor(s) missing" not in text and "does not load with transformers" not in text
    assert "not loaded with transformers: a weight file cannot be read (see above)" in data["notes"]


def test_verify_fails_when_an_expert_is_corrupted(tiny_moe, tmp_path, prompts_file):
    def corrupt(tensors):
        gen = torch.Generator().manual_seed(0)
        tensors[EXPERT_W2] = torch.randn(tensors[EXPERT_W2].shape, generator=gen) * 50

    damaged = _damaged_copy(tiny_moe, tmp_path, corrupt)
    # without the sha256 check, the numbers alone must catch it
    res = _verify_cli(damaged, "--skip-hashes", "--json", "--prompts", prompts_file, "--max-new-tokens", "2")
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert data["loaded_class"] == "MixtralForCausalLM"  # it loads fine: only the numbers are wrong
    assert data["comparison"]["mean_kl"] > 0.1
    assert len(data["problems"]) >= 1 and all("KL" in p or "top-1" in p for p in data["problems"])
    assert any(p.startswith("mean KL(dense‖moe) is") and "above the threshold 0.001" in p for p in data["problems"])
    # with it, the damaged file is named too
    res = _verify_cli(damaged, "--prompts", prompts_file, "--max-new-tokens", "2")
    assert res.exit_code == 1 and f"{SHARD}: sha256 differs" in res.stderr


def test_verify_fails_on_shape_mismatch_and_wrong_router_fields(tiny_moe, tmp_path, prompts_file):
    def reshape(tensors):
        tensors["model.norm.weight"] = torch.ones(65)

    damaged = _damaged_copy(tiny_moe, tmp_path, reshape)
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["num_experts_per_tok"] = 3
    (damaged / "config.json").write_text(json.dumps(cfg))
    result = verify(damaged, prompts=prompts_file, max_new_tokens=2, hashes=False)
    assert not result.ok
    assert "tensor model.norm.weight: on disk [65] torch.float32, planned [64] torch.float32" in result.problems
    assert "config.json: num_experts_per_tok is 3 but the recipe has 2" in result.problems
    assert result.experts_per_token == 3


def test_thresholds_apply_to_a_model_that_is_meant_to_differ(tiny_llama, tmp_path, prompts_file):
    out = tmp_path / "noisy"
    upcycle({"base_model": str(tiny_llama), "gate_mode": "random",
             "experts": [{"source_model": str(tiny_llama), "noise_scale": 0.05} for _ in range(4)]}, out)
    relaxed = verify(out, prompts=prompts_file, max_new_tokens=2)
    assert relaxed.ok and relaxed.max_kl is None and relaxed.comparison.mean_kl > 1e-6  # no default threshold
    strict = _verify_cli(out, "--prompts", prompts_file, "--max-new-tokens", "2", "--max-kl", "1e-9",
                         "--min-agreement", "1.0")
    assert strict.exit_code == 1 and "above the threshold 1e-09" in strict.stderr


def test_verify_without_recipe_or_base_checks_loading_only(tiny_moe, tmp_path, prompts_file):
    copy = tmp_path / "hub_download"
    shutil.copytree(tiny_moe, copy)
    (copy / "moe_upcycle.json").unlink()
    result = verify(copy, prompts=prompts_file, max_new_tokens=2)
    assert result.ok and result.comparison is None and result.planned_tensors is None
    assert result.loaded_class == "MixtralForCausalLM" and result.num_tensors == 41
    assert any("no moe_upcycle.json" in n for n in result.notes)
    res = _verify_cli(copy, "--prompts", prompts_file, "--max-new-tokens", "2", "--max-kl", "0.1")
    assert res.exit_code == 1 and "--max-kl compare with the dense base, which was not loaded" in res.stderr


def test_verify_errors_name_the_folder(tmp_path):
    res = _verify_cli(tmp_path / "nowhere")
    assert res.exit_code == 1 and "nowhere does not exist" in res.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_on_cuda_matches_cpu(tiny_moe, prompts_file):
    gpu = verify(tiny_moe, prompts=prompts_file, max_new_tokens=2, device="cuda")
    cpu = verify(tiny_moe, prompts=prompts_file, max_new_tokens=2)
    assert gpu.ok and gpu.comparison.top1_agreement == 1.0
    assert gpu.perplexity_moe == pytest.approx(cpu.perplexity_moe, rel=1e-3)


def _json_edit(name: str, edit):
    def change(folder: Path) -> None:
        data = json.loads((folder / name).read_text(encoding="utf-8"))
        edit(data)
        (folder / name).write_text(json.dumps(data, indent=1), encoding="utf-8")
    return change


def _resave_as_transformers_4(folder) -> None:
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    _json_edit("tokenizer_config.json", lambda d: d.update(extra_special_tokens={}, added_tokens_decoder={
        str(t["id"]): {"content": t["content"], "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": t["special"]} for t in added}))(folder)
    base_generation = json.loads((folder / "generation_config.json").read_text())
    assert base_generation["use_cache"] is True and base_generation["output_attentions"] is False  # the defaults
    _json_edit("generation_config.json", lambda d: [d.pop(k) for k in ("output_attentions", "output_hidden_states",
                                                                        "use_cache")])(folder)


def _merges_as_pairs(data: dict) -> None:  # the tokenizers library's other spelling of BPE merges
    data["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in data["model"]["merges"]]


# A folder built elsewhere (mergekit-moe re-saves the tokenizer, writes no generation_config.json):
# edit -> (problem words, note words). Judged by what the files say, not their bytes.
FOREIGN_TOKENIZERS = {
    "resaved_like_mergekit": (_json_edit("tokenizer_config.json", lambda d: d.update(
        is_local=True, local_files_only=True, pad_token="<s>", tokenizer_class="PreTrainedTokenizerFast")),
        [], ['tokenizer_config.json: pad_token unset in the base, "<s>" here (padding only']),
    "no_generation_config": (lambda f: (f / "generation_config.json").unlink(),
                             [], ["config.json carries the same token ids, so generation runs the same"]),
    "reformatted_json": (_json_edit("tokenizer.json", _merges_as_pairs), [], []),
    "instruct_eos_lost": (lambda f: (f / "generation_config.json").unlink(),
                          ["generation_config.json: the base has it but the output does not, so generation loses "
                           "eos_token_id [2, 5], temperature 0.6"], []),
    "chat_template_changed": (_json_edit("tokenizer_config.json", lambda d: d.update(chat_template="{{ x }}")),
                              ["tokenizer_config.json: says something other than the base's",
                               "chat_template unset in the base, \"{{ x }}\" here", "copy the file from the base"], []),
    "vocab_changed": (_json_edit("tokenizer.json", lambda d: d["model"]["vocab"].update(zzz=0)),
                      ["tokenizer.json: says something other than the base's", "model.vocab.zzz unset in the base, 0 here"],
                      []),
    "token_added": (_json_edit("tokenizer.json", lambda d: d["added_tokens"].append(
        {**d["added_tokens"][-1], "id": 999, "content": "<pad>"})),
        ["tokenizer.json: says something other than the base's", "added_tokens a list of"], []),
    "nulls_read_as_unset": (_json_edit("tokenizer_config.json", lambda d: d.update(add_prefix_space=None)), [], []),
    "template_newline_only": (lambda f: (f / "chat_template.jinja").write_text("{{ messages }}\r\n\n"), [], []),
    "template_changed": (lambda f: (f / "chat_template.jinja").write_text("{{ other }}"),
                         ["chat_template.jinja: differs from the base's"], []),
    # transformers 4.57's save_pretrained of a model trained from the base (the README recipe): the tokenizer's
    # added tokens restated in tokenizer_config.json, an empty extra_special_tokens, generation defaults left out
    "resaved_by_transformers_4": (_resave_as_transformers_4, [], []),
    "added_tokens_decoder_changed": (_json_edit("tokenizer_config.json", lambda d: d.update(added_tokens_decoder={
        "0": {"content": "<mask>", "special": True}})),
        ["tokenizer_config.json: says something other than the base's", "added_tokens_decoder unset in the base"], []),
    "generation_setting_changed": (_json_edit("generation_config.json", lambda d: d.update(num_beams=4)),
                                   ["generation_config.json: says something other than the base's",
                                    "num_beams unset in the base, 4 here"], []),
}


@pytest.mark.parametrize("case", sorted(FOREIGN_TOKENIZERS))
def test_tokenizer_files_of_a_folder_built_elsewhere_are_judged_by_content(case, tiny_llama, tiny_moe, tmp_path,
                                                                           prompts_file):
    """Without moe_upcycle.json, a JSON file that differs only in what a save adds (is_local, the class name
    TokenizersBackend / PreTrainedTokenizerFast, merges' spelling) passes; a pad_token or a generation_config.json
    that adds nothing to config.json is a note; anything else (chat template, vocabulary, an instruct model's
    extra end-of-turn id) fails, named."""
    edit, problems, notes = FOREIGN_TOKENIZERS[case]
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    if case.startswith("template_"):
        (base / "chat_template.jinja").write_text("{{ messages }}")
    if case == "instruct_eos_lost":
        (base / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 5],
                                                                 "temperature": 0.6, "do_sample": True}))
    folder = tmp_path / "foreign"
    shutil.copytree(tiny_moe, folder)
    (folder / "moe_upcycle.json").unlink()
    edit(folder)
    result = verify(folder, base, prompts=prompts_file, max_new_tokens=1)
    text = " | ".join(result.problems + result.notes)
    assert result.ok == (not problems), text
    for words in problems:
        assert any(words in p for p in result.problems), (words, result.problems)
    for words in notes:
        assert any(words in n for n in result.notes), (words, result.notes)
    if not problems:
        assert not [p for p in result.problems], result.problems


def test_tokenizer_files_of_our_own_build_must_match_byte_for_byte(tiny_llama, tiny_moe, tmp_path, prompts_file):
    """With moe_upcycle.json the build promised a byte-for-byte copy: even a re-save that changes nothing a
    loader reads is a problem, and a missing generation_config.json is one too."""
    folder = tmp_path / "ours"
    shutil.copytree(tiny_moe, folder)
    _json_edit("tokenizer_config.json", lambda d: d.update(is_local=True))(folder)
    (folder / "generation_config.json").unlink()
    result = verify(folder, tiny_llama, prompts=prompts_file, max_new_tokens=1, hashes=False)
    assert not result.ok
    assert any(p.startswith("tokenizer_config.json: differs from the base's") and "byte for byte" in p
               for p in result.problems), result.problems
    assert any(p.startswith("generation_config.json: the base has it but the output does not; copy it from")
               for p in result.problems), result.problems


def test_files_the_build_did_not_write_that_loaders_read_fail_and_others_are_named(tiny_moe, tiny_llama, tmp_path,
                                                                                   prompts_file):
    """What a loader reads is the output, whatever the build wrote: a stale model.safetensors beside the index
    (transformers loads it first), a second model*.safetensors (llama.cpp's converter reads them all), a
    tokenizer file the build did not copy (AutoTokenizer reads it). Anything else is named, as it gets uploaded."""
    clean = verify(tiny_moe, prompts=prompts_file, max_new_tokens=1)
    assert clean.ok and not any("not written by the build" in n for n in clean.notes), clean.notes
    unhashed = upcycle({"base_model": str(tiny_llama), "num_experts": 2, "gate_mode": "random", "checksums": False},
                       tmp_path / "unhashed").output  # its shards are the ones its (hashed) index lists
    clean = verify(unhashed, prompts=prompts_file, max_new_tokens=1)
    assert clean.ok and not any("not written by the build" in n for n in clean.notes), clean.notes
    snapshot = tmp_path / "snapshot"  # as a Hub download leaves it: every file a link to its blob
    snapshot.mkdir()
    for path in unhashed.iterdir():
        (snapshot / path.name).symlink_to(path)
    clean = verify(snapshot, prompts=prompts_file, max_new_tokens=1)
    assert clean.ok and not any("not written by the build" in n for n in clean.notes), (clean.problems, clean.notes)
    folder = tmp_path / "moe"
    shutil.copytree(tiny_moe, folder)
    tensors = load_file(str(folder / SHARD))
    tensors[EXPERT_W2] = torch.zeros_like(tensors[EXPERT_W2])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    save_file({"x": torch.zeros(1)}, str(folder / "model-extra.safetensors"))
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (folder / "special_tokens_map.json").write_text('{"eos_token": "<unk>"}')
    (folder / "notes.txt").write_text("mine")
    (folder / "checkpoint-500").mkdir()
    (folder / "checkpoint-500" / "optimizer.pt").write_bytes(b"x")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main")
    res = _verify_cli(folder, "--prompts", prompts_file, "--max-new-tokens", "1")
    assert res.exit_code == 1
    err = " ".join(res.stderr.split())
    assert ("model.safetensors: not written by the build, but transformers loads model.safetensors instead of the "
            "index's shards; remove it (or rebuild into an empty folder)") in err
    assert "model-extra.safetensors: not written by the build, but llama.cpp's convert_hf_to_gguf.py reads every" in err
    for name in ("chat_template.jinja", "special_tokens_map.json"):
        assert (f"{name}: not written by the build, but AutoTokenizer reads it, so the tokenizer is no longer the "
                f"base's") in err
    assert "note: not written by the build: checkpoint-500/ (1 file), notes.txt; they are uploaded with the" in err
    assert ".git" not in err
    # the tensors checked are those transformers loads: model.safetensors, not the index's shard
    assert "transformers loads model.safetensors and ignores the index, so model.safetensors is the file checked" in err
    assert {p.name for p in folder.iterdir()} >= {"notes.txt", "checkpoint-500", "model.safetensors"}  # nothing removed


def test_a_copy_upcycle_whose_base_is_gone_passes_unchecked_unless_thresholds_are_given(tiny_llama, tmp_path,
                                                                                         prompts_file):
    """A downloaded copy-upcycle: its base is not on this machine. The recipe's own thresholds are said to be
    unchecked (not blamed on options the user never gave); thresholds the user asked for fail."""
    base = tmp_path / "base"
    shutil.copytree(tiny_llama, base)
    out = tmp_path / "moe"
    upcycle({"base_model": str(base), "num_experts": 2, "experts_per_token": 1, "gate_mode": "random"}, out)
    shutil.rmtree(base)
    res = _verify_cli(out, "--prompts", prompts_file, "--max-new-tokens", "1")
    assert res.exit_code == 0, res.output
    assert "PASSED (not compared with a dense base)" in res.stdout
    data = json.loads(_verify_cli(out, "--prompts", prompts_file, "--max-new-tokens", "1", "--json").stdout)
    assert data["ok"] is True and data["compared_with_base"] is False and data["comparison"] is None
    err = " ".join(res.stderr.split())
    assert "dense comparison skipped" in err and "--max-kl" not in err
    assert ("the experts are unchanged copies of the base, so the MoE should compute what it does (mean KL <= 0.001, "
            "top-1 agreement >= 95%); without the base this was not checked — pass --base DENSE to check it") in err
    res = _verify_cli(out, "--prompts", prompts_file, "--max-new-tokens", "1", "--min-agreement", "0.9")
    assert res.exit_code == 1
    assert ("--min-agreement compare with the dense base, which was not loaded (see the note); pass --base DENSE"
            in " ".join(res.stderr.split()))


def test_a_folder_replaced_while_verify_reads_it_is_said_so(tiny_moe, tmp_path, prompts_file, monkeypatch):
    """`verify OUT` while `build --force` replaces OUT: before, it mixed the two folders and advised removing the
    new build's shards ("not written by the build ... remove it"). A build holding OUT's lock is named at once;
    a swap that happened meanwhile replaces every finding with that fact."""
    import subprocess
    import sys

    from moe_upcycle.check import verify as verify_module
    from moe_upcycle.errors import SourceError

    folder = tmp_path / "moe"
    shutil.copytree(tiny_moe, folder)
    lock = tmp_path / ".moe.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_RDWR)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:  # a build holding the lock, as staged_output does
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SourceError, match=rf"OUT: a build into {folder} is running \(pid {holder.pid}, it holds "):
            verify(folder, prompts=prompts_file, max_new_tokens=1)
    finally:
        holder.kill()
        holder.wait()
    assert verify(folder, prompts=prompts_file, max_new_tokens=1).ok  # a killed build's lock file: not running
    lock.write_text(str(os.getppid()))  # its pid reused by a live process: the lock is still not held
    assert verify(folder, prompts=prompts_file, max_new_tokens=1).ok
    lock.unlink()
    hashes = verify_module.check_hashes

    def swapped_meanwhile(where, recipe, result):  # a build --force finishing while verify reads
        shutil.copytree(where, tmp_path / "new")
        where.rename(tmp_path / "old")
        (tmp_path / "new").rename(where)
        hashes(where, recipe, result)

    monkeypatch.setattr(verify_module, "check_hashes", swapped_meanwhile)
    result = verify(folder, prompts=prompts_file, max_new_tokens=1)
    assert result.problems == [f"{folder} was replaced while verify read it (a build --force into it finished "
                               f"meanwhile), so what it found mixes two builds; run verify again"]


def test_a_tensor_the_index_does_not_list_is_said_to_load(tiny_moe, tmp_path, prompts_file):
    folder = _damaged_copy(tiny_moe, tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    result = verify(folder, prompts=prompts_file, max_new_tokens=1, hashes=False)
    assert (f"{SHARD}: holds model.extra.weight which the index does not list; transformers loads every tensor of a "
            f"shard it reads, so these replace or add to the listed ones — remove them, or rebuild") in result.problems


@pytest.mark.parametrize("which", ["itself", "another_moe"])
def test_an_moe_given_as_the_dense_base_is_refused_before_loading(which, tiny_moe, tmp_path, monkeypatch):
    """`verify OUT --base OUT` (a typo) compared the MoE with itself and PASSED; any MoE as --base is refused,
    from its config.json, before a model is loaded, saying what to give."""
    import moe_upcycle.check.verify as verify_module

    monkeypatch.setattr(verify_module, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    base = tiny_moe
    if which == "another_moe":
        base = tmp_path / "other"
        shutil.copytree(tiny_moe, base)
    result = _verify_cli(tiny_moe, "--base", base)
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in text, text
    assert f"--base: {base} is itself a Mixture-of-Experts (4 experts), not a dense model" in text
    assert "give that folder (the recipe's base_model)" in text and "PASSED" not in text


@pytest.mark.parametrize("written, words", [
    ("base_model: {base}\nexperts:\n  - source_model: {base}\n", "dense base: {base}, as mergekit_moe_config.yml names it"),
    ("base_model: nobody/not-cached-7b\n", "dense comparison skipped: mergekit_moe_config.yml base_model: model "
                                           "'nobody/not-cached-7b' not found"),
    ("base_model: [oops\n", "no dense base to compare with (no recipe); pass --base DENSE"),
])
def test_a_mergekit_moe_output_is_compared_with_the_base_its_config_names(written, words, tiny_llama, tiny_moe,
                                                                         tmp_path, prompts_file):
    """mergekit-moe saves its config as mergekit_moe_config.yml beside the MoE: without --base, verify compares
    with the base_model it names (and says so); one it cannot find or read leaves a note, as before."""
    folder = tmp_path / "mergekit_out"
    shutil.copytree(tiny_moe, folder)
    (folder / "moe_upcycle.json").unlink()
    (folder / "mergekit_moe_config.yml").write_text(written.format(base=tiny_llama), encoding="utf-8")
    result = verify(folder, prompts=prompts_file, max_new_tokens=1)
    assert result.ok, result.problems
    assert any(words.format(base=tiny_llama) in n for n in result.notes), result.notes
    compared = "names it" in words
    assert (result.comparison is not None) == compared
    if compared:
        assert result.base == str(tiny_llama) and result.comparison.mean_kl < IDENTITY_MAX_KL


# ---------------------------------------------------------------------------------------------
# A recipe's relative paths are read from the folder the build ran in; verify and route find them from anywhere.


def test_verify_and_route_find_relative_sources_from_any_folder(tiny_llama, tmp_path, monkeypatch):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(tiny_llama, project / "base")
    (project / "story.txt").write_text("Once upon a time there was a cat\nThe dog ran home\n")
    (project / "code.txt").write_text("def add(a, b): return a + b\nimport numpy as np\n")
    (project / "r.yaml").write_text("base_model: ./base\ngate_mode: hidden\nexperts:\n"
                                    "  - source_model: ./base\n    name: story\n    positive_prompts_from: story.txt\n"
                                    "  - source_model: ./base\n    name: code\n    positive_prompts_from: code.txt\n")
    monkeypatch.chdir(project)
    result = CliRunner().invoke(app, ["build", "r.yaml", "-o", "out/moe"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((project / "out/moe/moe_upcycle.json").read_text())
    # every local path relative to the output itself (the manifest is uploaded with it)
    assert manifest["paths_relative_to"] == "." and manifest["config"]["base_model"] == "../../base"
    assert [e["positive_prompts_from"] for e in manifest["config"]["experts"]] == ["../../story.txt", "../../code.txt"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    got = verify(project / "out/moe", device="cpu", max_new_tokens=2)
    assert got.ok, got.problems
    assert got.planned_tensors > 0 and not any("could not re-make the plan" in n for n in got.notes), got.notes
    assert got.base == str(project / "base"), got.base
    labeled = elsewhere / "labeled.jsonl"
    labeled.write_text('{"text": "Once upon a time"}\n{"text": "def f(): pass", "expert": "code"}\n')
    result = CliRunner().invoke(app, ["route", str(project / "out/moe"), "--labeled", str(labeled), "--label-by",
                                      "embedding", "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["experts"] == ["story", "code"]

    # a manifest written before the field existed: relative paths are read from the current folder, as then
    del manifest["paths_relative_to"]
    (project / "out/moe/moe_upcycle.json").write_text(json.dumps(manifest))
    got = verify(project / "out/moe", device="cpu", max_new_tokens=2, hashes=False)
    assert any("its config is unreadable" in n and "story.txt" in n for n in got.notes), got.notes


def test_recorded_config_keeps_hub_ids_sets_and_absolute_paths(tmp_path):
    from moe_upcycle.planning.replan import recorded_config

    build_dir = tmp_path / "proj"
    (build_dir / "models" / "base").mkdir(parents=True)
    (build_dir / "models" / "lora").mkdir()
    (build_dir / "code").write_text("a file named like the shipped set\n")
    (build_dir / "mine.txt").write_text("a prompt\n")
    (build_dir / "out").mkdir()
    config = {"base_model": "models/base", "calibration_text": "mine.txt", "experts": [
        {"source_model": "org/name", "positive_prompts_from": "code"},
        {"source_model": "models/base+models/lora", "negative_prompts_from": "mine.txt"},
        {"source_model": str(tmp_path / "abs"), "positive_prompts_from": "gone.txt"}]}
    got = recorded_config({"config": config, "paths_relative_to": ".."}, build_dir / "out")
    assert got["base_model"] == str(build_dir / "models/base")
    assert got["calibration_text"] == str(build_dir / "mine.txt")
    assert got["experts"] == [
        {"source_model": "org/name", "positive_prompts_from": "code"},  # a hub id; the set wins over a file, as in build
        {"source_model": f"{build_dir / 'models/base'}+{build_dir / 'models/lora'}",
         "negative_prompts_from": str(build_dir / "mine.txt")},
        {"source_model": str(tmp_path / "abs"), "positive_prompts_from": "gone.txt"}]
    assert recorded_config({"config": config}, build_dir / "out") is config
    assert recorded_config({}, build_dir / "out") is None
    # ./x is the build folder's even when gone (the output was copied elsewhere): the message names where it looked
    moved = tmp_path / "elsewhere" / "out"
    moved.mkdir(parents=True)
    got = recorded_config({"config": {"base_model": "./models/base"}, "paths_relative_to": ".."}, moved)
    assert got["base_model"] == str(tmp_path / "elsewhere" / "models" / "base")


def test_a_recipe_of_absolute_paths_is_recorded_relative_to_the_output(tiny_llama, tmp_path, monkeypatch):
    """Absolute paths are recorded relative to the output too (an absolute path names the machine's folders);
    a hub id stays a hub id and gets no paths_relative_to."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_llama, tmp_path / "base")
    result = upcycle({"base_model": str(tmp_path / "base"), "num_experts": 2, "gate_mode": "random"},
                     tmp_path / "out" / "moe")
    manifest = json.loads((result.output / "moe_upcycle.json").read_text())
    assert (manifest["config"]["base_model"], manifest["paths_relative_to"]) == ("../../base", ".")


def test_verify_prompts_file_of_records_is_read_as_route_reads_it(tmp_path):
    """`verify --prompts prompts.jsonl` gave each line's JSON text as a prompt (route read the records)."""
    from moe_upcycle.check.verify import read_prompts

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "Once upon a time"}\n{"instruction": "Write a poem"}\n')
    text = tmp_path / "p.txt"
    text.write_text("# a comment\nOnce upon a time\n\n{not json, a prompt}\n")
    assert read_prompts(jsonl) == ["Once upon a time", "Write a poem"]
    assert read_prompts(text) == ["Once upon a time", "{not json, a prompt}"]
