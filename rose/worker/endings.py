"""How a job ends on this worker: finished, failed, canceled, stopped. Each ending is written through RQ's own
handlers (rose.worker.rq_store), so callbacks, dependents, Retry, result_ttl and failure_ttl behave as RQ
documents; then the job's terminal event is queued (rose.worker.outbox), its metrics counted and its last log line
written. An ending raises on a Redis error before anything is queued: the caller decides what is still owed.

Endings never touch the loop's running jobs: the loop lets a job go (rose.worker.loop) before or after calling
them, as each of its callers documents.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rose.jobs.events import CanceledEvent, DoneEvent, ErrorEvent, Usage
from rose.worker import faults, rq_store, seal
from rose.worker.logs import job_fields
from rose.worker.metrics import WorkerMetrics
from rose.worker.outbox import Outbox
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

log = logging.getLogger(__name__)


class RoseJobError(Exception):
    """Raised (for failure callbacks' exc_info) when rose-worker fails a job."""


class RoseJobTimeout(RoseJobError):
    """The job ran past its RQ job timeout."""


class DeadlineExceeded(RoseJobError):
    """The job's deadline passed before this attempt started, or while it ran (--deadline-policy abort)."""


class Endings:
    """The ends of this worker's jobs (`completed`: how many it stored as finished). What comes before a job's end
    (taken, first token) is rose.worker.milestones; the result's and the failure message's shapes are the job
    contract's (rose.jobs.contract)."""

    def __init__(self, rq: RQWorker, outbox: Outbox, metrics: WorkerMetrics) -> None:
        self.rq = rq
        self.outbox = outbox
        self.metrics = metrics
        self.completed = 0  # jobs stored as finished by this worker

    def run_success_callback(self, run: Running) -> Exception | None:
        """The job's success callback, before RQ's handler stores it; what it raised, if it did (RQ then fails the
        job)."""
        try:
            rq_store.run_success_callback(self.rq, run.job, run.result)
        except Exception as exc:
            log.exception("job %s: success callback failed", run.id)
            return exc
        return None

    def succeed(self, run: Running) -> None:
        """Store the finished job through RQ's `handle_job_success` (jobs with dependents, repeats, a success
        callback, or handed back by the retirer; rose.worker.retirer stores the others in batches)."""
        seal.mark(self.rq.connection, run, self.rq.name)
        rq_store.succeed(self.rq, run, run.result)  # type: ignore[arg-type]
        self.stored(run)

    def stored(self, run: Running, announced: bool = False) -> None:
        """The job's result is stored (by `succeed`, or by a retirer batch with its `done` event: `announced`): its
        `done` event if not written yet, metrics, log line. A job found stored after a lost reply announces itself
        here: written only if its seal marker is there (RQ's handler stored it), a no-op after a retirer batch."""
        faults.point("result_stored")
        result = run.result or run.build_result(self.rq.name)
        if not announced:
            self.outbox.terminal(
                run,
                DoneEvent,
                finish_reason=result["finish_reason"] or "stop",
                usage=Usage(**result["usage"]),
            )
        self.completed += 1
        self.metrics.on_success(result)
        if not log.isEnabledFor(logging.INFO):
            return
        usage, m = result["usage"], result["metrics"]
        log.info(
            "job %s finished (%s, %d tokens, %.2f s)",
            run.id,
            result["finish_reason"],
            usage["completion_tokens"],
            m["generation_s"],
            extra=job_fields(
                run,
                "finished",
                finish_reason=result["finish_reason"],
                prompt_tokens=usage["prompt_tokens"],
                completion_tokens=usage["completion_tokens"],
                queue_s=m["queue_s"],
                ttft_s=m["ttft_s"],
                generation_s=m["generation_s"],
                tokens_per_s=m["tokens_per_s"],
            ),
        )

    def fail(
        self,
        run: Running,
        message: str,
        *,
        retry: bool = True,
        exc_class: type[RoseJobError] = RoseJobError,
        callbacks: bool = True,
    ) -> None:
        """Fail the job through RQ. `retry=False` for deterministic errors (bad input) where RQ's Retry would
        only fail again; `callbacks=False` when the payload is untrusted (not a rose job)."""
        if not rq_store.will_retry(
            run.job, retry
        ):  # it ends here: its error event is owed (rose.worker.seal)
            seal.mark(self.rq.connection, run, self.rq.name)
        will_retry = rq_store.fail(self.rq, run, exc_class(message), retry=retry, callbacks=callbacks)
        faults.point("failure_stored")
        self.metrics.failure.inc()
        log.warning(
            "job %s failed%s: %s",
            run.id,
            " (RQ will retry it)" if will_retry else "",
            message,
            extra=self._end_fields(run, "failed", error=message, will_retry=will_retry),
        )
        if will_retry:  # a retried job's stream goes on with a reset when it restarts
            self.outbox.forget(run)
        else:
            self.outbox.terminal(run, ErrorEvent, message=message)

    def cancel(self, run: Running, reason: str) -> None:
        """The job was canceled (job.cancel(), client cancel) or deleted: clean up, tell subscribers."""
        seal.mark(self.rq.connection, run, self.rq.name)
        rq_store.cancel(self.rq.connection, self.rq, run)
        self.outbox.terminal(run, CanceledEvent, reason=reason)
        self.metrics.canceled.inc()
        log.info("job %s %s", run.id, reason, extra=self._end_fields(run, "canceled", reason=reason))

    def failed_elsewhere(self, run: Running) -> None:
        """Someone else stored the job as failed while it ran here (RQ's cleanup of a registry entry it took for
        abandoned, after a long outage): its subscribers get the error event."""
        message = (
            "the job was failed by RQ while this worker ran it (its registry entry was taken for abandoned)"
        )
        seal.mark(self.rq.connection, run, self.rq.name)
        self.outbox.terminal(run, ErrorEvent, message=message)
        self.metrics.failure.inc()
        log.warning("job %s: %s", run.id, message, extra=self._end_fields(run, "failed", error=message))

    def stop(self, run: Running) -> None:
        """`rq`'s stop commands: status `stopped`, as RQ's own worker does."""
        seal.mark(self.rq.connection, run, self.rq.name)
        rq_store.stop(self.rq, run)
        self.outbox.terminal(run, CanceledEvent, reason="stopped")
        self.metrics.canceled.inc()
        log.info(
            "job %s stopped by command", run.id, extra=self._end_fields(run, "canceled", reason="stopped")
        )

    def fail_orphan(self, run: Running, owner: str, requeues: int) -> None:
        """A job whose workers died `requeues` times already: failed instead of requeued again."""
        message = (
            f"the job was requeued {requeues} times after its worker died while running it (last: {owner or '?'}); "
            f"failing it instead of retrying forever, as it may be what crashes workers (--max-requeues)"
        )
        self.outbox.reset(run, reason="worker died")
        self.fail(run, message, retry=False)

    def requeued(self, run: Running, reason: str) -> None:
        self.metrics.requeued.inc()
        log.info("job %s requeued", run.id, extra=self._end_fields(run, "requeued", reason=reason))

    def _end_fields(self, run: Running, event: str, **fields: Any) -> dict[str, Any]:
        """Fields of a job's last log line, from what the worker saw of it."""
        return job_fields(
            run,
            event,
            completion_tokens=run.num_tokens,
            queue_s=run.queue_s,
            ttft_s=run.ttft_s,
            generation_s=max(0.0, time.monotonic() - run.started_mono),
            **fields,
        )
