"""Checks on text and token ids before they reach a tokenizer or a model.

- `unicode_problem`: a prompt with a lone surrogate (``"\\ud800"`` written as a JSON or YAML
  escape) is not valid Unicode; tokenizers fail on it with an unnamed error, so it is refused
  with the prompt's place.
- `check_token_ids`: a tokenizer that emits an id past the model's embedding rows (a tokenizer
  from another model, added tokens the model was never resized for) would index out of range in
  the forward pass; it is refused naming the id, the text and the tokenizer's folder.
- `read_utf8`: read a text file the user gave (the one reader for prompts, pools, labels and
  perplexity text), with named errors for non-UTF-8 bytes, folders, broken links and symlink
  loops; `decode_utf8` is its decoding step: a leading byte-order mark (Notepad writes
  one) is dropped, not left at the start of the first prompt, and UTF-16 or Latin-1 bytes are named.
- `read_capped`: the bytes of a prompts or text file, at most `MAX_INPUT_BYTES` (``/dev/zero``
  or a wrong multi-GB file would otherwise be read until memory runs out).

It raises `UpcycleError`s; it never changes a text or an id (a file's byte-order mark is not text).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

from moe_upcycle.errors import ConfigError, SourceError
from moe_upcycle.inputs.paths import not_a_readable_file

if TYPE_CHECKING:  # the recipe schema uses this module and must not pull in torch
    import torch

MAX_INPUT_BYTES = 64 * 2**20  # prompts, pools, labels and perplexity text: far more than any needs


def read_capped(path: Union[str, Path], where: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of `path`, refused past `limit` without reading further.

    Raises:
        ConfigError: the file holds more than `limit` bytes (named with `where`: the option or field and the file).
        OSError: left to the caller, which names the file.
    """
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{where}: more than {limit // 2**20} MiB; prompts and texts are small files — is "
                          f"this the right file?")
    return data


def unicode_problem(text: str) -> Optional[str]:
    """Why `text` is not valid Unicode (None when it is).

    Example:
        >>> unicode_problem("ok")
        >>> unicode_problem("bad \\ud800")
        'contains an invalid Unicode character (lone surrogate U+D800 at position 4); remove it or re-save the text as UTF-8'
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains an invalid Unicode character (lone surrogate U+{ord(text[exc.start]):04X} at position "
                f"{exc.start}); remove it or re-save the text as UTF-8")
    return None


def check_texts(texts: Sequence[str], where: str) -> None:
    """Raise `ConfigError` naming every text of `texts` (from `where`) that is not valid Unicode."""
    problems = [f"{where} {i} ({_short(t)}): {p}" for i, t in enumerate(texts) if (p := unicode_problem(t))]
    if problems:
        raise ConfigError(*problems)


def check_token_ids(ids: Union["torch.Tensor", Sequence[int]], num_embeddings: int, tokenizer: object,
                    text: Optional[str] = None) -> None:
    """Raise `SourceError` when a token id is negative or past the model's `num_embeddings` rows."""
    import torch

    values = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
    if values.numel() == 0:
        return
    top, low = int(values.max()), int(values.min())
    if top < num_embeddings and low >= 0:
        return
    bad = top if top >= num_embeddings else low
    source = str(tokenizer) if isinstance(tokenizer, (str, Path)) else (getattr(tokenizer, "name_or_path", "")
                                                                        or "the tokenizer")
    said = f" for {_short(text)}" if text is not None else ""
    raise SourceError(f"tokenizer {source} produced token id {bad}{said}, but the model has only {num_embeddings} "
                      f"embedding rows (ids 0..{num_embeddings - 1}); the tokenizer files do not belong to this model "
                      f"— copy the model's own tokenizer, or resize its embeddings")


def read_utf8(path: Union[str, Path], where: str, error: type = ConfigError, fix: str = "") -> str:
    """The text of a file the user gave (prompts, a pool, labels, perplexity text): a pipe or device reads like a
    file, at most `MAX_INPUT_BYTES`, without a byte-order mark.

    Args:
        where: what names the file in messages, e.g. ``--pool notes.txt``.
        error: the `UpcycleError` raised; fix: what to do, added to the messages about the file itself.

    Raises:
        `error`: not a readable file (`paths.not_a_readable_file`), unreadable, too big, or not UTF-8.
    """
    path = Path(path)
    problem = not_a_readable_file(path)
    if problem:
        raise error(f"{where}: {problem}{fix}")
    try:
        data = read_capped(path, where)
    except OSError as exc:
        reason = "a symlink loop" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        if exc.errno in (errno.EACCES, errno.EPERM):  # the file is fine, its permissions are not: no advice on format
            fix = "; make it readable by you, or give a copy you may read"
        raise error(f"{where}: cannot read it ({reason}){fix}") from None
    return decode_utf8(data, where, error)


def decode_utf8(data: bytes, where: str, error: type = ConfigError) -> str:
    """`data` as UTF-8 text, without a leading byte-order mark.

    Raises:
        `error` (a `ConfigError` unless given): the bytes are not UTF-8 (says which encoding they look like), or
            hold NUL bytes (a binary file).

    Example:
        >>> decode_utf8(b"\\xef\\xbb\\xbfOnce upon a time", "p.txt")
        'Once upon a time'
    """
    if b"\x00" in data and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        # valid UTF-8 to a decoder, but no one's prompts: Parquet or Arrow, a model file, BOM-less UTF-16
        raise error(f"{where}: not UTF-8 text: it holds NUL bytes, as a binary file does (Parquet, Arrow, a model "
                    f"file) or UTF-16 without a byte-order mark; re-save it as UTF-8 text (a dataset: export its "
                    f"prompts as JSONL or CSV)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text ({encoding_hint(data, exc)}); re-save it as UTF-8 "
                    f"(in Notepad: Save as → Encoding: UTF-8)") from None


def encoding_hint(data: bytes, exc: UnicodeDecodeError) -> str:
    """Why `data` failed to decode as UTF-8, in the user's words."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "it is UTF-16, what Windows calls 'Unicode'"
    return f"byte 0x{data[exc.start]:02x} at position {exc.start} is not UTF-8; it was saved in another encoding"


def _short(text: Optional[str], limit: int = 60) -> str:
    shown = repr(text if text is None or len(text) <= limit else text[:limit - 3] + "...")
    return shown
