"""moe-upcycle: turn dense decoder LLM checkpoints into Mixture-of-Experts checkpoints."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moe-upcycle")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

from moe_upcycle.build import BuildResult, upcycle  # noqa: E402
from moe_upcycle.recipe.schema import UpcycleConfig, load_config  # noqa: E402
from moe_upcycle.errors import ConfigError, OutputError, PlanError, SourceError, UpcycleError, UpcycleWarning  # noqa: E402
from moe_upcycle.in_memory import upcycle_model  # noqa: E402

__all__ = [
    "BuildResult", "ConfigError", "OutputError", "PlanError", "SourceError", "UpcycleConfig", "UpcycleError",
    "UpcycleWarning", "__version__", "load_config", "upcycle", "upcycle_model",
]
