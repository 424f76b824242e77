"""What identifies one version of a file on disk, so that a source changed during a build is never read.

A build reads a source's headers when it plans and its bytes later (minutes later, after the gates); a
folder re-saved in between would give the MoE tensors of two versions, or bytes at offsets the new
file does not use. `FileStamp` is taken with a header and compared whenever the file is read again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moe_upcycle.errors import SourceError


@dataclass(frozen=True)
class FileStamp:
    """What identifies one version of a file on disk: device, inode, size and modification time (ns)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileStamp":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def difference(self, now: "FileStamp") -> str:
        """What changed, in words: "replaced by another file", "12 bytes, now 40", "modified"."""
        if (self.device, self.inode) != (now.device, now.inode):
            return "replaced by another file"
        if self.size != now.size:
            return f"{self.size} bytes, now {now.size}"
        return "modified"

    def check(self, path: Path, now: Optional[os.stat_result] = None) -> None:
        """Raise `SourceError` when `path` is gone or is no longer this version of the file (`now`: its stat, when
        the caller has the file open and took it with ``fstat``)."""
        if now is None:
            try:
                now = os.stat(path)
            except OSError as exc:
                raise SourceError(f"{path}: the file is gone or unreadable since the build read its header "
                                  f"({exc.strerror or exc}); nothing was written — run the build again once nothing "
                                  f"is changing the model folder") from None
        if FileStamp.of(now) != self:
            raise SourceError(f"{path}: the file changed on disk after the build read its header "
                              f"({self.difference(FileStamp.of(now))}); the MoE would mix two versions of the model, so "
                              f"nothing was written — run the build again once nothing is writing to {path.parent}")
