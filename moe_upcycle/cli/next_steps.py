"""What to do next, in one or two lines at the end of `build` and `demo` (on stderr; not with -q).

It only words the lines; the commands print them with `app.note`. Paths are written as a shell reads
them: relative to the current folder when they are inside it, quoted when they need it.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path


def shell_path(path: Path) -> str:
    """`path` for a command line: relative to the current folder when inside it, else absolute; quoted if needed.

    Example:
        >>> shell_path(Path.cwd() / "my moe")
        "'my moe'"
    """
    path = Path(path)
    try:
        shown = str(path.relative_to(Path.cwd()))
    except ValueError:  # outside the current folder (or another drive): as given
        shown = str(path)
    return shlex.quote(shown if shown != "." else os.curdir)


def after_build(output: Path, verified: bool) -> list[str]:
    """The next steps after `build`: check it (unless ``--verify`` did), see how it routes, edit its card."""
    out = shell_path(output)
    check = [] if verified else [f"moe-upcycle verify {out}"]
    return [f"next: {' · '.join([*check, f'moe-upcycle route {out} --prompts FILE'])}",
            f"before uploading, edit the model card: {shell_path(Path(output) / 'README.md')}"]


def after_demo(moe: Path) -> list[str]:
    """The next steps after `demo`: verify the demo's MoE as one would a real build, then plan a model of one's own."""
    out = shell_path(moe)
    return [f"next: moe-upcycle verify {out}   (the checks to run on a build of yours)",
            "your own model: moe-upcycle plan experts.yaml (a recipe: README, Quick start)"]
