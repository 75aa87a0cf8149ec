"""Audit of finished jobs, for the kill tests and the kill stress script: what a subscriber and a producer must find
whatever happened to the workers (docs/jobs.md's guarantees).

For each job: finished, with exactly one successful result; its stream, after its last reset, numbered 0, 1, 2, ...
without gaps, ends with exactly one terminal event (`done`), and its token events' text and ids equal the stored
result's. A job expected to fail (`failed=True`): failed, its stream ending with exactly one `error` event.
"""

from __future__ import annotations

import json
from typing import Any

from rq.job import Job
from rq.results import Result
from rq.serializers import JSONSerializer

from rose.jobs import keys
from rose.jobs.events import TERMINAL_TYPES


def stream_events(r: Any, job_id: str) -> list[dict]:
    return [json.loads(f[keys.STREAM_FIELD.encode()]) for _, f in r.xrange(keys.stream_key(job_id))]


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
    text = "".join(e["text"] for e in tokens)
    ids = [i for e in tokens for i in e["token_ids"]]
    if text != value.get("text") or ids != value.get("token_ids"):
        problems.append(f"{job_id}: streamed {len(ids)} tokens {text!r}, stored {value.get('text')!r}")
    return problems


def _audit_failed(r: Any, job_id: str, status: str) -> list[str]:
    if status != "failed":
        return [f"{job_id}: status {status}, not failed"]
    attempt = last_attempt(stream_events(r, job_id))
    if [e["type"] for e in attempt if e["type"] in TERMINAL_TYPES] != ["error"] or attempt[-1][
        "type"
    ] != "error":
        return [f"{job_id}: stream after its last reset ends {[e['type'] for e in attempt[-3:]]}"]
    return []
