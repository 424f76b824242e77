"""Git LFS pointer files standing where a model's files should be.

A Hugging Face repository cloned with plain ``git`` (no Git LFS) holds, instead of each large file
(weights, ``tokenizer.model``, often ``tokenizer.json``), a ~130-byte text file that names it:
``version https://git-lfs.github.com/spec/v1`` / ``oid sha256:…`` / ``size N``. Read as
safetensors it claims a header of 2e18 bytes; read as a pickle, "invalid load key 'v'"; copied as a
tokenizer file, it ships a model whose tokenizer does not load. `lfs_pointer_problem` says what
the file is and how to fetch the real one, for every reader of the user's files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

LFS_SIGNATURE = b"version https://git-lfs.github.com/spec/"
_SIZE = re.compile(rb"^size (\d+)\s*$", re.MULTILINE)


def lfs_pointer_problem(file: Path) -> Optional[str]:
    """The message for `file` when it is a Git LFS pointer, else None (also when it cannot be read).

    Example:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> p = Path(folder.name) / "model.safetensors"
        >>> _ = p.write_bytes(b"version https://git-lfs.github.com/spec/v1\\noid sha256:4d7a\\nsize 647424\\n")
        >>> lfs_pointer_problem(p).split(";")[0].split("/")[-1]
        'model.safetensors: is a Git LFS pointer (71 bytes) to a 647,424-byte file, not the file itself'
        >>> folder.cleanup()
    """
    try:
        with open(file, "rb") as fh:
            head = fh.read(1024)
        length = file.stat().st_size
    except OSError:
        return None
    if not head.startswith(LFS_SIGNATURE):
        return None
    size = _SIZE.search(head)
    meant = f" to a {int(size.group(1)):,}-byte file" if size else ""
    return (f"{file}: is a Git LFS pointer ({length} bytes){meant}, not the file itself; the repository was "
            f"cloned without Git LFS. Fetch the real files: `git lfs install && git lfs pull` in {file.parent}, "
            f"or download the model with `hf download` (huggingface_hub)")
