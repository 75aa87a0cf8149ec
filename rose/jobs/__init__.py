"""The rose job contract: RQ jobs calling `rose.jobs.generate`, enqueued with RQ's JSONSerializer.

See docs/jobs.md for the full contract (arguments, result, token events, Redis keys).
"""

from __future__ import annotations

from typing import Any, NoReturn

from rose.jobs.keys import DEFAULT_QUEUE, FUNC_PATH

__all__ = ["DEFAULT_QUEUE", "FUNC_PATH", "WrongWorkerError", "generate"]


class WrongWorkerError(RuntimeError):
    """A rose job was picked up by something other than rose-worker."""


def generate(*args: Any, **kwargs: Any) -> NoReturn:
    """The function a rose job names. Only `rose-worker` runs these jobs (many at once, in one batched engine);
    rose-worker never calls this function.

    A stock `rq worker` that picks the job up lands here: rather than loading a model per job (slow, and the
    tokens would never be streamed), the job fails at once with this explanation. Requeue it from the failed
    registry (`rq requeue -S json --queue <q> <job_id>`) once a rose-worker serves the queue.
    """
    raise WrongWorkerError(
        "rose.jobs.generate jobs must be run by the rose-worker daemon (continuous-batching engine + token "
        "streaming), not by a stock `rq worker`. Start `rose-worker --redis-url <url> --queue <queue>` and keep "
        "stock RQ workers off this queue; requeue this job with `rq requeue -S json --queue <queue> <job_id>`."
    )
