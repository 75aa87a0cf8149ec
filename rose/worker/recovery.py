"""No job is lost when a worker dies: requeue the jobs of dead workers, and fail poison jobs.

A job is an orphan when its StartedJobRegistry entry names a worker that is gone (its `rq:worker:<name>` key
expired or records a death), or names this worker's own name but this process does not hold it (a previous run
under the same `--name` was killed). Orphans go back to the front of their queue, their requeue counter in
`job.meta` goes up; past `max_requeues` the job fails instead, so a job that crashes workers cannot do so forever.

Registries are read with raw ZRANGE: RQ's `get_job_ids()` / `count` would first FAIL expired entries.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import now

from rose.jobs import keys
from rose.worker import rq_store

if TYPE_CHECKING:
    from rose.worker.worker import RoseWorker

log = logging.getLogger(__name__)


def worker_alive(conn: redis.Redis, name: str) -> bool:
    with conn.pipeline(transaction=False) as pipe:
        pipe.exists(rq_store.worker_key(name))
        pipe.hexists(rq_store.worker_key(name), "death")
        exists, dead = pipe.execute()
    return bool(exists) and not dead


def name_in_use(conn: redis.Redis, name: str, heartbeat_timeout: int) -> bool:
    """Whether a live process holds worker name `name` (checked before this process registers under it).

    rose-worker names its Redis connections after the worker, and a killed process's connections close at once,
    so a stale `rq:worker:<name>` key without a connection named so means a dead worker. Where CLIENT LIST is
    not allowed, a heartbeat older than `heartbeat_timeout` decides.
    """
    key = rq_store.worker_key(name)
    if not conn.exists(key) or conn.hexists(key, "death"):
        return False
    try:
        return any(c.get("name") == name for c in conn.client_list())
    except redis.ResponseError:
        from rq.utils import utcparse

        beat = conn.hget(key, "last_heartbeat")
        if beat is None:
            return False
        return (now() - utcparse(beat.decode())).total_seconds() < heartbeat_timeout


def wait_for_name(conn: redis.Redis, name: str, heartbeat_timeout: int, poll: float = 1.0) -> bool:
    """Wait (up to one heartbeat timeout) for `name` to be free. A machine lost with its TCP connections still
    half-open keeps the name until its key lapses; a worker that is really alive keeps it for good."""
    deadline = time.monotonic() + heartbeat_timeout + poll
    while name_in_use(conn, name, heartbeat_timeout):
        if time.monotonic() >= deadline:
            return False
        log.warning("worker name %r is held by a live connection; waiting for it to lapse", name)
        time.sleep(poll)
    return True


def find_orphans(worker: RoseWorker, queue: Queue) -> list[tuple[str, str, str]]:
    """(composite key, job id, worker name) of started entries whose worker is gone or that this worker lost."""
    conn = worker.connection
    parsed = rq_store.started_entries(conn, queue)
    if not parsed:
        return []
    with conn.pipeline(transaction=False) as pipe:
        for job_id, execution_id in parsed:
            pipe.hget(rq_store.execution_key(f"{job_id}:{execution_id}"), "worker_name")
            pipe.hget(Job.key_for(job_id), "worker_name")
        replies = pipe.execute()
    alive: dict[str, bool] = {worker.name: True}
    held = worker.held_executions()
    limbo = {job_id for job_id, _ in worker._limbo}  # our own starts awaiting confirmation are not orphans
    orphans = []
    for i, (job_id, execution_id) in enumerate(parsed):
        raw = replies[2 * i] or replies[2 * i + 1] or b""
        owner = raw.decode() if isinstance(raw, bytes) else raw
        composite = f"{job_id}:{execution_id}"
        if owner == worker.name:
            if composite not in held and job_id not in limbo:
                orphans.append((composite, job_id, owner))
            continue
        if owner not in alive:
            alive[owner] = bool(owner) and worker_alive(conn, owner)
        if not alive[owner]:
            orphans.append((composite, job_id, owner))
    return orphans


def recover_queue(worker: RoseWorker, queue: Queue) -> int:
    """Requeue (or fail, past the limit) every orphan of `queue`. Returns how many were handled."""
    conn = worker.connection
    handled = 0
    for composite, job_id, owner in find_orphans(worker, queue):
        # ZREM is the claim: when several live workers scan at once, only one gets 1 back.
        if not rq_store.claim_orphan(conn, queue, composite):
            continue
        handled += 1
        try:
            job = Job.fetch(job_id, connection=conn, serializer=worker.serializer)
        except Exception:  # deleted meanwhile, or unreadable: nothing to run
            log.warning(
                "orphaned job %s (of worker %s) no longer exists; dropped its registry entry", job_id, owner
            )
            _drop_execution(conn, composite, owner)
            continue
        if not rq_store.is_started(job):
            _drop_execution(conn, composite, owner)
            continue
        requeues = int(job.meta.get(keys.META_REQUEUES, 0)) if isinstance(job.meta, dict) else 0
        if requeues >= worker.settings.max_requeues:
            execution = Execution.from_composite_key(composite, conn)
            execution.worker_name = owner  # its execution index loses it when it fails
            worker.fail_orphan(job, queue, execution, owner, requeues)
            continue
        with conn.pipeline() as pipe:
            if isinstance(job.meta, dict) and "unserialized" not in job.meta:
                meta = {**job.meta, keys.META_REQUEUES: requeues + 1, keys.META_LAST_WORKER: owner}
                rq_store.mark_requeued(pipe, worker, job, meta)
            rq_store.requeue_started(pipe, job, queue, composite, owner, at_front=True)
            pipe.execute()
        worker.metrics.requeued.inc()
        log.warning(
            "requeued job %s: its worker %s died while running it (requeue %d of at most %d)",
            job_id,
            owner or "?",
            requeues + 1,
            worker.settings.max_requeues,
            extra={
                "event": "requeued",
                "job_id": job_id,
                "queue": queue.name,
                "reason": "worker died",
                "owner": owner,
            },
        )
    return handled


def _drop_execution(conn: redis.Redis, composite: str, owner: str) -> None:
    with conn.pipeline(transaction=False) as pipe:
        rq_store.drop_execution(pipe, composite, owner)
        pipe.execute()


class IntermediateWatch:
    """Ids stuck in `rq:queue:<q>:intermediate` (a worker died between dequeue and start) go back to the queue.

    An id must be seen in two scans in a row, so a live worker between its dequeue and its start (milliseconds)
    is never disturbed. RQ's own maintenance would fail such jobs after a minute; scans here come sooner.
    """

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}

    def scan(self, worker: RoseWorker, queue: Queue) -> int:
        conn = worker.connection
        ids = {i.decode() for i in conn.lrange(queue.intermediate_queue_key, 0, -1)}
        previous = self._seen.get(queue.name, set())
        self._seen[queue.name] = ids
        stuck = sorted(ids & previous)
        moved = 0
        for job_id in stuck:
            status = conn.hget(Job.key_for(job_id), "status")
            if status is None:
                conn.lrem(queue.intermediate_queue_key, 1, job_id)
                continue
            if status.decode() != JobStatus.QUEUED.value:
                continue  # started (registry covers it) or ended: RQ's cleanup removes the id
            if conn.lrem(queue.intermediate_queue_key, 1, job_id):  # the claim
                conn.lpush(queue.key, job_id)
                moved += 1
                log.warning("job %s was stuck between dequeue and start (dead worker?); requeued it", job_id)
        return moved


def recover(worker: RoseWorker, watch: IntermediateWatch) -> int:
    started = time.monotonic()
    total = 0
    for queue in worker.queues:
        total += recover_queue(worker, queue)
        total += watch.scan(worker, queue)
    if total:
        log.info("recovery: %d orphaned jobs handled in %.3f s", total, time.monotonic() - started)
    return total
