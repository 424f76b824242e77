"""Help, version and hints that are right: flags look like flags, hints name commands that work."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moe_upcycle import __version__
from moe_upcycle.cli import app
from moe_upcycle.terminal.hints import download_command, install_hint

runner = CliRunner()
COMMANDS = [["build"], ["plan"], ["verify"], ["route"], ["lint"], ["prompts", "grow"], ["demo"]]


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"moe-upcycle {__version__}\n"


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_shows_flags_as_flags(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout
    assert re.search(r"--help\s+Show this message and exit", result.stdout)
    assert "{config}" not in result.stdout  # arguments named in capitals, as in the usage line


def test_value_options_keep_their_type():
    out = runner.invoke(app, ["build", "--help"], env={"COLUMNS": "120"}).stdout
    assert re.search(r"--batch-size\s+<int>", out) and re.search(r"--force\s+Replace", out)


@pytest.mark.parametrize("command", [["build"], ["verify"], ["route"]], ids=" ".join)
def test_one_device_default_everywhere(command):
    import typer.main

    cmd = typer.main.get_command(app)
    for name in command:
        cmd = cmd.commands[name]
    device = next(p for p in cmd.params if p.name == "device")
    # build takes the recipe's device: (default auto) unless given; verify and route default to auto
    assert device.default in ("auto", None)
    if device.default is None:
        from moe_upcycle.recipe.schema import UpcycleConfig

        assert UpcycleConfig.model_fields["device"].default == "auto"


def test_missing_local_model_gets_no_download_hint(tmp_path, write_yaml):
    config = write_yaml({"base_model": "./ft0", "num_experts": 2, "gate_mode": "random"})
    result = runner.invoke(app, ["plan", str(config)])
    assert result.exit_code == 1
    assert "download" not in result.stderr
    assert "base_model: model './ft0' not found" in result.stderr
    assert "check the path: there is no folder ft0; give the folder of a saved model" in result.stderr


def test_missing_hub_model_gets_a_download_command_that_exists(write_yaml, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    config = write_yaml({"base_model": "SomeOrg/some-model", "num_experts": 2, "gate_mode": "random"})
    result = runner.invoke(app, ["plan", "--from-config", str(config)])
    assert result.exit_code == 1
    assert f"({download_command('SomeOrg/some-model')};" in result.stderr
    assert download_command("SomeOrg/some-model", "config.json") in result.stderr
    tool = download_command("x/y").split(" download")[0]
    assert subprocess.run([tool, "download", "--help"], capture_output=True).returncode == 0


def test_install_hints_name_commands_that_work_from_a_clone():
    assert install_hint("plot") == "pip install matplotlib (or, in a clone of moe-upcycle: pip install -e '.[plot]')"
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in ("plot", "quant"):  # the hint installs what the extra installs
        assert sorted(re.split(r"[<>=]", p)[0] for p in extras[extra]) == install_hint(extra).split(" (")[0].split()[2:]


def test_module_entry_point_prints_version():
    out = subprocess.run([sys.executable, "-m", "moe_upcycle", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"moe-upcycle {__version__}"
