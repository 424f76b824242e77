"""The standard streams a command is started with: closed, unable to encode the text, zero columns wide.

Each once ended in a traceback or in silence after the work was done (`__main__.standard_streams`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from failure_checks import module_cmd, module_env


def _run(shell: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    """`shell` with MOE standing for ``python -m moe_upcycle``, run by bash in `tmp_path`."""
    command = shell.replace("MOE", " ".join(module_cmd()))
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**module_env(), **env}, check=False)


def _recipe(stories, tmp_path, name: str = "coder") -> None:
    (tmp_path / "r.yaml").write_text(f"base_model: {stories}\ngate_mode: random\nexperts_per_token: 1\nexperts:\n"
                                     f"  - source_model: {stories}\n    name: {name}\n"
                                     f"  - source_model: {stories}\n", encoding="utf-8")


def test_closed_stdout_or_stderr_is_not_a_failure(stories, tmp_path):
    """`>&-` / `2>&-` (cron, daemons): before, the build finished and then exited 1 with three tracebacks from
    flushing a stream that was None."""
    _recipe(stories, tmp_path)
    run = _run("MOE build r.yaml out1 >&-", tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    run = _run("MOE build r.yaml out2 2>&-; echo rc=$?", tmp_path)
    assert run.stdout.strip().endswith("rc=0") and "Built" in run.stdout, run.stdout
    for out in ("out1", "out2"):
        assert sorted(p.name for p in (tmp_path / out).iterdir() if p.suffix == ".safetensors") == [
            "model-00001-of-00001.safetensors"]


def test_text_the_stream_cannot_encode_is_escaped(stories, tmp_path):
    """PYTHONIOENCODING=ascii: an expert named in Greek, and the tool's own Δ, were UnicodeEncodeError tracebacks."""
    _recipe(stories, tmp_path, name="λόγος")
    run = _run("MOE plan r.yaml", tmp_path, PYTHONIOENCODING="ascii")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "\\u03bb\\u03cc\\u03b3\\u03bf\\u03c2" in run.stdout  # λόγος, escaped


def test_zero_columns_still_prints_the_message(tmp_path):
    """COLUMNS=0 made rich print every message in zero columns: exit 1 and no word of why."""
    run = _run("MOE build missing.yaml out", tmp_path, COLUMNS="0")
    assert run.returncode == 1
    assert "config error: missing.yaml: config file not found" in " ".join(run.stderr.split()), run.stderr


def test_names_transformers_could_not_load_from_are_refused_before_anything_is_made(stories, tmp_path):
    """The tokenizers library opens a model folder by its UTF-8 name: a demo folder of bytes that are not UTF-8
    was a traceback; a model path this locale cannot write (LC_ALL=C, PYTHONUTF8=0) was a UnicodeEncodeError."""
    demo = subprocess.run([*module_cmd("demo"), os.fsencode(str(tmp_path / "demo_")) + b"\xff"],
                          capture_output=True, cwd=tmp_path, env=module_env(), timeout=600, check=False)
    err = " ".join(demo.stderr.decode("utf-8", "replace").split())
    assert demo.returncode == 1 and "Traceback" not in err, err
    assert "the path holds bytes that are not UTF-8 text, and transformers cannot load a tokenizer" in err
    assert [p.name for p in tmp_path.iterdir()] == []
    base = tmp_path / "modèle"
    base.symlink_to(stories)
    (tmp_path / "r.yaml").write_text("base_model: ./modèle\nnum_experts: 2\ngate_mode: random\n", encoding="utf-8")
    run = _run("MOE plan r.yaml", tmp_path, LC_ALL="C", PYTHONUTF8="0", PYTHONIOENCODING="utf-8")
    said = " ".join(run.stderr.split())
    assert run.returncode == 1 and "Traceback" not in said, said
    assert ("holds characters that this locale's file names (ascii) cannot hold; run with a UTF-8 locale "
            "(LANG=C.UTF-8, or PYTHONUTF8=1)") in said


def test_a_locale_writing_file_names_in_latin_1_is_named(monkeypatch):
    """Under ISO-8859-1, é is one byte on disk, and transformers' tokenizer opens the UTF-8 name: the build said
    "Built", then its model did not load ("os error 2")."""
    from moe_upcycle.inputs import paths

    monkeypatch.setattr(paths.os, "fsencode", lambda name: name.encode("latin-1"))
    monkeypatch.setattr(paths.sys, "getfilesystemencoding", lambda: "iso8859-1")
    assert paths.unloadable_name(Path("/data/iso_é")) == (
        "/data/iso_é: this locale writes file names in iso8859-1, so the folder's name on disk is not the UTF-8 text "
        "transformers' tokenizer opens, and the model would not load; run with a UTF-8 locale (LANG=C.UTF-8, or "
        "PYTHONUTF8=1), or use a name of ASCII characters")
    assert paths.unloadable_name(Path("/data/plain")) is None


def test_help_or_a_build_report_to_a_full_disk_says_what_happened(stories, tmp_path):
    """`--help > /dev/full` was an OSError traceback; a build whose report could not be written exited 1 without
    saying that the model itself was complete."""
    run = _run("MOE --help > /dev/full", tmp_path)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert "error: writing to standard output failed (No space left on device)" in run.stderr
    _recipe(stories, tmp_path)
    run = _run("MOE build r.yaml out > /dev/full", tmp_path)
    said = " ".join(run.stderr.split())
    assert run.returncode == 1 and "Traceback" not in said, said
    assert f"failed (No space left on device) ({tmp_path / 'out'} was built and is complete)" in said


def test_a_users_yaml_py_in_the_current_folder_is_not_imported(stories, tmp_path):
    """`python -m moe_upcycle` puts the current folder first on sys.path: a yaml.py or torch.py of the user's there
    was imported instead of the library (AttributeError: module 'yaml' has no attribute 'MarkedYAMLError')."""
    (tmp_path / "yaml.py").write_text("raise SystemExit('the user yaml.py was imported')\n")
    (tmp_path / "torch.py").write_text("raise SystemExit('the user torch.py was imported')\n")
    _recipe(stories, tmp_path)
    run = _run("MOE plan r.yaml", tmp_path)
    assert run.returncode == 0 and "was imported" not in run.stderr + run.stdout, run.stderr
    assert (tmp_path / "yaml.py").read_text().startswith("raise")  # the user's files are left as they are


def test_the_current_folder_check_runs_on_python_3_10(monkeypatch, tmp_path):
    """sys.flags.safe_path (-P) exists from Python 3.11; on 3.10, which pyproject allows, reading it ended every
    command in an AttributeError."""
    import types

    from moe_upcycle import __main__ as entry

    monkeypatch.chdir(tmp_path)
    fake = types.SimpleNamespace(path=[str(tmp_path), "/lib"], flags=types.SimpleNamespace(dont_write_bytecode=0))
    monkeypatch.setattr(entry, "sys", fake)
    entry._no_shadowing()
    assert fake.path == ["/lib"]
