"""Waiting for many jobs at once (`Client.as_completed`, `Client.results`).

`Job.result()` one job after another costs a few round trips per job (the job's hash, its status, its result). Here
one XREAD blocks on RQ's result streams (`rq:results:<id>`) of every pending job and returns the new results
themselves: one round trip per wake-up, however many jobs end at once. The statuses of all pending jobs are read (one
pipeline, plus one for the results of those finished) at the start and after a wait with no result, which is how a
job canceled or deleted without a result is noticed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

import redis
from rq.job import JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from rose.jobs import keys
from rose.jobs.errors import JobCanceled, JobFailed

POLL_S = 1.0  # longest blocking read: a job canceled or failed without a result is noticed this late at worst
_PENDING = object()
_ENDED = {JobStatus.FAILED.value, JobStatus.CANCELED.value, JobStatus.STOPPED.value}


class Waitable(Protocol):
    """What is waited for: a job's id, and `result()`, which says what an ended job came to (`Client`'s `Job`)."""

    id: str

    def result(self, timeout: float | None = None) -> dict[str, Any]: ...


J = TypeVar("J", bound=Waitable)


def as_completed(
    r: redis.Redis, jobs: Iterable[J], timeout: float | None = None
) -> Iterator[tuple[J, dict[str, Any] | Exception]]:
    """(job, result dict) or (job, JobFailed / JobCanceled) for each job as it ends, in the order they end, the
    jobs' Redis connection `r` read directly. TimeoutError if some are still pending after `timeout` seconds."""
    pending = {job.id: job for job in jobs}
    deadline = None if timeout is None else time.monotonic() + timeout
    with r.pipeline(transaction=False) as pipe:  # where each result stream stands now: newer entries wake us
        for job_id in pending:
            pipe.xrevrange(keys.rq_results_key(job_id), "+", "-", count=1)
        positions = {i: (e[0][0] if e else b"0-0") for i, e in zip(pending, pipe.execute(), strict=True)}
    check_all = True  # read every pending job's status: at the start and after a quiet wait
    while pending:
        if check_all:
            yield from _ended(r, pending)
            check_all = False
        if not pending:
            return
        wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError(
                f"{len(pending)} jobs still pending after {timeout} s (first: {next(iter(pending))})"
            )
        reply = r.xread(
            {keys.rq_results_key(i): positions[i] for i in pending}, block=max(1, int(wait * 1000))
        )
        if not reply:  # nothing stored: a job may have been canceled or deleted, which leaves no result
            check_all = True
            continue
        for key, entries in reply:
            job_id = keys.job_id_of_results_key(key)
            rid, payload = entries[-1]
            positions[job_id] = rid
            outcome = _from_result(r, pending[job_id], rid, payload)
            if outcome is not _PENDING:
                yield pending.pop(job_id), outcome


def _ended(r: Any, pending: dict[str, J]) -> Iterator[tuple[J, Any]]:
    """The pending jobs that have ended, by their statuses (two pipelined round trips)."""
    ids = list(pending)
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(keys.rq_job_key(job_id), keys.JOB_STATUS_FIELD)
        statuses = [s.decode() if s is not None else None for s in pipe.execute()]
    finished = [i for i, s in zip(ids, statuses, strict=True) if s == JobStatus.FINISHED.value]
    if finished:
        with r.pipeline(transaction=False) as pipe:
            for job_id in finished:
                pipe.xrevrange(keys.rq_results_key(job_id), "+", "-", count=1)
            latest = pipe.execute()
        for job_id, entries in zip(finished, latest, strict=True):
            rid, payload = entries[0] if entries else (None, None)
            outcome = _from_result(r, pending[job_id], rid, payload)
            if outcome is not _PENDING:
                yield pending.pop(job_id), outcome
    for job_id, status in zip(ids, statuses, strict=True):
        if job_id in pending and (status is None or status in _ENDED):
            outcome = _outcome(pending[job_id])
            if outcome is not _PENDING:
                yield pending.pop(job_id), outcome


def _from_result(r: Any, job: Waitable, rid: Any, payload: Any) -> Any:
    """A job's outcome from its latest RQ Result entry: the return value of a success, else what the job says."""
    if payload is not None:
        result = Result.restore(job.id, rid.decode(), payload, connection=r, serializer=JSONSerializer)
        if result.type == Result.Type.SUCCESSFUL:
            return result.return_value
    return _outcome(job)  # failed (maybe retried), or no result kept (result_ttl=0)


def _outcome(job: Waitable) -> Any:
    """What `Job.result()` says of an ended job: its result, or the exception it raises; _PENDING if it runs
    again."""
    try:
        return job.result(timeout=0)
    except (JobFailed, JobCanceled) as exc:
        return exc
    except TimeoutError:  # requeued (RQ Retry) between the two reads: still pending
        return _PENDING
