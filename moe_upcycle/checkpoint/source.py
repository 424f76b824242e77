"""Lazy readers for dense checkpoints: headers first, tensor bytes one at a time.

A `Checkpoint` knows every tensor's shape and dtype from the safetensors headers (or from a
``weights_only`` memory-mapped load of ``pytorch_model*.bin``) without reading any tensor data.
`read(key)` returns one tensor; one open handle per shard file is kept. It does not check
checkpoints against each other: that is `plan`'s job.

Model references are local folders, or hub ids resolved from the local Hugging Face cache
(offline; nothing is downloaded).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open

from moe_upcycle.errors import SourceError
from moe_upcycle.terminal.progress import stage
from moe_upcycle.checkpoint.config_checks import side_file_problems, value_problems
from moe_upcycle.inputs.paths import resolve_or_raise
from moe_upcycle.checkpoint.weight_files import WEIGHT_FILES, choose_weights, duplicate_problems

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
REQUIRED_INT_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
# config.json dtype names
STR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype.

    Example:
        >>> tensor_nbytes((2, 3), torch.bfloat16)
        12
    """
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, without its data."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str  # file name inside the checkpoint folder ("" for meta checkpoints)
    offset: int = -1  # safetensors: the data's byte offset in `file` (-1: not known)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


@dataclass
class Checkpoint:
    """A dense model checkpoint opened lazily.

    Attributes:
        ref: the reference as the user wrote it (folder or hub id).
        path: the resolved folder (None for meta checkpoints used in plan tests).
        config: the parsed ``config.json``.
        tensors: key -> TensorInfo, in file order.
        shared_groups: groups of keys that share one storage in the input (only ``.bin`` can).
    """

    ref: str
    path: Optional[Path]
    config: dict
    tensors: dict[str, TensorInfo]
    shared_groups: list[list[str]] = field(default_factory=list)
    _handles: dict[Any, Any] = field(default_factory=dict, repr=False)  # file -> open handle or mmap

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def read(self, key: str) -> torch.Tensor:
        """Read one tensor from disk as a memory-mapped view of the file's own bytes (no copy).

        safetensors files are mapped copy-on-write (``MAP_PRIVATE``): the view reads the page cache
        directly, and writing to it (nobody should) could never reach the file. Its bytes are
        exactly the ones the header validated by `read_safetensors_header` describes; a tensor
        whose offset is not a multiple of its element size is copied instead.
        """
        info = self.tensors[key]
        if self.path is None:
            return torch.empty(info.shape, dtype=info.dtype, device="meta")
        if info.file.endswith(".safetensors") and info.offset >= 0 and info.offset % info.dtype.itemsize == 0:
            return self._mapped(info)
        try:
            handle = self._handles.get(info.file)
            if handle is None:
                handle = self._open(info.file)
                if info.file.endswith(".safetensors"):
                    # keep one shard open at a time: reads are ordered by shard
                    for name in [n for n in self._handles if isinstance(n, str) and n.endswith(".safetensors")]:
                        del self._handles[name]
                self._handles[info.file] = handle
            return handle.get_tensor(key) if info.file.endswith(".safetensors") else handle[key]
        except SourceError:
            raise
        except Exception as exc:  # a damaged file (or one changed since its header was read): name it
            raise SourceError(f"{self.path / info.file}: cannot read tensor {key!r} ({exc}); "
                              f"the file is damaged or truncated — re-download it") from None

    def _mapped(self, info: TensorInfo) -> torch.Tensor:
        mapping = self._handles.get(("mmap", info.file))
        if mapping is None:
            # keep one shard mapped at a time: reads are ordered by shard (views keep theirs alive)
            for name in [n for n in self._handles if isinstance(n, tuple)]:
                del self._handles[name]
            try:
                with open(self.path / info.file, "rb") as fh:
                    mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as exc:  # removed, unreadable or emptied since its header was read
                raise SourceError(f"{self.path / info.file}: cannot read tensor {info.key!r} "
                                  f"({getattr(exc, 'strerror', None) or exc}); was the file changed during "
                                  f"the build?") from None
            self._handles[("mmap", info.file)] = mapping
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        if info.offset + info.nbytes > len(mapping):
            raise SourceError(f"{self.path / info.file}: cannot read tensor {info.key!r}: the file is shorter than "
                              f"its header said when the build started; was it changed during the build?")
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return raw.view(info.dtype).view(info.shape)

    def _open(self, file: str) -> Any:
        full = self.path / file
        if file.endswith(".safetensors"):
            return safe_open(str(full), framework="pt", device="cpu")
        return _load_bin(full)

    def close(self) -> None:
        self._handles.clear()


