"""The tool removes or replaces only folders it wrote (issue 13): `demo DIR`, `build ... --force` on
the current folder, an ancestor of the recipe or of a source, a symlink to a user's folder, or any
folder without our manifest — each refused, with real files that must survive byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from failure_checks import cli, leftovers

OURS = json.dumps({"tool": "moe-upcycle", "version": "0.1"})


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes), to prove nothing was touched."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _project(folder: Path) -> Path:
    """A user's project folder: files and a sub-folder that must survive."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("three weeks of notes")
    (folder / "src").mkdir(exist_ok=True)
    (folder / "src" / "train.py").write_text("print('hi')\n")
    return folder


def _recipe(folder: Path, base: Path, name: str = "cfg.yaml") -> Path:
    cfg = folder / name
    cfg.write_text(f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n")
    return cfg


def _flat(output: str) -> str:
    return " ".join(output.split())


def test_demo_refuses_current_project_folder(tmp_path, monkeypatch):
    project = _project(tmp_path / "project")
    before = _snapshot(project)
    monkeypatch.chdir(project)
    code, output = cli("demo", ".")
    assert code == 1, output
    flat = _flat(output)
    assert "is not empty" in flat and "notes.txt" in flat and "src/" in flat and "Traceback" not in output
    assert _snapshot(project) == before


def test_demo_refuses_named_user_folder_and_file(tmp_path):
    project = _project(tmp_path / "work")
    before = _snapshot(project)
    code, output = cli("demo", project)
    assert code == 1 and "was not made by moe-upcycle demo" in _flat(output), output
    assert _snapshot(project) == before
    file = tmp_path / "afile"
    file.write_text("keep")
    code, output = cli("demo", file)
    assert code == 1 and "is a file" in _flat(output) and file.read_text() == "keep"


def test_demo_refuses_a_build_folder(tiny_llama, tmp_path):
    """A build's folder carries our manifest, but it is not the demo's: its record must not be overwritten."""
    cfg = _recipe(tmp_path, tiny_llama)
    out = tmp_path / "out"
    assert cli("build", cfg, out)[0] == 0
    before = _snapshot(out)
    code, output = cli("demo", out)
    assert code == 1 and "was not made by moe-upcycle demo" in _flat(output), output
    assert _snapshot(out) == before


def test_demo_reruns_in_its_own_folder_and_keeps_other_files(tmp_path):
    folder = tmp_path / "demo_out"
    code, output = cli("demo", folder)
    assert code == 0, output
    assert json.loads((folder / "moe_upcycle.json").read_text())["kind"] == "demo"
    (folder / "my_notes.txt").write_text("added by the user")
    first = (folder / "moe" / "moe_upcycle.json").stat().st_mtime_ns
    code, output = cli("demo", folder)
    assert code == 0, output
    assert (folder / "my_notes.txt").read_text() == "added by the user"  # not the demo's: kept
    assert (folder / "moe" / "moe_upcycle.json").stat().st_mtime_ns > first  # the demo's own moe/ was rewritten
    # (a file the user put inside moe/ or dense/ is kept too: tests/test_trust_files.py)
    assert sorted(p.name for p in folder.iterdir()) == ["dense", "moe", "moe_upcycle.json", "my_notes.txt"]


def test_build_force_on_current_folder_keeps_recipe_and_files(tiny_llama, tmp_path, monkeypatch):
    project = _project(tmp_path / "project")
    _recipe(project, tiny_llama)
    (project / "moe_upcycle.json").write_text(OURS)  # even a folder that looks like ours
    before = _snapshot(project)
    monkeypatch.chdir(project)
    code, output = cli("build", "cfg.yaml", ".", "--force")
    assert code == 1, output
    assert "is the current folder" in _flat(output) and "Traceback" not in output
    assert _snapshot(project) == before
    assert leftovers(project) == ["project"]  # no lock or staging folder beside it


def test_build_into_empty_current_folder_refused(tiny_llama, tmp_path, monkeypatch):
    cfg = _recipe(tmp_path, tiny_llama)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    code, output = cli("build", cfg, ".")
    assert code == 1 and "is the current folder" in _flat(output), output
    assert here.is_dir() and list(here.iterdir()) == [] and leftovers(here) == ["here"]


def test_build_force_on_ancestor_of_current_folder(tiny_llama, tmp_path, monkeypatch):
    top = _project(tmp_path / "top")
    (top / "moe_upcycle.json").write_text(OURS)
    cfg = _recipe(tmp_path, tiny_llama)
    before = _snapshot(top)
    monkeypatch.chdir(top / "src")
    code, output = cli("build", cfg, top, "--force")
    assert code == 1 and "an ancestor of the current folder" in _flat(output), output
    assert _snapshot(top) == before


@pytest.mark.parametrize("depth", ["recipe-inside", "recipe-below"])
def test_build_force_on_folder_holding_the_recipe(depth, tiny_llama, tmp_path):
    out = _project(tmp_path / "out")
    (out / "moe_upcycle.json").write_text(OURS)  # looks like a previous build
    cfg = _recipe(out if depth == "recipe-inside" else out / "src", tiny_llama)
    before = _snapshot(out)
    code, output = cli("build", cfg, out, "--force")
    assert code == 1, output
    assert f"holds {cfg.resolve()}, an input of this command" in _flat(output)
    assert _snapshot(out) == before and leftovers(out) == ["out"]


def test_build_force_on_ancestor_of_source_model(tiny_llama, tmp_path):
    import shutil

    parent = tmp_path / "models"
    base = parent / "llama"
    shutil.copytree(tiny_llama, base)
    (parent / "moe_upcycle.json").write_text(OURS)
    cfg = _recipe(tmp_path, base)
    before = _snapshot(parent)
    code, output = cli("build", cfg, parent, "--force")
    assert code == 1 and "overlaps the source model folder" in _flat(output), output
    assert _snapshot(parent) == before


@pytest.mark.parametrize("manifest", [None, "{}", '{"tool": "mergekit"}', "not json", "[1, 2]", "dir"])
def test_build_force_on_folder_without_our_manifest(manifest, tiny_llama, tmp_path):
    out = _project(tmp_path / "out")
    if manifest == "dir":
        (out / "moe_upcycle.json").mkdir()
    elif manifest is not None:
        (out / "moe_upcycle.json").write_text(manifest)
    cfg = _recipe(tmp_path, tiny_llama)
    before = _snapshot(out)
    code, output = cli("build", cfg, out, "--force")
    assert code == 1, output
    flat = _flat(output)
    assert "was not written by moe-upcycle" in flat and "notes.txt" in flat and "Traceback" not in output
    assert _snapshot(out) == before and leftovers(out) == ["out"]


def test_build_force_through_symlink_to_user_folder(tiny_llama, tmp_path):
    project = _project(tmp_path / "project")
    link = tmp_path / "out"
    link.symlink_to(project, target_is_directory=True)
    cfg = _recipe(tmp_path, tiny_llama)
    before = _snapshot(project)
    code, output = cli("build", cfg, link, "--force")
    assert code == 1 and "was not written by moe-upcycle" in _flat(output), output
    assert _snapshot(project) == before and link.is_symlink()


def test_build_force_replaces_previous_build(tiny_llama, tmp_path):
    cfg = _recipe(tmp_path, tiny_llama)
    out = tmp_path / "out"
    assert cli("build", cfg, out)[0] == 0
    (out / "README.md").unlink()  # removing one of the build's own files does not make the folder a user's
    code, output = cli("build", cfg, out, "--force")
    assert code == 0, output
    assert (out / "README.md").is_file() and json.loads((out / "moe_upcycle.json").read_text())["tool"] == "moe-upcycle"
    assert leftovers(out) == ["out"]


def test_folder_swapped_for_user_files_during_build_is_kept(tmp_path):
    """The ownership check runs again at the final swap: a folder that stopped being ours is kept."""
    from moe_upcycle.errors import OutputError
    from moe_upcycle.checkpoint.output_dir import staged_output

    out = tmp_path / "out"
    out.mkdir()
    (out / "moe_upcycle.json").write_text(OURS)
    with pytest.raises(OutputError, match="was not written by moe-upcycle"):
        with staged_output(out, force=True) as stage:
            (stage / "new.txt").write_text("new")
            os.remove(out / "moe_upcycle.json")
            (out / "thesis.tex").write_text("user's")
    assert (out / "thesis.tex").read_text() == "user's" and leftovers(out) == ["out"]


@pytest.mark.parametrize("where,words", [
    ("a-file", ["exists and is a file; choose another output path"]),
    ("under-a-file", ["is a file, not a folder, so the output cannot go under it"]),
    ("in-the-source", ["overlaps the source model folder"]),
    ("the-project", ["it is never replaced, with or without --force"]),
])
def test_plan_refuses_an_output_the_build_would_refuse(where, words, tiny_llama, tmp_path, monkeypatch):
    """`plan -o X` says what `build` would say of X, whatever its --force; it writes and creates nothing."""
    project = _project(tmp_path / "project")
    monkeypatch.chdir(project)
    cfg = _recipe(tmp_path, tiny_llama)
    target = {"a-file": project / "notes.txt", "under-a-file": project / "notes.txt" / "moe",
              "in-the-source": tiny_llama / "moe", "the-project": project}[where]
    before, source_before = _snapshot(tmp_path), _snapshot(tiny_llama)
    code, output = cli("plan", cfg, "-o", target)
    assert code == 1 and "Traceback" not in output, output
    assert all(w in _flat(output) for w in words), output
    build_code, build_output = cli("build", cfg, target, "--force")  # the build refuses it the same way
    assert build_code == 1 and all(w in _flat(build_output) for w in words), build_output
    assert _snapshot(tmp_path) == before and _snapshot(tiny_llama) == source_before


def test_plan_accepts_a_new_output_under_missing_folders_and_an_existing_one(tiny_llama, tmp_path):
    """The build makes missing parents, and an existing folder is for build's --force to judge: plan passes both."""
    cfg = _recipe(tmp_path, tiny_llama)
    code, output = cli("plan", cfg, "-o", tmp_path / "new" / "deeper" / "moe")
    assert code == 0, output
    assert not (tmp_path / "new").exists()  # plan creates nothing
    previous = _project(tmp_path / "previous")
    code, output = cli("plan", cfg, "-o", previous)
    assert code == 0, output


@pytest.mark.parametrize("command", ["build", "plan"])
def test_an_output_name_that_is_not_utf8_is_refused_before_any_work(command, tiny_llama, tmp_path):
    """Such a folder was written, and then neither verify nor anyone else could load its tokenizer (the
    tokenizers library takes text paths: "surrogates not allowed")."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n")
    target = tmp_path / os.fsdecode(b"moe\xff\xfe")  # bytes a Latin-1 shell or a script can put in a name
    code, output = cli(command, recipe, "-o", target)
    said = " ".join(output.split())
    assert code == 1 and "Traceback" not in output, output
    assert "the path holds bytes that are not UTF-8 text, and transformers cannot load a tokenizer" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.mark.parametrize("output", ["$HOME/moe", "${RUNS}/run-7/moe", "out/$RUN/moe"])
@pytest.mark.parametrize("command", ["build", "plan"])
def test_output_named_after_an_environment_variable_is_refused(output, command, tiny_llama, tmp_path, monkeypatch):
    """`output: $HOME/moe` made a folder literally named `$HOME` in the current folder (YAML expands nothing)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n"
                                       f"output: {output}\n")
    code, text = cli(command, "cfg.yaml")
    variable = next(part for part in output.split("/") if part.startswith("$"))
    assert code == 1, text
    flat = " ".join(text.split())
    assert "it names an environment variable, which a recipe does not expand" in flat, flat
    assert f"here it would make a folder named {variable} in the current folder, so nothing is made" in flat
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]  # no `$HOME` folder, no `out`


