"""Keep the libraries we call from talking over our output while a command runs.

transformers draws its own "Loading weights" progress bars and logs advice meant for training
code; torch and transformers warn about zero-element tensors (e.g. initialising an empty bias of
a Qwen model with no shared expert), which says nothing a user of this tool can act on. Inside
`libraries_quiet()` those are silenced; our own messages (`UpcycleWarning`, errors, progress)
are not touched, nor are other libraries' warnings. Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Iterator

# warnings that carry no action for our users (regexes on the message, any category)
NOISE = (r"Initializing zero-element tensors is a no-op",)
LOGGERS = ("transformers", "accelerate", "sentence_transformers", "huggingface_hub")


@contextlib.contextmanager
def libraries_quiet() -> Iterator[None]:
    """Silence transformers' progress bars and info logs, and zero-element tensor warnings, in the block.

    transformers reads its verbosity when it is first imported, so the environment is set for an
    import inside the block too; a module imported inside the block is set back to its defaults at
    the end.
    """
    from huggingface_hub import utils as hub_utils

    hub_bars = not hub_utils.are_progress_bars_disabled()
    hub_utils.disable_progress_bars()  # transformers' "Loading weights" bars follow this flag at import
    env = {k: os.environ.get(k) for k in ("TRANSFORMERS_VERBOSITY",)}
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    tf_bars = _set_transformers_bars(False)
    try:
        with warnings.catch_warnings():
            for pattern in NOISE:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        _set_transformers_bars(True if tf_bars is None else tf_bars)
        if hub_bars:
            hub_utils.enable_progress_bars()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _set_transformers_bars(enabled: bool):
    """Switch transformers' tqdm bars (if transformers is imported); returns the previous state or None."""
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is None:
        return None
    was = tf_logging.is_progress_bar_enabled()
    (tf_logging.enable_progress_bar if enabled else tf_logging.disable_progress_bar)()
    return was