def resolve_model(ref: str, field_name: str) -> Path:
    """Resolve a model reference to a local folder.

    Args:
        ref: a folder path, or a hub id (``org/name``, or mergekit's ``org/name@revision``) present
            in the local Hugging Face cache.
        field_name: the YAML field that named it, for messages.

    Raises:
        SourceError: neither a folder nor a cached hub id; says where it looked.
    """
    path = Path(os.path.expanduser(ref))
    if path.is_dir():
        return path.resolve()
    if path.is_file():  # e.g. the model.safetensors itself: not a hub id either
        raise SourceError(f"{field_name}: model {ref!r} is a file, not a model folder; give the folder that holds "
                          f"its config.json and weights ({resolve_or_raise(path, SourceError, field_name).parent})")
    looked = [str(resolve_or_raise(path, SourceError, f"{field_name}: model {ref!r}"))]
    # mergekit's `org/model@revision` (a branch, tag or commit) is looked up in the cache at that revision
    repo, _, revision = ref.partition("@") if ref.count("@") == 1 else (ref, "", "")
    if "/" in repo and not repo.startswith((".", "/", "~")) and repo.count("/") == 1:
        from huggingface_hub import constants, snapshot_download

        # hub ids are case-insensitive (`Mistralai/...` is mistralai's repo), cache folders are not
        for name in [repo] + _cached_spellings(Path(constants.HF_HUB_CACHE), repo):
            try:
                return Path(snapshot_download(name, revision=revision or None, local_files_only=True))
            except Exception:
                pass
        at = f" at revision {revision!r}" if revision else ""
        looked.append(f"the Hugging Face cache {constants.HF_HUB_CACHE}{at}")
    from moe_upcycle.terminal.hints import missing_model_hint

    raise SourceError(f"{field_name}: model {ref!r} not found (looked in {' and '.join(looked)}); "
                      f"{missing_model_hint(ref)}")


def _cached_spellings(cache: Path, repo: str) -> list[str]:
    """Hub ids in the cache that differ from `repo` only in case (the hub treats them as one repo)."""
    want = f"models--{repo.replace('/', '--')}".lower()
    try:
        return [d.name[len("models--"):].replace("--", "/", 1) for d in cache.iterdir()
                if d.name.lower() == want and d.name != f"models--{repo.replace('/', '--')}"]
    except OSError:
        return []


def _repo_and_revision(ref: str) -> tuple[str, ...]:
    """``org/name@rev`` as the arguments of a download command: ("org/name", "--revision", "rev")."""
    repo, _, revision = ref.partition("@") if ref.count("@") == 1 else (ref, "", "")
    return (repo, "--revision", revision) if revision else (repo,)


def open_sources(refs: dict[str, str],
                 opener: Optional[Callable[[str, str], "Checkpoint"]] = None) -> dict[str, "Checkpoint"]:
    """Open every model a recipe names (each once), reporting all missing ones together.

    Args:
        refs: model reference -> the YAML field that names it (`recipe.resolve.source_refs`).
        opener: (reference, YAML field) -> Checkpoint; default `open_checkpoint`
            (`meta_model.meta_source` plans from config.json alone).

    Raises:
        SourceError: every model that could not be opened.
    """
    opener = opener or open_checkpoint
    sources, problems = {}, []
    with stage("read headers", total=len(refs), unit="models") as st:
        for ref, field_name in refs.items():
            try:
                sources[ref] = opener(ref, field_name)
            except SourceError as exc:
                problems += exc.problems
            st.advance(note=ref)
    if problems:
        raise SourceError(*problems)
    return sources


def open_checkpoint(ref: str, field_name: str) -> Checkpoint:
    """Open a dense checkpoint folder lazily (reads config.json and tensor headers only).

    Raises:
        SourceError: missing config/weights, unreadable or inconsistent files.
    """
    try:
        return _open_checkpoint(ref, field_name)
    except OSError as exc:  # a file or folder we may not read (permissions), an I/O error
        where = exc.filename or ref
        raise SourceError(f"{field_name}: cannot read {where} ({exc.strerror or exc}); check that the model folder "
                          f"and its files are readable by you") from None


