"""Commands that error messages suggest, written so that they work where the user is.

moe-upcycle is installed from a clone (it is not on a package index), so an extra is installed
with ``pip install -e '.[plot]'`` from the clone, or simply by installing the package it brings.
A hub model is downloaded with the ``hf`` command of huggingface_hub (``huggingface-cli`` on
older versions); a local path is never given a download command.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
WINDOWS_DRIVE = re.compile(r"^([A-Za-z]):[\\/]")  # F:/7B/model, D:\models\model

# extra name -> the packages it installs (mirrors [project.optional-dependencies] in pyproject.toml)
EXTRAS = {"plot": "matplotlib", "quant": "bitsandbytes", "test": "pytest hypothesis"}


def install_hint(extra: str) -> str:
    """How to install an optional dependency.

    Example:
        >>> install_hint("plot")
        "pip install matplotlib (or, in a clone of moe-upcycle: pip install -e '.[plot]')"
    """
    return f"pip install {EXTRAS[extra]} (or, in a clone of moe-upcycle: pip install -e '.[{extra}]')"


def is_hub_id(ref: str) -> bool:
    """``org/name`` with the characters the hub allows; ``./x``, ``/abs/x``, ``~/x`` and ``x`` are paths.

    Example:
        >>> is_hub_id("mistralai/Mistral-7B-v0.1"), is_hub_id("./ft0"), is_hub_id("ft0"), is_hub_id("a/b/c")
        (True, False, False, False)
    """
    return bool(HUB_ID.match(ref)) and not ref.startswith((".", "~")) and ".." not in ref


def download_command(ref: str, *files: str) -> str:
    """The command that puts hub model `ref` (or only `files` of it) into the local cache."""
    tool = "huggingface-cli download" if shutil.which("hf") is None and shutil.which("huggingface-cli") else "hf download"
    return " ".join([tool, ref, *files])


def missing_model_hint(ref: str) -> str:
    """What to do about a model reference that is neither a folder nor in the cache (``org/name@revision`` too).

    mergekit's other reference forms get their own answer: ``model+lora`` (a LoRA adapter merged
    into the model as it is read: each part must be a folder or cached hub id, and a second ``+``
    is not read), more than one ``@``, and a hub URL.
    """
    if "+" in ref:
        model, _, adapter = ref.partition("+")
        if "+" in adapter:
            return (f"{ref!r} names more than one '+': mergekit's model+LoRA form merges one adapter "
                    f"(model+adapter); merge the others into the model with peft first "
                    f"(PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(folder))")
        return (f"{model!r}+{adapter!r} is mergekit's model+LoRA form (the LoRA adapter is merged into the model as it "
                f"is read): the model and the adapter must each be a folder or a hub id in the local cache; "
                f"{missing_model_hint(model) if not _present(model) else missing_model_hint(adapter)}")
    if ref.count("@") > 1:
        return "a model reference has at most one '@' (org/name@revision: a branch, tag or commit)"
    odd = odd_name(ref)
    if odd:
        return odd
    variable = variable_hint(ref)
    if variable:
        return variable
    url = re.match(r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/([^/?#]+/[^/?#]+)", ref.strip())
    if url:
        return f"write the hub id, not its web address: {url.group(1)}"
    repo, _, revision = ref.partition("@") if ref.count("@") == 1 else (ref, "", "")
    if is_hub_id(repo):
        near = "" if revision else near_folder(ref)
        if near:  # Models/Stories for the local folder models/stories reads like a hub id
            return f"it is not a hub model in the local cache nor a folder here; did you mean the folder {near}?"
        at = ("--revision", revision) if revision else ()
        return (f"give a local folder, or download the hub model first ({download_command(repo, *at)}; "
                f"`moe-upcycle plan --from-config` needs only {download_command(repo, 'config.json', *at)})")
    windows = windows_path_hint(ref)
    if windows:
        return windows
    if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*/$", ref):
        return f"there is no model name after '{ref}': write {ref}name (the hub id), or give a folder"
    near = near_folder(ref)
    if near:
        return f"there is no folder {Path(os.path.expanduser(ref))}; did you mean {near}?"
    return f"check the path: there is no folder {Path(os.path.expanduser(ref))}; give the folder of a saved model"


def unknown_home(ref: str) -> str:
    """What to write for ``~name/...`` when there is no user `name` (the shell leaves it as it is: ``~models``
    typed for ``~/models``); empty otherwise.

    Example:
        >>> unknown_home("~no-such-user-here/moe")
        "~no-such-user-here is the home folder of a user 'no-such-user-here', who does not exist here; for a folder in your home write ~/no-such-user-here/moe"
    """
    if not ref.startswith("~") or ref.startswith("~/") or ref == "~" or os.path.expanduser(ref) != ref:
        return ""
    user = ref[1:].split("/", 1)[0]
    return (f"~{user} is the home folder of a user {user!r}, who does not exist here; for a folder in your home "
            f"write ~/{ref[1:]}")


def odd_name(text: str) -> str:
    """What is wrong with a path no one types on purpose (spaces at an end, the ``~`` of a user who does not
    exist, characters pasted from a web page) and what to write; empty when nothing is."""
    if text != text.strip():
        return f"it has spaces at its start or end (inside quotes); remove them: {text.strip()}"
    return unknown_home(text) or pasted_characters(text)


def odd_new_folder(target: Path) -> str:
    """For a folder about to be made: the first folder on its way not made yet whose name is odd (`odd_name`),
    with what is wrong; empty when none is. A folder that exists is the user's, whatever its name."""
    for part in [target, *target.parents]:
        try:
            if part.exists():
                return ""
        except OSError:  # a name too long to look up: not this check's to say
            return ""
        hint = odd_name(part.name)
        if hint:
            return f"the folder name {part.name!r}: {hint}"
    return ""


