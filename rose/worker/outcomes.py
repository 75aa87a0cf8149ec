"""How a job ends on this worker: finished, failed, canceled, stopped, or requeued. Always through RQ's own
handlers (`handle_job_success` / `handle_job_failure`), so callbacks, dependents, Retry, result_ttl and
failure_ttl behave as RQ documents; then the job's terminal event is queued for publishing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import now

from rose.jobs.events import CanceledEvent, DoneEvent, ErrorEvent, ResetEvent, Usage, token_event_json
from rose.worker import rq_store
from rose.worker.intake import Running
from rose.worker.logs import job_fields
from rose.worker.publisher import KEEP_TTL, NO_EXPIRY, Outgoing

if TYPE_CHECKING:
    from rose.worker.worker import RoseWorker

log = logging.getLogger(__name__)


class RoseJobError(Exception):
    """Raised (for failure callbacks' exc_info) when rose-worker fails a job."""


class RoseJobTimeout(RoseJobError):
    """The job ran past its RQ job timeout."""


STREAM_TTL_REFRESH_S = 60  # a running job's events re-set its stream's expiry this often (it is hours long)


def result_ttl(worker: RoseWorker, job: Job) -> int:
    return job.get_result_ttl(worker.default_result_ttl)


def stream_ttl(worker: RoseWorker, job: Job, run: Running | None = None) -> int:
    """Streams expire with the job's result TTL once the job has ended (-1: never); while the job runs, they
    live at least until its timeout plus that TTL."""
    ttl = result_ttl(worker, job)
    if ttl is not None and ttl < 0:
        return NO_EXPIRY
    ttl = max(1, ttl or 0)
    if run is not None:
        ttl += run.registry_ttl()
    return ttl


def result_dict(worker: RoseWorker, run: Running) -> dict[str, Any]:
    out = run.output
    m = out.metrics
    start = m.arrival_time or run.started_wall
    finished = m.finished_time or time.time()
    generation_s = max(0.0, finished - start)
    completion = len(out.token_ids)
    job = run.job
    queue_s = _queue_s(job)
    streamed = "".join(run.text)
    if streamed != out.text:
        log.error("job %s: streamed text differs from the engine's final text (engine bug?)", run.id)
    return {
        "text": out.text,
        "token_ids": list(out.token_ids),
        "finish_reason": out.finish_reason,
        "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion},
        "metrics": {
            "queue_s": queue_s,
            "ttft_s": (m.first_token_time - start) if m.first_token_time else None,
            "generation_s": generation_s,
            "tokens_per_s": completion / generation_s if generation_s > 0 else None,
        },
        "worker": worker.name,
        "metadata": run.request.metadata if run.request is not None else None,
    }


def _queue_s(job: Job) -> float | None:
    if job.enqueued_at is None or job.started_at is None:
        return None
    return max(0.0, (job.started_at - job.enqueued_at).total_seconds())


class Outcomes:
    """Mixin of RoseWorker: ending jobs and queueing their events (with their log line and metrics)."""

    def _on_taken(self: RoseWorker, run: Running) -> None:
        run.queue_s = _queue_s(run.job)
        self.metrics.on_started(run.queue_s)
        if log.isEnabledFor(logging.INFO):  # the fields are built per job, at every level otherwise
            log.info(
                "job %s taken from %s (%.2f s on the queue)",
                run.id,
                run.queue.name,
                run.queue_s or 0.0,
                extra=job_fields(run, "taken", queue_s=run.queue_s, restarted=run.restarted or None),
            )

    def _on_first_token(self: RoseWorker, run: Running, now: float) -> None:
        run.ttft_s = max(0.0, now - run.started_wall)
        self.metrics.on_first_token(run.ttft_s)
        if log.isEnabledFor(logging.INFO):
            log.info(
                "job %s first token after %.2f s",
                run.id,
                run.ttft_s,
                extra=job_fields(run, "first_token", queue_s=run.queue_s, ttft_s=run.ttft_s),
            )

    def _end_fields(self: RoseWorker, run: Running, event: str, **fields: Any) -> dict[str, Any]:
        """Fields of a job's last log line (failed / canceled / requeued), from what the worker saw of it."""
        return job_fields(
            run,
            event,
            completion_tokens=len(run.token_ids),
            queue_s=run.queue_s,
            ttft_s=run.ttft_s,
            generation_s=max(0.0, time.monotonic() - run.started_mono),
            **fields,
        )

    def _emit(self: RoseWorker, job: Job, event: Any, ttl: int) -> None:
        self._outbox.append(Outgoing(job.id, event.to_json(), ttl))

    def _emit_token(self: RoseWorker, run: Running, text: str, token_ids: list[int]) -> None:
        data = token_event_json(run.id, run.next_seq(), text, token_ids)
        self._outbox.append(Outgoing(run.id, data, self._running_stream_ttl(run)))

    def _emit_reset(self: RoseWorker, run: Running, reason: str = "restart") -> None:
        run.stream_ttl_due = 0.0
        self._emit(run.job, ResetEvent(job_id=run.id, reason=reason), self._running_stream_ttl(run))

    def _running_stream_ttl(self: RoseWorker, run: Running) -> int | None:
        """The stream TTL to send with a running job's event: set by its first event, refreshed now and then,
        otherwise KEEP_TTL (one Redis command less per token)."""
        t = time.monotonic()
        if t < run.stream_ttl_due:
            return KEEP_TTL
        run.stream_ttl_due = t + STREAM_TTL_REFRESH_S
        return stream_ttl(self, run.job, run)

    def _forget(self: RoseWorker, run: Running) -> None:
        self.running.pop(run.id, None)
        rq_store.release(self, run.execution)  # RQ 3's in-memory `worker.executions`
        if run.in_engine:
            run.in_engine = False
            try:
                self.engine.abort(run.id)
            except Exception:  # the request may already be gone from a broken engine
                log.debug("engine.abort(%s) failed", run.id, exc_info=True)

    def _succeed(self: RoseWorker, run: Running) -> None:
        """Store the finished job's result through RQ's `handle_job_success` (three round trips: jobs with a
        success callback, dependents or repeats, and retries; rose.worker.retirer retires the others in batches)
        and publish its `done` event."""
        job = run.job
        result = result_dict(self, run)
        job.ended_at = now()
        job._result = result
        if job.success_callback and not run.callback_done:
            try:
                rq_store.run_success_callback(self, job, result)
            except Exception as exc:  # RQ: a failing success callback fails the job
                log.exception("job %s: success callback failed", job.id)
                self._fail(run, f"success callback failed: {exc!r}", retry=True)
                return
            run.callback_done = True
        job._status = JobStatus.FINISHED
        rq_store.succeed(self, run)
        self._announce_done(run, result)

    def _announce_done(self: RoseWorker, run: Running, result: dict[str, Any] | None = None) -> None:
        """The job's result is stored: let it go and queue its `done` event."""
        job = run.job
        result = result or result_dict(self, run)
        self._forget(run)
        done = DoneEvent(
            job_id=run.id,
            seq=run.next_seq(),
            finish_reason=result["finish_reason"] or "stop",
            usage=Usage(**result["usage"]),
        )
        self._emit(job, done, stream_ttl(self, job))
        self.completed += 1
        self.metrics.on_success(result)
        if not log.isEnabledFor(logging.INFO):
            return
        usage, m = result["usage"], result["metrics"]
        log.info(
            "job %s finished (%s, %d tokens, %.2f s)",
            job.id,
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

    def _fail(
        self: RoseWorker,
        run: Running,
        message: str,
        *,
        retry: bool = True,
        exc_class: type[RoseJobError] = RoseJobError,
        callbacks: bool = True,
    ) -> None:
        """Fail the job through RQ. `retry=False` for deterministic errors (bad input) where RQ's Retry would
        only fail again; `callbacks=False` when the payload is untrusted (not JSON)."""
        job = run.job
        self._forget(run)
        job.ended_at = now()
        job._status = JobStatus.FAILED
        if not retry:
            job.retries_left = None
        exc = exc_class(message)
        exc_string = f"{exc_class.__name__}: {message}\n"
        if callbacks:
            try:
                rq_store.run_failure_callback(self, job, exc_class, exc)
            except Exception:
                log.exception("job %s: failure callback failed", job.id)
        will_retry = rq_store.fail(self, run, exc_string, retry=retry)
        self.metrics.failure.inc()
        log.warning(
            "job %s failed%s: %s",
            job.id,
            " (RQ will retry it)" if will_retry else "",
            message,
            extra=self._end_fields(run, "failed", error=message, will_retry=will_retry),
        )
        if not will_retry:  # a retried job's stream goes on with a reset when it restarts
            self._emit(
                job, ErrorEvent(job_id=run.id, seq=run.next_seq(), message=message), stream_ttl(self, job)
            )

    def _cancel(self: RoseWorker, run: Running, reason: str) -> None:
        """The job was canceled (job.cancel(), client cancel) or deleted: free its slot, clean up, tell subscribers.
        The job is let go once Redis has it: after a Redis error it is still ours, and checked again."""
        rq_store.cancel(self.connection, self, run)
        self._forget(run)
        self._emit(
            run.job,
            CanceledEvent(job_id=run.id, seq=run.next_seq(), reason=reason),
            stream_ttl(self, run.job),
        )
        self.metrics.canceled.inc()
        log.info("job %s %s", run.id, reason, extra=self._end_fields(run, "canceled", reason=reason))

    def _stop(self: RoseWorker, run: Running) -> None:
        """rq's send_stop_job_command: status `stopped`, as RQ's own worker does. The job is let go once Redis has
        it: after a Redis error it is still ours, and the command is tried again."""
        job = run.job
        job.ended_at = now()
        rq_store.stop(self, run)
        self._forget(run)
        if job.stopped_callback is not None:
            try:
                rq_store.run_stopped_callback(self, job)
            except Exception:
                log.exception("job %s: stopped callback failed", job.id)
        self._emit(
            job, CanceledEvent(job_id=run.id, seq=run.next_seq(), reason="stopped"), stream_ttl(self, job)
        )
        self.metrics.canceled.inc()
        log.info(
            "job %s stopped by command", job.id, extra=self._end_fields(run, "canceled", reason="stopped")
        )

    def fail_orphan(
        self: RoseWorker, job: Job, queue: Queue, execution: Execution, owner: str, requeues: int
    ) -> None:
        """A job whose workers died `requeues` times already: fail it instead of requeueing it again."""
        message = (
            f"the job was requeued {requeues} times after its worker died while running it (last: {owner or '?'}); "
            f"failing it instead of retrying forever, as it may be what crashes workers (--max-requeues)"
        )
        run = Running(
            job=job,
            queue=queue,
            execution=execution,
            started_wall=time.time(),
            started_mono=time.monotonic(),
            timeout=None,
        )
        self._emit_reset(run, reason="worker died")
        self._fail(run, message, retry=False)