def _open_checkpoint(ref: str, field_name: str) -> Checkpoint:
    path = resolve_model(ref, field_name)
    config = read_config(path, field_name)
    damaged = side_file_problems(path)
    if damaged:
        raise SourceError(*damaged)
    tensors: dict[str, TensorInfo] = {}
    shared: list[list[str]] = []
    chosen = choose_weights(path, config, field_name)  # the file transformers would load, nothing else
    if chosen is None:
        broken = [f"{name} is a link to {os.readlink(path / name)}, which does not exist" for name in WEIGHT_FILES
                  if (path / name).is_symlink() and not (path / name).exists()]
        from moe_upcycle.terminal.hints import download_command

        cached = not Path(os.path.expanduser(ref)).is_dir()  # resolved from the Hugging Face cache
        raise SourceError(f"{field_name}: {path} has no model.safetensors, model.safetensors.index.json, "
                          f"pytorch_model.bin or pytorch_model.bin.index.json"
                          + (f" ({'; '.join(broken)}: an incomplete download? download it again)" if broken else "")
                          + (f"; the Hugging Face cache holds only part of {ref} (e.g. config.json alone, enough for "
                             f"`plan --from-config`): download the weights with "
                             f"{download_command(*_repo_and_revision(ref))}" if cached else ""))
    index = path / chosen
    files = _index_files(index) if chosen.endswith(".index.json") else {chosen: None}
    found_in: dict[str, list[str]] = {}  # key -> shards holding it (more than one is refused)
    for file, expected in files.items():
        if file.endswith(".safetensors"):
            found = read_safetensors_header(path / file)
        else:
            state = _load_bin(path / file)
            found = {k: TensorInfo(k, tuple(t.shape), t.dtype, file) for k, t in state.items()}
            shared += _shared_storage(state)
        _check_index(path, file, expected, found, index)
        tensors.update(found)
        for key in found:
            found_in.setdefault(key, []).append(file)
    duplicates = duplicate_problems(path, found_in, files, f"{chosen}")
    if duplicates:
        raise SourceError(*duplicates)
    return Checkpoint(ref=ref, path=path, config=config, tensors=tensors, shared_groups=shared)


def read_config(path: Path, field_name: str) -> dict:
    """Read a model folder's config.json, with clear errors."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise SourceError(f"{field_name}: {path} has no config.json; is it a Hugging Face model folder?")
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SourceError(f"{cfg}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise SourceError(f"{cfg}: expected a JSON object")
    missing = [k for k in ("model_type", *REQUIRED_INT_FIELDS) if k not in config]
    nested = [k for k in ("text_config", "language_config", "llm_config") if isinstance(config.get(k), dict)]
    if missing and nested:  # a multimodal model: its language model is described under a sub-config
        raise SourceError(f"{cfg}: describes a {config.get('model_type', 'multimodal')!r} model whose language model "
                          f"is under {nested[0]}; moe-upcycle upcycles a dense language model (Llama, Mistral, Qwen2, "
                          f"Qwen3) saved on its own — give that checkpoint")
    if missing:
        raise SourceError(f"{cfg}: missing required field(s) {', '.join(missing)}")
    wrong = [f"{k} must be a positive integer, got {config[k]!r}" for k in REQUIRED_INT_FIELDS
             if not isinstance(config[k], int) or isinstance(config[k], bool) or config[k] <= 0]
    if not isinstance(config["model_type"], str):
        wrong.insert(0, f"model_type must be a string, got {config['model_type']!r}")
    wrong += value_problems(config)
    if wrong:
        raise SourceError(*[f"{cfg}: {w}" for w in wrong])
    return config


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Parse and sanity-check a safetensors header without reading tensor data.

    The checks are at least as strict as the safetensors library's own (tensors must tile the
    data section exactly), so a file accepted here never fails later, mid-build, on its header.

    Raises:
        SourceError: missing, empty, truncated file or a header that lies (bad offsets, sizes).
    """
    if not file.is_file():
        raise SourceError(f"{file}: shard file is missing")
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise SourceError(f"{file}: empty or truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SourceError(f"{file}: safetensors header claims {n} bytes but the file has {size}; "
                                  f"the file is truncated or not safetensors")
            raw = fh.read(n)
    except OSError as exc:  # permissions, I/O error
        raise SourceError(f"{file}: cannot read it ({exc.strerror or exc}); check that it is readable by you") from None
    header = _parse_header(file, raw)
    if not isinstance(header, dict):
        raise SourceError(f"{file}: safetensors header is not a JSON object")
    meta = header.get("__metadata__")
    meta = {} if meta is None else meta  # safetensors reads a null __metadata__ as none
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SourceError(f"{file}: safetensors __metadata__ must map names to strings; the file is corrupt")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        info, start, end = _header_entry(file, key, entry)
        if end < start or end - start != info.nbytes:
            raise SourceError(f"{file}: tensor {key!r} header is inconsistent: shape {list(info.shape)} of "
                              f"{entry['dtype']} needs {info.nbytes} bytes but its offsets {start}..{end} give "
                              f"{end - start}; the file is corrupt")
        spans.append((start, end, key))
        out[key] = replace(info, offset=8 + n + start)
    spans.sort()
    # safetensors requires the tensors to tile the data section: no overlap, no gap, nothing after
    position, previous = 0, None
    for start, end, key in spans:
        if start < position:
            raise SourceError(f"{file}: tensors {previous!r} and {key!r} overlap in the header; the file is corrupt")
        if start > position:
            raise SourceError(f"{file}: the header leaves bytes {position}..{start} before tensor {key!r} "
                              f"unaccounted for; the file is corrupt")
        position, previous = end, key
    if position > data_size:
        raise SourceError(f"{file}: truncated: the header describes {position} data bytes but the file holds "
                          f"{data_size}; re-download it")
    if position < data_size:
        raise SourceError(f"{file}: {data_size - position} bytes after the last tensor are not described by the "
                          f"header; the file is corrupt — re-download it")
    return {key: out[key] for _, _, key in spans}


