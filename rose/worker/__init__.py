"""rose-worker: the RQ worker that feeds the engine, streams tokens over Redis and stores results."""

from __future__ import annotations

from typing import Any

__all__ = ["NameInUse", "RoseWorker"]


def __getattr__(name: str) -> Any:
    # imported on first use: `rose-worker` in a producer's install (no engine extra) then says what to install
    # instead of failing on an import while the package loads
    if name in __all__:
        from rose.worker import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'rose.worker' has no attribute {name!r}")
