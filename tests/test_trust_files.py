"""Hostile or broken files around a build: what ``--force`` may replace, and checkpoint files that
lie about what transformers would load. Each case asserts the exit code, the message naming the
file or entry, and that every file a user owns survives byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from failure_checks import cli, leftovers

GOOD = "base_model: {base}\nnum_experts: 2\ngate_mode: random\n"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _flat(output: str) -> str:
    return " ".join(output.split())


def _recipe(folder: Path, base: Path) -> Path:
    cfg = folder / "cfg.yaml"
    cfg.write_text(GOOD.replace("{base}", str(base)))
    return cfg


# ---------------------------------------------------------------------------------------------
# --force over a previous build: only a folder holding nothing but that build's files is replaced.


@pytest.fixture(scope="module", params=["checksums", "no-checksums"])
def previous(request, tiny_llama, tmp_path_factory) -> Path:
    """A real earlier build (with and without shard checksums in its manifest)."""
    folder = tmp_path_factory.mktemp("previous")
    args = ["--no-checksums"] if request.param == "no-checksums" else []
    code, output = cli("build", _recipe(folder, tiny_llama), folder / "out", *args)
    assert code == 0, output
    return folder / "out"


def _add_file(out: Path) -> str:
    (out / "notes.txt").write_text("three weeks of notes")
    return "notes.txt"


def _add_folder(out: Path) -> str:
    (out / "checkpoint-500").mkdir()
    (out / "checkpoint-500" / "optimizer.pt").write_bytes(b"state")
    return "checkpoint-500/"


def _add_git(out: Path) -> str:
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return ".git/"


def _add_link(out: Path) -> str:
    (out / "data").symlink_to(out.parent, target_is_directory=True)
    return "data"


def _edit_config(out: Path) -> str:
    (out / "config.json").write_text((out / "config.json").read_text().replace("{", '{\n  "my_edit": 1,', 1))
    return "config.json (changed since the build)"


def _edit_card(out: Path) -> str:
    with open(out / "README.md", "a") as fh:
        fh.write("\nMy evaluation notes.\n")
    return "README.md (changed since the build)"


def _fine_tuned_over_it(out: Path) -> str:
    """save_pretrained of a fine-tuned model into the folder rewrites the config and the shards."""
    shard = next(out.glob("model-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-4:] = b"\x01\x02\x03\x04"
    shard.write_bytes(bytes(raw))
    (out / "config.json").write_text((out / "config.json").read_text() + " ")
    return "config.json (changed since the build)"


@pytest.mark.parametrize("change", [_add_file, _add_folder, _add_git, _add_link, _edit_config, _edit_card,
                                    _fine_tuned_over_it], ids=lambda f: f.__name__.strip("_"))
def test_force_keeps_previous_build_holding_user_files(change, previous, tiny_llama, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(previous, out, symlinks=True)
    named = change(out)
    before = _snapshot(out)
    code, output = cli("build", _recipe(tmp_path, tiny_llama), out, "--force")
    flat = _flat(output)
    assert code == 1, output
    assert "is a previous moe-upcycle output, but it also holds what that build did not write" in flat, output
    assert named in flat and "Move these away" in flat and "Traceback" not in output
    assert _snapshot(out) == before and leftovers(out) == ["out"]


def test_force_replaces_previous_build_copied_elsewhere(previous, tiny_llama, tmp_path):
    """A copied folder has new mtimes in any order: the files are hashed, found unchanged, and replaced."""
    out = tmp_path / "out"
    shutil.copytree(previous, out, copy_function=shutil.copyfile)  # no mtimes kept
    (out / "moe_upcycle.json").touch()
    for path in out.iterdir():
        path.touch()
    code, output = cli("build", _recipe(tmp_path, tiny_llama), out, "--force")
    assert code == 0, output
    assert leftovers(out) == ["out"]