def _parse_header(file: Path, raw: bytes) -> Any:
    """The header's JSON, parsed as strictly as the safetensors library parses it.

    Python's `json` is laxer: it guesses UTF-16/32 and skips a byte-order mark when given bytes,
    takes ``NaN``, keeps the last of duplicate names and lets ``"\\ud800"`` through. safetensors
    (and so transformers) refuses such a header; a file it cannot load must not build a model.
    """
    def pairs(items: list[tuple[str, Any]]) -> dict:
        names = [k for k, _ in items]
        for k in names:
            if names.count(k) > 1:
                raise ValueError(f"the name {k!r} appears {names.count(k)} times in one object")
            k.encode("utf-8")  # a lone surrogate escape cannot be UTF-8
        for _, v in items:
            if isinstance(v, str):
                v.encode("utf-8")
        return dict(items)

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and Unicode errors are ValueErrors
        raise SourceError(f"{file}: safetensors header is not valid JSON ({exc}); the file is damaged or not "
                          f"safetensors — re-download it") from None


def _header_entry(file: Path, key: str, entry: Any) -> tuple[TensorInfo, int, int]:
    """One tensor's header entry as (info, start, end); strict about types (no floats, no bools)."""
    def ints(values: Any, length: Optional[int] = None) -> Optional[list[int]]:
        if not isinstance(values, list) or (length is not None and len(values) != length):
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return None
        return values

    if not isinstance(entry, dict):
        raise SourceError(f"{file}: tensor {key!r} has a malformed header entry {entry!r}")
    dtype_name = entry.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        quantized = (" — a quantized checkpoint: upcycle the model's unquantized (bf16, fp16 or fp32) release"
                     if isinstance(dtype_name, str) and dtype_name.startswith(("F8", "F6", "F4", "I4", "U4")) else "")
        raise SourceError(f"{file}: tensor {key!r} has dtype {dtype_name!r}, which moe-upcycle does not read "
                          f"(supported: {', '.join(SAFETENSORS_DTYPES)}){quantized}")
    shape, offsets = ints(entry.get("shape")), ints(entry.get("data_offsets"), 2)
    if shape is None or offsets is None:
        raise SourceError(f"{file}: tensor {key!r} has a malformed header entry {entry!r} "
                          f"(shape and data_offsets must be lists of non-negative integers)")
    return TensorInfo(key, tuple(shape), SAFETENSORS_DTYPES[dtype_name], file.name), offsets[0], offsets[1]


