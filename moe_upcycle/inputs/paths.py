"""Name the path errors that Python reports without saying which of the user's paths is at fault.

`Path.resolve()` raises ``RuntimeError("Symlink loop from '...'")`` (Python 3.11/3.12; an
``OSError`` with ``errno.ELOOP`` in later versions and in plain file calls) when a link points
back to itself through other links. `symlink_loop` recognises both (and a name too long for the file system) and returns the message the
command line prints instead of a traceback; `resolve_or_raise` is `Path.resolve` with that
message as an `UpcycleError` of the caller's choosing. `not_a_readable_file` says why a path the user
gave as an input file (prompts, a pool, labels) cannot be read as one; `broken_link` names a link
in a model folder that leads nowhere.
"""

from __future__ import annotations

import errno
import os
import sys
import re
from pathlib import Path
from typing import Optional, Type

from moe_upcycle.errors import UpcycleError


def symlink_loop(exc: BaseException) -> Optional[str]:
    """The user-facing message for a symlink-loop error, or for a name too long for the file system (None for any
    other exception): errors of a path the user gave, not bugs."""
    if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
        shown = str(exc.filename or "a path")
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return (f"{shown}: the name is too long for the file system (most allow 255 bytes per name and 4096 per "
                f"path); choose a shorter name")
    path = None
    if isinstance(exc, RuntimeError):
        m = re.fullmatch(r"Symlink loop from '(.*)'", str(exc), re.S)
        path = m.group(1) if m else None
    elif isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        path = exc.filename or "a path"
    if path is None:
        return None
    return (f"{path}: symlink loop — the link points back to itself through other links, so it leads nowhere; "
            f"fix or remove the link")


def denied(exc: BaseException) -> Optional[str]:
    """The user-facing message for a file operation the system refused (permission denied, operation not
    permitted), or None for any other exception: a path the user may not read, enter or change is theirs to fix,
    not a bug. Python's ``Path.exists()``, ``is_dir()`` and ``is_file()`` raise it for a path inside a folder the
    user may not enter.

    Example:
        >>> denied(PermissionError(13, "Permission denied", "/srv/models/base"))  # doctest: +ELLIPSIS
        '/srv/models/base: Permission denied for user ... — check the permissions of it and of each folder above it (ls -ld /srv/models/base /srv/models), or choose another path'
    """
    if not isinstance(exc, OSError) or exc.errno not in (errno.EACCES, errno.EPERM):
        return None
    import shlex

    user = user_name(os.geteuid())
    path = str(exc.filename) if exc.filename is not None else None
    moved = f" -> {exc.filename2}" if exc.filename2 is not None else ""
    if path is None:
        return f"{exc.strerror or exc} for {user} — check the permissions of the files and folders given"
    shown = path if len(path) <= 200 else path[:197] + "..."
    parent = os.path.dirname(os.path.abspath(path))
    look = " ".join(shlex.quote(p) for p in dict.fromkeys([path, parent]) if len(p) <= 200)
    return (f"{shown}{moved}: {exc.strerror or exc} for {user} — check the permissions of it and of each folder "
            f"above it (ls -ld {look}), or choose another path")


def user_name(uid: int) -> str:
    """``user NAME`` (or ``user id N`` for a uid without a name), for messages."""
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name}"
    except (KeyError, ImportError):
        return f"user id {uid}"


_UTF8_LOCALE = "run with a UTF-8 locale (LANG=C.UTF-8, or PYTHONUTF8=1), or use a name of ASCII characters"


def unencodable_name(path) -> str:
    """The message for a path this locale cannot write as a file name (its characters are not in the file-system
    encoding, e.g. ``é`` under ``LC_ALL=C`` with ``PYTHONUTF8=0``)."""
    return (f"{ascii(str(path))} holds characters that this locale's file names ({sys.getfilesystemencoding()}) "
            f"cannot hold; {_UTF8_LOCALE}")


def unloadable_name(folder: Path) -> Optional[str]:
    """Why transformers could not load a model from a folder of this name, or None: its tokenizer (the Rust
    tokenizers library) opens the path as UTF-8 text, so the name on disk must be exactly that.

    Not so for bytes that are not UTF-8 (``\\xff``), for characters this locale cannot write in file names,
    or under a locale that writes them in another encoding (ISO-8859-1 writes é as one byte).
    """
    try:
        utf8 = str(folder).encode("utf-8")
    except UnicodeEncodeError:
        return (f"{ascii(str(folder))}: the path holds bytes that are not UTF-8 text, and transformers cannot load a "
                f"tokenizer from such a folder; choose a name of ordinary characters")
    try:
        on_disk = os.fsencode(str(folder))
    except UnicodeEncodeError:
        return unencodable_name(folder)
    if on_disk != utf8:
        return (f"{folder}: this locale writes file names in {sys.getfilesystemencoding()}, so the folder's name on "
                f"disk is not the UTF-8 text transformers' tokenizer opens, and the model would not load; {_UTF8_LOCALE}")
    return None


def resolve_or_raise(path: Path, error: Type[UpcycleError], where: str = "") -> Path:
    """`path.resolve()`, raising `error` (naming `where`, e.g. a YAML field) on a symlink loop."""
    try:
        return Path(path).resolve()
    except UnicodeEncodeError:  # a locale whose file names are ASCII (LC_ALL=C with PYTHONUTF8=0)
        message = unencodable_name(path)
        raise error(f"{where}: {message}" if where else message) from None
    except ValueError as exc:  # "embedded null byte": no system call takes the path
        if "null" not in str(exc):
            raise
        message = f"{str(path)!r} holds a NUL character (\\x00), which no file name can hold; remove it"
        raise error(f"{where}: {message}" if where else message) from None
    except (RuntimeError, OSError) as exc:
        message = symlink_loop(exc)
        if message is None:
            raise
        raise error(f"{where}: {message}" if where else message) from None


def not_a_readable_file(path: Path) -> Optional[str]:
    """Why `path`, given as an input file, cannot be read as one, or None when it can.

    A pipe or device reads like a file, so ``--prompts <(grep ... all.txt)`` (``/dev/fd/63``) works;
    before, such a path was called "file not found".

    Example:
        >>> not_a_readable_file(Path("/no/such/file")), not_a_readable_file(Path("/")), not_a_readable_file(Path("/dev/null"))
        ('file not found', 'is a folder, not a file', None)
    """
    if path.is_dir():
        return "is a folder, not a file"
    if path.exists():
        return None
    if path.is_symlink():
        return "is a symbolic link that leads nowhere (a symlink loop or a broken link)"
    return "file not found"


def broken_link(path: Path) -> Optional[str]:
    """``a link to TARGET, which does not exist`` when `path` is a symbolic link that leads nowhere (a copied
    Hugging Face cache snapshot without its blobs, a cut download), else None."""
    if not path.is_symlink() or path.exists():
        return None
    try:
        target = os.readlink(path)
    except OSError:
        target = "a target that cannot be read"
    return f"a link to {target}, which does not exist"
