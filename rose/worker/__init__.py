"""rose-worker: the RQ worker that feeds the engine, streams tokens over Redis and stores results."""

from rose.worker.worker import NameInUse, RoseWorker

__all__ = ["NameInUse", "RoseWorker"]
