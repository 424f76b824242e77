"""Shared fixtures: tiny dense models built on disk once per session, and the real stories260K."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["COLUMNS"] = "200"  # rich tables in CLI output: wide enough that names are not wrapped

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from moe_upcycle.checkpoint.tiny import make_dense_model  # noqa: E402

STORIES = Path(__file__).resolve().parent / "data" / "stories260K"


def pytest_configure(config) -> None:
    """Run the suite in Python's UTF-8 mode whatever locale it inherits.

    The tests give file names and text in UTF-8 (a zero-width space pasted into a model name, CJK output names,
    curly quotes), as a UTF-8 locale lets them. Under another (``LANG=en_US.ISO-8859-1``; ``LC_ALL=POSIX`` with
    ``PYTHONCOERCECLOCALE=0 PYTHONUTF8=0``) this process could not even name those files, so it starts itself again
    in UTF-8 mode, and its children with it (``PYTHONUTF8=1``). What the tool does under such a locale is tested by
    children started with that locale set (tests/test_standard_streams.py). Here, not at import: pytest has stopped
    capturing standard output and error by then, so the new process writes to the terminal.
    """
    import locale
    import sys

    utf8 = sys.getfilesystemencoding().lower() in ("utf-8", "utf8") and \
        locale.getpreferredencoding(False).lower().replace("-", "") == "utf8"
    if sys.flags.utf8_mode or utf8:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-X", "utf8", *sys.orig_argv[1:]], {**os.environ, "PYTHONUTF8": "1"})


PROMPT_TEXT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="session", autouse=True)
def torchrun_logs(tmp_path_factory):
    """torch's launcher (the tests' torchrun jobs, ``build --workers`` in a test) keeps its log folders under pytest's
    own temporary folder, not as ``/tmp/torchelastic_*`` left behind by every job (``PET_LOG_DIR`` is its
    ``--log-dir``, read from the environment each job inherits)."""
    before = os.environ.get("PET_LOG_DIR")
    os.environ["PET_LOG_DIR"] = str(tmp_path_factory.mktemp("torchelastic"))
    yield
    if before is None:
        os.environ.pop("PET_LOG_DIR", None)
    else:
        os.environ["PET_LOG_DIR"] = before


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models) -> Path:
    """Tiny random Llama, untied, single safetensors file."""
    return make_dense_model(models / "llama", family="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_mistral(models) -> Path:
    """Tiny random Mistral, sharded safetensors with an index."""
    return make_dense_model(models / "mistral", family="mistral", seed=1, max_shard_size="40KB")


@pytest.fixture(scope="session")
def tiny_llama_bin_tied(models) -> Path:
    """Tiny Llama as pytorch_model.bin with tied embeddings sharing one storage."""
    return make_dense_model(models / "llama_bin_tied", family="llama", seed=2, tie_word_embeddings=True, fmt="bin")


@pytest.fixture(scope="session")
def stories() -> Path:
    """The real pretrained stories260K (Llama, tied embeddings), vendored under tests/data."""
    assert (STORIES / "model.safetensors").is_file(), f"missing {STORIES}"
    return STORIES


@pytest.fixture
def write_yaml(tmp_path):
    """Write a config mapping to a YAML file and return its path."""

    def write(data: dict, name: str = "experts.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        return path

    return write


def model_logits(folder: Path, text: str = PROMPT_TEXT) -> torch.Tensor:
    """Load a saved model with transformers (fp32) and return its logits on `text`; fails on missing keys."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.inference_mode():
        return model.eval()(**tok(text, return_tensors="pt")).logits


# Architecture fixtures (issue 5): Qwen families with non-trivial norms/biases so copies are checkable.
@pytest.fixture(scope="session")
def tiny_qwen2(models) -> Path:
    """Tiny random Qwen2 with q/k/v biases (random), untied."""
    return make_dense_model(models / "qwen2", family="qwen2", seed=3, random_norms_and_biases=True)


@pytest.fixture(scope="session")
def tiny_qwen2_tied(models) -> Path:
    """Tiny random Qwen2 with q/k/v biases, tied embeddings."""
    return make_dense_model(models / "qwen2_tied", family="qwen2", seed=4, tie_word_embeddings=True,
                            random_norms_and_biases=True)


@pytest.fixture(scope="session")
def tiny_qwen3(models) -> Path:
    """Tiny random Qwen3 with (random) q/k norms, untied, no attention bias."""
    return make_dense_model(models / "qwen3", family="qwen3", seed=5, random_norms_and_biases=True)


@pytest.fixture(scope="session")
def tiny_qwen3_tied_bias(models) -> Path:
    """Tiny random Qwen3 with q/k norms, attention biases (q, k, v, o) and tied embeddings."""
    return make_dense_model(models / "qwen3_tied_bias", family="qwen3", seed=6, tie_word_embeddings=True,
                            attention_bias=True, random_norms_and_biases=True)