def near_folder(ref: str) -> str:
    """A model folder near where `ref` points whose path is `ref`'s but for letter case, Unicode normalisation
    (a name typed on macOS) or a slip in a name; the path to write, or empty.

    Configs written on macOS or Windows, whose file systems ignore case, name ``./Models/Mistral`` for
    ``./models/mistral``; this machine does not. Only a folder holding config.json is suggested.
    """
    import difflib
    import unicodedata

    path = Path(os.path.expanduser(ref))
    parent, missing = path, []
    while not parent.is_dir():  # the deepest folder that exists, and the names below it
        if parent == parent.parent:
            return ""
        missing.insert(0, parent.name)
        parent = parent.parent
    key = lambda n: unicodedata.normalize("NFC", n).casefold()
    guess = parent
    for name in missing:
        try:
            names = [p.name for p in guess.iterdir() if p.is_dir()]
        except OSError:
            return ""
        close = ([n for n in names if key(n) == key(name)]
                 or [n for n in names if sorted(key(n)) == sorted(key(name))]  # two letters swapped: bsae, base
                 or difflib.get_close_matches(name, names, n=1, cutoff=0.8))
        if not close:
            return ""
        guess = guess / close[0]
    if not (guess / "config.json").is_file():
        return ""
    shown = str(guess) if path.is_absolute() else os.path.relpath(guess)
    return "./" + shown if ref.startswith("./") and not shown.startswith(("/", "..")) else shown


# characters a web page or a word processor puts into text copied from it, invisible or look-alike
INVISIBLE = {"\u200b": "zero-width space", "\u200c": "zero-width non-joiner", "\u200d": "zero-width joiner",
             "\u2060": "word joiner", "\ufeff": "zero-width no-break space", "\u00a0": "non-breaking space",
             "\u202f": "narrow no-break space", "\u00ad": "soft hyphen"}
SPACES = {"\u00a0", "\u202f"}  # of those, the ones that stand for an ordinary space
CURLY_QUOTES = "\u2018\u2019\u201a\u201b\u201c\u201d\u201e\u201f\u00ab\u00bb"


