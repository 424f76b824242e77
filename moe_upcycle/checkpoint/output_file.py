"""Single output files (a grown recipe, a routing heatmap), written whole or not at all.

`write_file(target, write, replace)` calls ``write(tmp)`` on a fresh temporary file beside the
target (``.<name>.<random>.partial``, created with O_EXCL, so no file of the user's is ever taken
for it), then moves it into place: with `replace`, atomically over an existing target (which keeps
its permissions); without, only if no file has appeared there since the caller checked (a hard
link, which refuses an existing name). The temporary file is removed on every failure, so a full
disk or Ctrl-C never leaves a half-written file under the target's name or beside it.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Optional


def write_file(target: Path, write: Callable[[Path], None], replace: bool, mode_from: Optional[Path] = None) -> None:
    """Write `target` through ``write(tmp)``; see the module docstring. A new file gets the permissions of
    `mode_from` when given (a grown recipe those of its recipe: a private recipe stays private), writable by its
    owner even when that file is read-only; else the umask's.

    Raises:
        FileExistsError: `replace` is false and the target exists.
        OSError: the temporary file cannot be created or written, or the move fails.
    """
    target = Path(target)
    fd, name = tempfile.mkstemp(prefix=f".{target.name[:200]}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        if replace and target.exists():
            shutil.copymode(target, tmp)  # a 0600 file replaced stays private
        elif mode_from is not None:  # its group and others' permissions; the owner may always read and edit it
            os.chmod(tmp, stat.S_IMODE(os.stat(mode_from).st_mode) | stat.S_IRUSR | stat.S_IWUSR)
        else:  # mkstemp makes 0600; a new file gets the mode open() would give it
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)
        if replace:
            os.replace(tmp, target)
            return
        try:
            os.link(tmp, target)  # refuses a name that exists, even one made since the caller checked
        except FileExistsError:
            raise
        except OSError:  # a filesystem without hard links
            if target.exists() or target.is_symlink():
                raise FileExistsError(errno.EEXIST, "File exists", str(target)) from None
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
