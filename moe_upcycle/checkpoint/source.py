"""Lazy readers for dense checkpoints: headers first, tensor bytes one at a time.

A `Checkpoint` knows every tensor's shape and dtype from the safetensors headers (`headers`) or
from a ``weights_only`` memory-mapped load of ``pytorch_model*.bin`` (`bin_files`), for exactly
the files transformers would load (`weight_files`), without reading any tensor data.
`read(key)` returns one tensor; one open handle per shard file is kept. It does not check
checkpoints against each other: that is `plan`'s job.

Model references are local folders, or hub ids resolved from the local Hugging Face cache
(`model_refs`; offline, nothing is downloaded). mergekit's ``model+adapter`` opens the model with
a `lora.Adapter` attached, and `read` returns each adapted tensor with the adapter merged in.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open

from moe_upcycle.errors import SourceError, reraise_if_out_of_memory
from moe_upcycle.terminal.progress import stage
from moe_upcycle.checkpoint.quantized import foreign_folder_hint, quantized_problem
from moe_upcycle.inputs.paths import broken_link, symlink_loop
from moe_upcycle.checkpoint.config_checks import side_file_problems
from moe_upcycle.checkpoint.dense_config import DenseConfig, dense_config
from moe_upcycle.checkpoint.bin_files import load_bin, shared_storage
from moe_upcycle.checkpoint.file_stamp import FileStamp
from moe_upcycle.checkpoint.headers import TensorInfo, read_safetensors_header
from moe_upcycle.checkpoint.lora import Adapter, reference_parts
from moe_upcycle.checkpoint.model_refs import repo_and_revision, resolve_model
from moe_upcycle.checkpoint.weight_files import WEIGHT_FILES, check_index, choose_weights, duplicate_problems, index_files



@dataclass
class Checkpoint:
    """A dense model checkpoint opened lazily.

    Attributes:
        ref: the reference as the user wrote it (folder or hub id).
        path: the resolved folder (None for meta checkpoints used in plan tests).
        config: the checked ``config.json`` (`dense_config.DenseConfig`: typed attributes, and a read-only mapping
            of its JSON values); a plain dict for checkpoints made by hand in tests (see `fields`).
        tensors: key -> TensorInfo, in file order.
        shared_groups: groups of keys that share one storage in the input (only ``.bin`` can).
        adapter: the LoRA adapter merged into what `read` returns (a ``model+adapter`` reference).
        model_ref: the model part of `ref` (`ref` itself without an adapter).
        from_config: the tensors were derived from config.json (`meta_checkpoint`), not read.
    """

    ref: str
    path: Optional[Path]
    config: Mapping
    tensors: dict[str, TensorInfo]
    shared_groups: list[list[str]] = field(default_factory=list)
    adapter: Optional[Adapter] = None
    model_ref: str = ""
    from_config: bool = False
    # file -> its stamp when its header was read: a file replaced or rewritten since is never read (`check_unchanged`)
    stamps: dict[str, FileStamp] = field(default_factory=dict, repr=False)
    _handles: dict[Any, Any] = field(default_factory=dict, repr=False)  # file -> open handle or mmap

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def fields(self) -> DenseConfig:
        """The typed view of `config`: itself when read from a folder, else checked now (a config made by hand).

        Raises:
            SourceError: a config made by hand has a field of the wrong type.
        """
        if not isinstance(self.config, DenseConfig):
            self.config = dense_config(dict(self.config), f"{self.ref} config")
        return self.config

    def identity(self, key: str) -> tuple[str, str]:
        """Which bytes `read(key)` returns: (the model's folder, key), with the adapter's folder for a tensor it changes.

        By folder, not by reference: ``./base``, ``base`` and ``/abs/base/`` read the same bytes, as does the
        same model under two adapters for every tensor neither adapts, so those slots may share one tensor.
        """
        model = str(self.path) if self.path is not None else (self.model_ref or self.ref)
        if self.adapter is not None and self.adapter.changes(key):
            return (f"{model}+{self.adapter.path.resolve()}" if self.path is not None else self.ref, key)
        return (model, key)

    def read(self, key: str) -> torch.Tensor:
        """Read one tensor (with the LoRA adapter merged in, when there is one and it adapts `key`)."""
        tensor = self._read(key)
        if self.adapter is not None and self.adapter.changes(key) and self.path is not None:
            try:
                return self.adapter.merge(key, tensor)
            except SourceError:
                raise
            except Exception as exc:  # a damaged adapter file
                reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
                raise SourceError(f"{self.adapter.file}: cannot merge LoRA weights for {key!r} ({exc}); the adapter "
                                  f"file is damaged — save it again") from None
        return tensor

    def read_unmerged(self, key: str) -> torch.Tensor:
        """The model's own tensor, without the LoRA adapter (to tell which of the two a bad value comes from)."""
        return self._read(key)

    def _read(self, key: str) -> torch.Tensor:
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
            return handle.get_tensor(info.key) if info.file.endswith(".safetensors") else handle[info.key]
        except SourceError:
            raise
        except Exception as exc:  # a damaged file (or one changed since its header was read): name it
            reraise_if_out_of_memory(exc)  # a file that did not fit is not a damaged file
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
                    self._same_file(info.file, os.fstat(fh.fileno()))  # the bytes mapped are the ones planned
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
        self._same_file(file, os.stat(full))
        if file.endswith(".safetensors"):
            return safe_open(str(full), framework="pt", device="cpu")
        return load_bin(full)

    def close(self) -> None:
        self._handles.clear()

    def check_unchanged(self) -> None:
        """Refuse a build whose source files changed on disk after their headers were read.

        A folder re-saved while a build reads it (``save_pretrained`` into a folder being built from,
        a download finishing) would give the MoE tensors from two versions of the model, or bytes at
        offsets the new file does not use. Called before the output is published, and by each read.

        Raises:
            SourceError: a file is gone, or its size, modification time or inode changed.
        """
        for file, then in self.stamps.items():
            then.check(self.path / file)
        if self.adapter is not None:
            self.adapter.check_unchanged()

    def _same_file(self, file: str, now: os.stat_result) -> None:
        if file in self.stamps:
            self.stamps[file].check(self.path / file, now)


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
        raise _unreadable(exc, field_name, ref) from None


def _unreadable(exc: OSError, field_name: str, where: object) -> SourceError:
    """A model file or folder that could not be read, named with the recipe field that gave the model."""
    named = symlink_loop(exc)  # a link loop or a name too long: the path is wrong, not its permissions
    if named:
        return SourceError(f"{field_name}: {named}")
    return SourceError(f"{field_name}: cannot read {exc.filename or where} ({exc.strerror or exc}); check that the "
                       f"model folder and its files are readable by you")


def _open_checkpoint(ref: str, field_name: str, adapter_given: bool = False) -> Checkpoint:
    model_ref, adapter_ref = reference_parts(ref, field_name)
    if adapter_ref is not None:
        model = _open_checkpoint(model_ref, field_name, adapter_given=True)
        model.adapter = Adapter.open(adapter_ref, field_name, model.tensors, model_ref)
        model.ref, model.model_ref = ref, model_ref
        return model
    path = resolve_model(ref, field_name)
    config = read_config(path, field_name)
    if not adapter_given and (path / "adapter_config.json").is_file():
        # AutoModelForCausalLM.from_pretrained (with peft installed) loads such a folder's model and then applies
        # the adapter: the weights alone are not the model users of this folder run
        raise SourceError(f"{field_name}: {path} holds a model and a PEFT adapter (adapter_config.json), which "
                          f"transformers applies on top of the model when it loads the folder; write {ref}+{ref} to "
                          f"build from the model with the adapter merged in, as transformers runs it, or move "
                          f"adapter_config.json out of the folder to build from the model alone")
    damaged = side_file_problems(path)
    if damaged:
        raise SourceError(*damaged)
    tensors: dict[str, TensorInfo] = {}
    shared: list[list[str]] = []
    chosen = choose_weights(path, config, field_name)  # the file transformers would load, nothing else
    if chosen is None:
        broken = [f"{name} is {link}" for name in WEIGHT_FILES if (link := broken_link(path / name))]
        from moe_upcycle.terminal.hints import download_command

        cached = not Path(os.path.expanduser(ref)).is_dir()  # resolved from the Hugging Face cache
        raise SourceError(f"{field_name}: {path} has no model.safetensors, model.safetensors.index.json, "
                          f"pytorch_model.bin or pytorch_model.bin.index.json"
                          + (f" ({'; '.join(broken)}: an incomplete download? download it again)" if broken else "")
                          + ("" if broken else foreign_folder_hint(path))
                          + (f"; the Hugging Face cache holds only part of {ref} (e.g. config.json alone, enough for "
                             f"`plan --from-config`): download the weights with "
                             f"{download_command(*repo_and_revision(ref))}" if cached else ""))
    index = path / chosen
    files = index_files(index) if chosen.endswith(".index.json") else {chosen: None}
    found_in: dict[str, list[str]] = {}  # key -> shards holding it (more than one is refused)
    stamps: dict[str, FileStamp] = {}
    for file, expected in files.items():
        stamps[file] = FileStamp.of(os.stat(path / file))  # before the header: a change while reading it shows
        if file.endswith(".safetensors"):
            found = read_safetensors_header(path / file)
        else:
            state = load_bin(path / file)
            found = {k: TensorInfo(k, tuple(t.shape), t.dtype, file) for k, t in state.items()}
            shared += shared_storage(state)
        check_index(path, file, expected, found, index)
        tensors.update(found)
        for key in found:
            found_in.setdefault(key, []).append(file)
    duplicates = duplicate_problems(path, found_in, files, f"{chosen}")
    if duplicates:
        raise SourceError(*duplicates)
    quantized = quantized_problem(tensors, f"{field_name}: {path}")
    if quantized:
        raise SourceError(quantized)
    if _saved_without_prefix(tensors):
        tensors, shared = _as_causal_lm(tensors, shared, config, path, field_name)
    return Checkpoint(ref=ref, path=path, config=config, tensors=tensors, shared_groups=shared, stamps=stamps)


def _saved_without_prefix(tensors: dict[str, TensorInfo]) -> bool:
    """The weights of a bare decoder (``LlamaModel.save_pretrained``): ``layers.0...``, not ``model.layers.0...``,
    and no head. (Prefix-less layers beside an ``lm_head.weight`` are not read: transformers 5 loads such a
    folder, 4.57 calls its state dict corrupted.)"""
    return (bool(tensors) and not any(k.startswith(("model.", "lm_head.")) for k in tensors)
            and "embed_tokens.weight" in tensors and any(k.startswith("layers.") for k in tensors))


def _as_causal_lm(tensors: dict[str, TensorInfo], shared: list[list[str]], config: dict, path: Path,
                  field_name: str) -> tuple[dict[str, TensorInfo], list[list[str]]]:
    """The tensors under the names transformers gives them when it loads the folder as a ...ForCausalLM.

    transformers adds the decoder's ``model.`` prefix, so the folder loads and computes as the causal
    LM — when config.json ties lm_head to the embedding. Untied, it has no head to load, and
    transformers would start one at random: refused. A `TensorInfo` keeps its key in the file.
    """
    if not config.get("tie_word_embeddings", False):
        raise SourceError(f"{field_name}: {path} holds a decoder saved without its LM head (tensor names such as "
                          f"'embed_tokens.weight', no 'model.' prefix and no lm_head.weight; architectures "
                          f"{config.get('architectures')}) and config.json does not tie lm_head to the embedding, so "
                          f"transformers would give it a random output head; give the ...ForCausalLM checkpoint "
                          f"(AutoModelForCausalLM.from_pretrained(...).save_pretrained(folder))")
    return {"model." + k: info for k, info in tensors.items()}, [["model." + k for k in group] for group in shared]


def read_config(path: Path, field_name: str) -> DenseConfig:
    """Read a model folder's config.json into its checked, typed view (`dense_config`), with clear errors.

    Raises:
        SourceError: no config.json, not JSON, or any field of a wrong type or out of bounds (every one, named
            with the file, the value and the fix).
    """
    cfg = path / "config.json"
    link = broken_link(cfg)
    if link:
        raise SourceError(f"{field_name}: {cfg} is {link}; download the model again, or copy the files the links "
                          f"point to")
    try:
        if not cfg.is_file():
            hint = foreign_folder_hint(path)
            raise SourceError(f"{field_name}: {path} has no config.json"
                              + (hint if hint else "; is it a Hugging Face model folder?"))
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SourceError(f"{cfg}: not valid JSON ({exc})") from None
    except OSError as exc:  # as `open_checkpoint` says it: plan --from-config and the lint's plan read only this
        raise _unreadable(exc, field_name, cfg) from None
    return dense_config(config, str(cfg))


def meta_checkpoint(ref: str, config: dict, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Checkpoint:
    """A checkpoint with shapes only (no files), for planning huge models in tests."""
    infos = {k: TensorInfo(k, tuple(s), d, "") for k, (s, d) in tensors.items()}
    return Checkpoint(ref=ref, path=None, config=config, tensors=infos, from_config=True)
