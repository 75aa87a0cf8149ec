"""Audit of finished jobs, for the kill tests and the kill stress script: what a subscriber and a producer must find
whatever happened to the workers (docs/jobs.md's guarantees).

For each job: finished, with exactly one successful result; its stream, after its last reset, numbered 0, 1, 2, ...
without gaps, ends with exactly one terminal event (`done`), and its token events' text and ids equal the stored
result's (a job sent with `stream: false`: no token event at all). A job expected to fail (`failed=True`): failed, its stream ending with exactly one `error` event.
"""

from __future__ import annotations

from typing import Any

from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from rose.jobs import keys
from rose.jobs.events import TERMINAL_TYPES, entry_dict


def stream_events(r: Any, job_id: str) -> list[dict]:
    return [entry_dict(f) for _, f in r.xrange(keys.stream_key(job_id))]


def last_attempt(events: list[dict]) -> list[dict]:
    """The events after the stream's last reset (all of them without one)."""
    resets = [i for i, e in enumerate(events) if e["type"] == "reset"]
    return events[resets[-1] + 1 :] if resets else events


def audit(r: Any, job_id: str, failed: bool = False) -> list[str]:
    """What is wrong with the finished (`failed`: failed) job `job_id` (empty: nothing)."""
    problems: list[str] = []
    job = Job.fetch(job_id, connection=r, serializer=JSONSerializer)
    status = job.get_status()
    if failed:
        return _audit_failed(r, job_id, status)
    if status != "finished":
        return [f"{job_id}: status {status}, not finished"]
    results = [res for res in job.results() if res.type == Result.Type.SUCCESSFUL]
    if len(results) != 1:
        problems.append(f"{job_id}: {len(results)} successful results")
    value = job.return_value() or {}
    attempt = last_attempt(stream_events(r, job_id))
    terminal = [e for e in attempt if e["type"] in TERMINAL_TYPES]
    if len(terminal) != 1 or not attempt or attempt[-1] is not terminal[0] or terminal[0]["type"] != "done":
        problems.append(f"{job_id}: stream after its last reset ends {[e['type'] for e in attempt[-3:]]}")
    if [e.get("seq") for e in attempt] != list(range(len(attempt))):
        problems.append(f"{job_id}: seqs {[e.get('seq') for e in attempt]}")
    tokens = [e for e in attempt if e["type"] == "token"]
    if not _streamed(job):  # `stream: false`: its end alone
        if tokens:
            problems.append(f"{job_id}: not streamed, yet {len(tokens)} token events")
        return problems
    choices = value.get("choices") or [value]  # n > 1: each choice's events (their `index`) make that choice
    for index, choice in enumerate(choices):
        mine = [e for e in tokens if e.get("index", 0) == index]
        text = "".join(e["text"] for e in mine)
        ids = [i for e in mine for i in e["token_ids"]]
        if text != choice.get("text") or ids != choice.get("token_ids"):
            where = f" choice {index}" if len(choices) > 1 else ""
            problems.append(
                f"{job_id}:{where} streamed {len(ids)} tokens {text!r}, stored {choice.get('text')!r}"
            )
    return problems


def _streamed(job: Job) -> bool:
    """The job's `stream` field (true unless the producer said false)."""
    try:
        return job.kwargs.get("stream", True) is not False
    except Exception:  # a payload that is not a rose job's
        return True


def _audit_failed(r: Any, job_id: str, status: str) -> list[str]:
    if status != "failed":
        return [f"{job_id}: status {status}, not failed"]
    attempt = last_attempt(stream_events(r, job_id))
    if [e["type"] for e in attempt if e["type"] in TERMINAL_TYPES] != ["error"] or attempt[-1][
        "type"
    ] != "error":
        return [f"{job_id}: stream after its last reset ends {[e['type'] for e in attempt[-3:]]}"]
    return []


class EndWatch:
    """Watches jobs end, from outside, the way a subscriber would notice a gap: every `interval` s it reads the
    jobs' statuses, and each job seen `finished` must pass `audit` (complete stream, one result) within `grace` s
    of being first seen so; `late` lists the ones that did not (job id, seconds, problems). Redis errors (an
    outage, a failover in progress) are waited out. Call `poll()` in a loop, or `run_until(predicate)`."""

    def __init__(self, r: Any, job_ids: list[str], grace: float = 1.0) -> None:
        self.r = r
        self.pending = list(job_ids)
        self.grace = grace
        self.first_seen: dict[str, float] = {}
        self.complete: dict[str, float] = {}  # job id -> seconds from first seen finished to complete
        self.late: list[tuple[str, float, list[str]]] = []

    def poll(self) -> None:
        import time

        import redis

        try:
            statuses = self._statuses(self.pending)
        except (redis.ConnectionError, redis.TimeoutError):
            return
        now = time.monotonic()
        for job_id, status in zip(list(self.pending), statuses, strict=True):
            if status != b"finished":
                continue
            first = self.first_seen.setdefault(job_id, now)
            try:
                problems = audit(self.r, job_id)
            except (redis.ConnectionError, redis.TimeoutError):
                return
            if not problems:
                self.complete[job_id] = now - first
                self.pending.remove(job_id)
            elif now - first > self.grace:
                self.late.append((job_id, now - first, problems))
                self.pending.remove(job_id)

    def _statuses(self, job_ids: list[str]) -> list[bytes | None]:
        from rose.jobs import keys as rose_keys

        with self.r.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(rose_keys.rq_job_key(job_id), rose_keys.JOB_STATUS_FIELD)
            return pipe.execute()
