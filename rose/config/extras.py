"""What a producer's install lacks: `pip install rose-worker` has Client, AsyncClient and the producer commands; the
engine, the worker daemon and the offline commands (generate, demo, bench) need the `engine` extra."""

from __future__ import annotations

import importlib.util

# top-level modules that come with the engine extra only (pyproject.toml)
ENGINE_MODULES = frozenset(
    {
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "numba",
        "xgrammar",
        "fakeredis",
        "lupa",
        "prometheus_client",
    }
)
INSTALL_ENGINE = "pip install 'rose-worker[engine]' (torch first: the CPU or CUDA build for this machine)"


def missing_engine(exc: ModuleNotFoundError) -> str | None:
    """The message for a command run without the engine extra, or None when `exc` is about something else (a
    module the engine's packages lack while they are installed: the error itself says more)."""
    top = (exc.name or "").split(".")[0]
    if top not in ENGINE_MODULES or (top != exc.name and importlib.util.find_spec(top) is not None):
        return None
    return f"{exc.name} is not installed: this command needs rose's engine: {INSTALL_ENGINE}"