def test_an_existing_folder_named_like_a_variable_is_the_users(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "$RUN").mkdir()
    (tmp_path / "cfg.yaml").write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n")
    code, text = cli("build", "cfg.yaml", "$RUN/moe")
    assert code == 0 and (tmp_path / "$RUN" / "moe" / "config.json").is_file(), text


def test_input_paths_with_an_environment_variable_say_so(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/tester")
    prompts = (f"base_model: {tiny_llama}\ngate_mode: hidden\nexperts:\n  - source_model: {tiny_llama}\n"
               f"    positive_prompts_from: $HOME/code.txt\n  - source_model: {tiny_llama}\n    positive_prompts: [x]\n")
    calibration = f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: kmeans\ncalibration_text: ${{DATA}}/c.txt\n"
    for text, words in [(prompts, "experts[0].positive_prompts_from: '$HOME/code.txt' is not an existing file: it "
                                  "names an environment variable, which a recipe does not expand (the shell does, "
                                  "YAML does not); write the path itself: /home/tester/code.txt"),
                        (calibration, "calibration_text: ${DATA}/c.txt does not exist; it names an environment "
                                      "variable")]:
        (tmp_path / "cfg.yaml").write_text(text)
        code, output = cli("plan", "cfg.yaml")
        assert code == 1 and words in " ".join(output.split()), output


def test_demo_where_nothing_can_be_written_is_named():
    """/proc takes no new folders (as /sys, or a read-only mount): before, a PermissionError traceback."""
    code, output = cli("demo", "/proc/moe-upcycle-demo-test")
    text = " ".join(output.split())
    assert code == 1 and "Traceback" not in text, text
    assert "demo folder /proc/moe-upcycle-demo-test: cannot write there" in text and "moe-upcycle demo demo_out" in text


@pytest.mark.parametrize("output, words", [
    ("'D:\\models\\my-moe'", ["output D:\\models\\my-moe: it is a Windows path (drive D:)",
                              "/mnt/d/models/my-moe", "a folder named D:\\models\\my-moe in the current folder"]),
    ("C:/Users/me/moe", ["output C:/Users/me/moe: it is a Windows path (drive C:)", "a folder named C: in the current"]),
    ("'runs\\moe'", ["output runs\\moe: it separates folders with Windows backslashes", "(runs/moe)"]),
])
@pytest.mark.parametrize("command", ["build", "plan"])
def test_a_windows_output_path_from_a_recipe_is_refused(output, words, command, tiny_llama, tmp_path, monkeypatch):
    """A recipe written on Windows made a folder literally named `D:\\models\\my-moe` (or `C:`) here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: random\n"
                                       f"output: {output}\n")
    code, text = cli(command, "cfg.yaml")
    flat = " ".join(text.split())
    assert code == 1 and "Traceback" not in flat, flat
    for w in words:
        assert w in flat, flat
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]


def test_windows_paths_to_prompt_files_and_calibration_text_say_what_to_write(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = [
        (f"base_model: {tiny_llama}\ngate_mode: hidden\nexperts:\n  - source_model: {tiny_llama}\n"
         f"    positive_prompts_from: prompts\\code.txt\n  - source_model: {tiny_llama}\n    positive_prompts: [x]\n",
         "experts[0].positive_prompts_from: 'prompts\\code.txt' is not an existing file: it separates folders with "
         "Windows backslashes, which are ordinary characters in a name here: write forward slashes (prompts/code.txt)"),
        (f"base_model: {tiny_llama}\nnum_experts: 2\ngate_mode: kmeans\ncalibration_text: D:\\data\\c.txt\n",
         "calibration_text: D:\\data\\c.txt does not exist; it is a Windows path (drive D:)"),
    ]
    for text, words in cases:
        (tmp_path / "cfg.yaml").write_text(text)
        code, output = cli("plan", "cfg.yaml")
        assert code == 1 and words in " ".join(output.split()), output


@pytest.mark.parametrize("fails", ["dense_model_disk_full", "build_refused"])
@pytest.mark.parametrize("existed", [False, True], ids=["new_folder", "previous_demo"])
def test_a_demo_that_fails_leaves_nothing_it_wrote(fails, existed, tmp_path, monkeypatch):
    """Before, on a full disk: a safetensors traceback and dense/ holding config.json without weights, or (with a
    little more room) the whole dense/ and the manifest left behind after the build's own clean refusal."""
    import moe_upcycle.cli.demo as demo
    from safetensors import SafetensorError

    from moe_upcycle.errors import OutputError

    folder = tmp_path / "demo"
    if existed:
        assert cli("demo", folder)[0] == 0
    real = demo.make_dense_model

    def dense_then_full(path, **kwargs):
        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text("{}")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def refused(*args, **kwargs):
        raise OutputError("not enough disk space for the output in demo: needs 2 bytes")

    if fails == "dense_model_disk_full":
        monkeypatch.setattr(demo, "make_dense_model", dense_then_full)
    else:
        monkeypatch.setattr(demo, "make_dense_model", real)
        monkeypatch.setattr(demo, "upcycle", refused)
    code, output = cli("demo", folder)
    assert code == 1 and "Traceback" not in output, output
    said = ("writing the tiny dense model failed (Error while serializing: I/O error: No space left on device"
            if fails == "dense_model_disk_full" else "not enough disk space for the output")
    assert said in _flat(output), output
    if existed:  # the previous demo's parts were the demo's to replace; the folder stays a demo folder
        assert sorted(p.name for p in folder.iterdir()) == ["moe_upcycle.json"]
    else:
        assert sorted(p.name for p in tmp_path.iterdir()) == []
