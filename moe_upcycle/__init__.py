"""moe-upcycle: turn dense decoder LLM checkpoints into Mixture-of-Experts checkpoints."""

from moe_upcycle.errors import ConfigError, OutputError, PlanError, SourceError, UpcycleError, UpcycleWarning  # noqa: E402

# Imported on first use (PEP 562): `import moe_upcycle` stays cheap, so the command line can set up
# its signal handling before torch and transformers load (see `terminal.signals.quiet_startup`).
_LAZY = {"BuildResult": "build", "upcycle": "build", "UpcycleConfig": "recipe.schema", "load_config": "recipe.schema",
         "upcycle_model": "in_memory", "save_hf_folder": "distributed.dcp_export"}


def __getattr__(name: str):
    import importlib

    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("moe-upcycle")
        except PackageNotFoundError:  # running from a source tree that is not installed
            value = "0.0.0+local"
        globals()[name] = value
        return value
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None

__all__ = [
    "BuildResult", "ConfigError", "OutputError", "PlanError", "SourceError", "UpcycleConfig", "UpcycleError",
    "UpcycleWarning", "__version__", "load_config", "save_hf_folder", "upcycle", "upcycle_model",
]
