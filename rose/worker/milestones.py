"""A running job's milestones before its end: taken, first token. Each records the job's timing on its `Running`,
feeds the metrics and writes the job's log line; a job taken again after an attempt that streamed begins its stream
with a `reset` event. How a job ends (stored, failed, canceled, stopped, requeued): rose.worker.endings.

The job loop (rose.worker.loop) calls them; they never touch its running jobs nor Redis (events go to the outbox).
"""

from __future__ import annotations

import logging

from rose.jobs.contract import queue_seconds
from rose.worker.logs import job_fields
from rose.worker.metrics import WorkerMetrics
from rose.worker.outbox import Outbox
from rose.worker.running import Running

log = logging.getLogger(
    "rose.worker.endings"
)  # the job log: every line of a job's life under one logger (docs/operations.md)


class Milestones:
    __slots__ = ("metrics", "outbox")

    def __init__(self, outbox: Outbox, metrics: WorkerMetrics) -> None:
        self.outbox = outbox
        self.metrics = metrics

    def taken(self, run: Running) -> None:
        """The job was started here (before its request is parsed): its time on the queue, its `taken` line."""
        run.queue_s = queue_seconds(run.job)
        self.metrics.on_started(run.queue_s)
        if log.isEnabledFor(logging.INFO):  # the fields are built per job, at every level otherwise
            log.info(
                "job %s taken from %s (%.2f s on the queue)",
                run.id,
                run.queue.name,
                run.queue_s or 0.0,
                extra=job_fields(run, "taken", queue_s=run.queue_s, restarted=run.restarted or None),
            )
        if run.restarted:
            self.outbox.reset(run)

    def first_token(self, run: Running, now: float) -> None:
        """The engine gave the job its first token at `now` (wall clock): its TTFT, its `first_token` line."""
        run.ttft_s = max(0.0, now - run.started_wall)
        self.metrics.on_first_token(run.ttft_s)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "job %s first token after %.2f s",
                run.id,
                run.ttft_s,
                extra=job_fields(run, "first_token", queue_s=run.queue_s, ttft_s=run.ttft_s),
            )
