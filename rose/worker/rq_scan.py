"""Reading RQ's registries and records, for recovery (rose.worker.recovery) and stream repair (rose.worker.seal):
started entries and the workers they name, worker registrations, intermediate lists, how a job ended. With
rq_store.py (the writes) and rq_worker.py, the only modules that know RQ's internals.

Registries are read raw (ZRANGE): RQ's own readers (`get_job_ids()`, `count`) would first FAIL expired entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result
from rq.utils import now, utcparse
from rq.worker import BaseWorker

from rose.jobs import keys
from rose.worker.rq_store import JOB_OWNER_FIELD, JOB_STATUS_FIELD, QUEUED, decoded, execution_key, worker_key

if TYPE_CHECKING:
    from redis import Redis
    from redis.client import Pipeline


def intermediate_ids(conn: Redis, queue: Queue) -> set[str]:
    return {decoded(i) for i in conn.lrange(queue.intermediate_queue_key, 0, -1)}  # type: ignore[misc]


def requeue_stuck(conn: Redis, queue: Queue, job_id: str) -> bool:
    """An id left in `queue`'s intermediate list (its worker died between dequeue and start) back on the queue,
    if the job is still queued. LREM is the claim when several workers scan. Returns whether it was moved."""
    status = decoded(conn.hget(Job.key_for(job_id), JOB_STATUS_FIELD))
    if status is None:  # the job is gone: drop its id
        conn.lrem(queue.intermediate_queue_key, 1, job_id)
        return False
    if status != QUEUED:
        return False  # started (the registry covers it) or ended: RQ's cleanup removes the id
    # one script: a worker killed between the two writes would leave the id on neither list
    return bool(conn.eval(_MOVE_BACK, 2, queue.intermediate_queue_key, queue.key, job_id))


# KEYS: intermediate list, queue. ARGV: id. LREM is the claim; the id goes back to the front of the queue.
_MOVE_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
"""


def started_entries(conn: Redis, queue: Queue) -> list[tuple[str, str]]:
    """(job id, execution id) of `queue`'s StartedJobRegistry, raw: RQ's cleanup would FAIL expired entries."""
    return queue.started_job_registry.get_job_and_execution_ids(cleanup=False)


def execution_owners(conn: Redis, entries: list[tuple[str, str]]) -> list[str]:
    """The worker named by each (job id, execution id): the execution's hash, else the job's."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id, execution_id in entries:
            pipe.hget(execution_key(f"{job_id}:{execution_id}"), JOB_OWNER_FIELD)
            pipe.hget(Job.key_for(job_id), JOB_OWNER_FIELD)
        replies = pipe.execute()
    return [decoded(replies[2 * i] or replies[2 * i + 1] or b"") or "" for i in range(len(entries))]


# KEYS[1]: the started registry; KEYS[2]: keys.OOM_PROBE_KEY; ARGV[1]: the entry. The claim is a ZREM, which a
# full Redis (maxmemory) takes while it refuses the requeue that follows: the script's first write is a no-op it
# refuses instead, so a claim is made only while Redis takes writes.
_CLAIM = """
redis.call('SET', KEYS[2], '', 'XX')
return redis.call('ZREM', KEYS[1], ARGV[1])
"""


def claim_orphan(conn: Redis, queue: Queue, composite: str) -> bool:
    """ZREM is the claim: when several live workers scan at once, only one gets True."""
    return bool(conn.eval(_CLAIM, 2, queue.started_job_registry.key, keys.OOM_PROBE_KEY, composite))


def orphan_execution(conn: Redis, composite: str, owner: str) -> Execution:
    execution = Execution.from_composite_key(composite, conn)
    execution.worker_name = owner  # its execution index loses it when it ends
    return execution


def mark_requeued(pipe: Pipeline, worker: BaseWorker, job: Job, meta: dict[str, Any]) -> None:
    """Queue writing the job's meta (requeue counter) without touching the rest of its hash."""
    job.meta = meta
    pipe.hset(job.key, "meta", worker.serializer.dumps(meta))


def is_started(job: Job) -> bool:
    return job.get_status(refresh=False) == JobStatus.STARTED


@dataclass(frozen=True, slots=True)
class JobEnd:
    """How a job ended, as RQ stored it: `status` (None: the job is gone), its latest result's return value (a
    finished job) or error text (a failed one), and how long its stream must live."""

    status: str | None
    return_value: Any = None
    error: str | None = None
    result_ttl: int | None = None


def job_end(conn: Redis, job_id: str, worker: BaseWorker) -> JobEnd:
    """The end of `job_id` as RQ stored it (rose.worker.seal repairs the job's stream from it)."""
    try:
        job = Job.fetch(job_id, connection=conn, serializer=worker.serializer)
    except Exception:  # deleted, or unreadable: there is nothing to read an end from
        return JobEnd(None)
    status = job.get_status(refresh=False)
    result = Result.fetch_latest(job, serializer=worker.serializer)
    ttl = job.get_result_ttl(worker.default_result_ttl)
    if result is None:
        return JobEnd(status.value if status else None, result_ttl=ttl)
    if result.type == Result.Type.SUCCESSFUL:
        return JobEnd(status.value, return_value=result.return_value, result_ttl=ttl)
    return JobEnd(status.value, error=result.exc_string, result_ttl=ttl)


def registration(conn: Redis, name: str) -> tuple[bool, bool, float | None]:
    """(registered, dead, seconds since its last heartbeat or None) of the worker named `name`."""
    key = worker_key(name)
    with conn.pipeline(transaction=False) as pipe:
        pipe.exists(key)
        pipe.hexists(key, "death")
        pipe.hget(key, "last_heartbeat")
        exists, dead, beat = pipe.execute()
    age = (now() - utcparse(decoded(beat))).total_seconds() if beat else None  # type: ignore[arg-type]
    return bool(exists), bool(dead), age
