"""Helpers for the robustness tests: run the CLI (in-process or as a real subprocess) and check
that a failed build left nothing behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from moe_upcycle.cli import app

REPO = Path(__file__).resolve().parents[1]

# The signals the tool handles (and SIGPIPE): a test run under ``nohup``, in a background job or a CI runner may
# inherit any of them ignored, and children inherit that; the tool rightly keeps an ignored signal ignored.
HANDLED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGPIPE")
                        if hasattr(signal, name))


def default_signals() -> None:
    """`preexec_fn` for a child whose signals a test sends or relies on: each as a fresh shell gives them, not as
    this test run inherited them."""
    for sig in HANDLED_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def signal_defaults():
    """In this process: SIGINT raises KeyboardInterrupt and the other handled signals are at their default, as
    in a fresh process (what the CLI then installs its handlers over); the previous dispositions after."""
    previous = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    try:
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def cli(*args: str) -> tuple[int, str]:
    """Run ``moe-upcycle ARGS`` in-process; return (exit code, stdout+stderr)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def module_env() -> dict:
    """Environment for ``python -m moe_upcycle`` that imports this worktree's package."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("COLUMNS", None)
    return env


def module_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_upcycle", *[str(a) for a in args]]


def run_module(*args: str, timeout: float = 120) -> tuple[int, str]:
    """Run ``python -m moe_upcycle ARGS`` as a subprocess; return (exit code, stdout+stderr)."""
    proc = subprocess.run(module_cmd(*args), cwd=REPO, env=module_env(), capture_output=True, text=True,
                          timeout=timeout, preexec_fn=default_signals)
    return proc.returncode, proc.stdout + proc.stderr


def leftovers(target: Path) -> list[str]:
    """Names beside `target` that a build makes: the target itself, its lock, staging and swap folders."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    return sorted(p.name for p in target.parent.iterdir()
                  if p.name == target.name or p.name.startswith(f".{target.name}."))


def assert_clean_failure(code: int, output: str, target: Path, words: list[str], expected_code: int = 1) -> None:
    """The build failed with `expected_code`, said every word in `words`, printed no traceback, wrote nothing."""
    assert code == expected_code, f"exit code {code}, output:\n{output}"
    flat = " ".join(output.split())  # rich may wrap long paths
    for word in words:
        assert word in flat, f"{word!r} not in:\n{output}"
    assert "Traceback" not in output, output
    assert leftovers(target) == [], f"left behind: {leftovers(target)}"


def previous_build(folder: Path, files: dict[str, str]) -> Path:
    """A stand-in for an earlier build's output: `files` plus a manifest recording their sha256."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    digests = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()}
    (folder / "moe_upcycle.json").write_text(json.dumps({"tool": "moe-upcycle", "sha256": digests}))
    return folder


def write_big_llama(folder: Path) -> Path:
    """A Llama-shaped dense checkpoint of ~13 MB (written directly: no transformers model needed); 8 experts of
    it in 4 MB shards are 104 MB of output in 33 shards, long enough to stop a build midway."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, vocab, kv = 256, 1024, 4, 512, 128
    folder = Path(folder)
    folder.mkdir(parents=True)
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, vocab_size=vocab, num_attention_heads=4, num_key_value_heads=2,
               head_dim=hidden // 4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=256,
               tie_word_embeddings=False, torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
             "lm_head.weight": torch.randn(vocab, hidden, generator=g), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
                      p + "self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=g),
                      p + "self_attn.k_proj.weight": torch.randn(kv, hidden, generator=g),
                      p + "self_attn.v_proj.weight": torch.randn(kv, hidden, generator=g),
                      p + "self_attn.o_proj.weight": torch.randn(hidden, hidden, generator=g),
                      p + "mlp.gate_proj.weight": torch.randn(inter, hidden, generator=g),
                      p + "mlp.up_proj.weight": torch.randn(inter, hidden, generator=g),
                      p + "mlp.down_proj.weight": torch.randn(hidden, inter, generator=g)})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