def _index_files(index: Path) -> dict[str, Optional[set[str]]]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):  # not an assert: `python -O` would skip it
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except OSError:
        raise  # unreadable: `open_checkpoint` says so
    except Exception as exc:
        raise SourceError(f"{index}: not a valid index (needs a weight_map object): {exc}") from None
    if not weight_map:
        raise SourceError(f"{index}: its weight_map lists no tensors; the index is damaged — re-download it")
    files: dict[str, Optional[set[str]]] = {}
    safetensors = index.name.endswith(".safetensors.index.json")
    for key, file in weight_map.items():
        # a hostile index must not make us read files outside the model folder
        if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
            raise SourceError(f"{index}: tensor {key!r} is mapped to {file!r}, which is not a file name in the "
                              f"model folder; fix or re-download the index")
        if file.endswith(".safetensors") != safetensors:  # each index is read by one loader only
            raise SourceError(f"{index}: tensor {key!r} is mapped to {file!r}, but a "
                              f"{'safetensors' if safetensors else 'pytorch_model.bin'} index names only "
                              f"{'*.safetensors files' if safetensors else 'PyTorch files (not *.safetensors)'}; "
                              f"fix or re-download the index")
        files.setdefault(file, set()).add(key)
    for file in files:
        if not (index.parent / file).is_file():
            raise SourceError(f"{index.parent / file}: shard file is missing (the index {index.name} lists "
                              f"{len(files[file])} tensor(s) in it); re-download the model")
    return files


def _check_index(path: Path, file: str, expected: Optional[set[str]], found: dict, index: Path) -> None:
    if expected is None:
        return
    missing = sorted(expected - set(found))
    if missing:
        raise SourceError(f"{index}: lists {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + f" in {file}, but {path / file} does not contain it")


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    """Load a pytorch .bin with weights_only=True (no pickled code runs), memory-mapped when it can be.

    Zip-format files (torch >= 1.6) are memory-mapped (lazy pages); legacy-format files cannot be
    and are read into memory.
    """
    if not file.is_file():
        raise SourceError(f"{file}: shard file is missing")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as exc:
        raise SourceError(f"{file}: refused to load ({_unpickle_reason(exc)}): weights_only loading accepts only "
                          f"tensors and plain containers, and a pickle that asks for anything else could run "
                          f"code. Convert the checkpoint to safetensors in a trusted environment, or re-download "
                          f"it if it is damaged") from None
    except OSError:
        raise  # cannot read the file at all: `open_checkpoint` says so
    except Exception as exc:
        raise SourceError(f"{file}: not a readable PyTorch checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise SourceError(f"{file}: expected a dict of tensors, got {type(state).__name__}")
    nested = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if nested:
        # transformers loads only top-level tensors: a wrapper such as {"state_dict": {...}} gives it none of
        # the weights (every one would be initialised at random), so the nested ones are not the model either
        k = nested[0]
        raise SourceError(f"{file}: expected a dict of tensors, but {k!r} holds a {type(state[k]).__name__}"
                          + (f" (and {len(nested) - 1} more entries are not tensors)" if len(nested) > 1 else "")
                          + ("; transformers loads only top-level tensors, so it would read none of the weights "
                             f"under {k!r} (they are not the model it loads). If they are the model, save them "
                             f"unwrapped: torch.save(checkpoint[{k!r}], 'pytorch_model.bin')"
                             if isinstance(state[k], dict) else "; re-download or re-save the model"))
    return state


def _unpickle_reason(exc: Exception) -> str:
    """The line of torch's long weights_only message that says what was refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("Trying to load") or "GLOBAL" in line:
            return line.rstrip(".")
        if line.endswith("WeightsUnpickler error:") and i + 1 < len(lines):
            return lines[i + 1].rstrip(".")
    return lines[0] if lines else type(exc).__name__


def _shared_storage(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Groups of keys whose tensors are the same view of one storage (tied or repeated weights)."""
    groups: dict[tuple, list[str]] = {}
    for key, t in state.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        groups.setdefault(ident, []).append(key)
    return [g for g in groups.values() if len(g) > 1]


def meta_checkpoint(ref: str, config: dict, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Checkpoint:
    """A checkpoint with shapes only (no files), for planning huge models in tests."""
    infos = {k: TensorInfo(k, tuple(s), d, "") for k, (s, d) in tensors.items()}
    return Checkpoint(ref=ref, path=None, config=config, tensors=infos)