def pasted_characters(text: str) -> str:
    """What in a model reference came from copying a web page: invisible characters, or curly quotes around
    it (which YAML keeps as part of the name). Empty when there are none.

    Example:
        >>> pasted_characters("./base\u200b")
        'it contains a hidden character (U+200B zero-width space), often copied from a web page; delete it: ./base'
        >>> pasted_characters("\u2018./ft\u2019")
        "it is wrapped in curly quotes (\u2018 \u2019), which YAML keeps as part of the name; write straight quotes or none: './ft'"
    """
    hidden = sorted({c for c in text if c in INVISIBLE}, key=text.index)
    if hidden:
        named = ", ".join(f"U+{ord(c):04X} {INVISIBLE[c]}" for c in hidden)
        clean = "".join(" " if c in SPACES else "" if c in INVISIBLE else c for c in text)
        what = ("replace it with a normal space" if set(hidden) <= SPACES else
                "delete it" if len(hidden) == 1 else "delete them" if not set(hidden) & SPACES else
                "delete them (a no-break space becomes a normal one)")
        return f"it contains a hidden character ({named}), often copied from a web page; {what}: {clean}"
    if len(text) > 1 and text[0] in CURLY_QUOTES and text[-1] in CURLY_QUOTES:
        return (f"it is wrapped in curly quotes ({text[0]} {text[-1]}), which YAML keeps as part of the name; write "
                f"straight quotes or none: '{text[1:-1]}'")
    return ""


def variable_hint(ref: str) -> str:
    """What to write for a path that names an environment variable (``$HOME/models/x``, ``${DATA}/p.txt``), which
    a shell expands and a recipe does not; empty when it names none.

    Example:
        >>> variable_hint("${NO_SUCH_VARIABLE_HERE}/p.txt")
        'it names an environment variable, which a recipe does not expand (the shell does, YAML does not); write the path itself'
    """
    if not re.search(r"\$\{?[A-Za-z_]", ref):
        return ""
    expanded = os.path.expandvars(ref)
    known = expanded != ref and "$" not in expanded
    return ("it names an environment variable, which a recipe does not expand (the shell does, YAML does not); "
            "write the path itself" + (f": {expanded}" if known else ""))


def windows_path_hint(ref: str) -> str:
    r"""What to write instead of a Windows path (``F:/7B/x``, ``D:\models\x``, ``models\x``) where paths are POSIX.

    Configs published from Windows name models this way; elsewhere the drive letter is part of a
    relative folder name and backslashes are ordinary characters, so the folder is never found.
    Empty when `ref` is not one, or when this machine is Windows.

    Example:
        >>> print(windows_path_hint(r"D:\models\cat-8B") if os.sep == "/" else "...")  # doctest: +ELLIPSIS
        it is a Windows path (drive D:), ...(under WSL drive D: is /mnt/d: /mnt/d/models/cat-8B)
    """
    if os.sep == "\\":
        return ""
    drive = WINDOWS_DRIVE.match(ref)
    if not drive and "\\" not in ref:
        return ""
    rest = ref[drive.end():] if drive else ref
    posix = "/".join(part for part in re.split(r"[\\/]+", rest) if part)
    if drive:
        letter = drive.group(1).lower()
        return (f"it is a Windows path (drive {letter.upper()}:), and this machine names folders "
                f"POSIX-style: give the path as it is named here (under WSL drive {letter.upper()}: is "
                f"/mnt/{letter}: /mnt/{letter}/{posix})")
    return (f"it separates folders with Windows backslashes, which are ordinary characters in a name "
            f"here: write forward slashes ({posix})")


def show_ref(ref: str) -> str:
    r"""`ref` in quotes as the user wrote it: backslashes not doubled, characters that do not print escaped.

    Example:
        >>> print(show_ref(r"D:\models\x"), show_ref("a\nb"))
        'D:\models\x' 'a\nb'
    """
    return f"'{ref}'" if ref.isprintable() and "'" not in ref else repr(ref)


def _present(ref: str) -> bool:
    """Whether a reference is a local folder (hub ids are not looked up here)."""
    return Path(os.path.expanduser(ref)).is_dir()
