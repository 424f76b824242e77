"""The suite passes whatever signal dispositions and locale it inherits (``nohup``, a background job, a CI runner,
``LANG=C``, a Latin-1 locale): it sets what its tests rely on, for itself and for the processes it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from failure_checks import HANDLED_SIGNALS, REPO, default_signals, signal_defaults


def _ignored(status: str) -> int:
    """The SigIgn mask of a /proc/PID/status text."""
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)


def test_children_start_with_the_default_signal_dispositions_whatever_this_run_inherited():
    """Under ``nohup`` SIGHUP is ignored, and every child inherits that: a build then ran to the end when the test
    sent it SIGHUP (exit 0, not 129). Tests start their children with `default_signals`."""
    bits = sum(1 << (sig - 1) for sig in HANDLED_SIGNALS)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in HANDLED_SIGNALS}  # as nohup and a CI runner do
    try:
        inherited = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True, check=True,
                                   restore_signals=False).stdout
        reset = subprocess.run(["cat", "/proc/self/status"], capture_output=True, text=True, check=True,
                               restore_signals=False, preexec_fn=default_signals).stdout
        with signal_defaults():  # and in this process, for a CLI run in it
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            assert all(signal.getsignal(sig) is signal.SIG_DFL for sig in HANDLED_SIGNALS if sig != signal.SIGINT)
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in HANDLED_SIGNALS)  # put back as they were
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert _ignored(inherited) & bits == bits  # the setting this test stands for
    assert _ignored(reset) & bits == 0


def test_this_run_names_files_and_reads_text_in_utf8(tmp_path):
    """What the tests assume, and `conftest.pytest_configure` makes true under any locale."""
    import locale

    assert sys.getfilesystemencoding() == "utf-8"
    assert locale.getpreferredencoding(False).lower().replace("-", "") == "utf8"  # open() without an encoding
    name = tmp_path / "o3\u200b \u6a21\u578b"
    name.write_text("caf\u00e9 \u2014 \u2016")
    assert name.read_text() == "caf\u00e9 \u2014 \u2016"


def test_the_suite_runs_under_a_locale_that_is_not_utf8(tmp_path):
    """``LC_ALL=POSIX`` without Python's locale coercion or UTF-8 mode gives ASCII file names and text: the tests
    that name files with a zero-width space or CJK could not even create them. The suite starts itself again in
    UTF-8 mode (`conftest.pytest_configure`)."""
    env = {**os.environ, "LC_ALL": "POSIX", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": str(REPO)}
    env.pop("LC_CTYPE", None)
    check = subprocess.run([sys.executable, "-c", "import sys; print(sys.getfilesystemencoding())"], env=env,
                           capture_output=True, text=True, check=True)
    assert check.stdout.strip() == "ascii"  # the locale this test stands for
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--basetemp", str(tmp_path / "t"),
                          f"{Path(__file__).resolve()}::test_this_run_names_files_and_reads_text_in_utf8"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600, preexec_fn=default_signals)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
