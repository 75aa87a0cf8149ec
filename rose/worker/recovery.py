"""No job is lost when a worker dies: requeue the jobs of dead workers, and report poison jobs.

A job is an orphan when its StartedJobRegistry entry names a worker that is gone (its `rq:worker:<name>` key
expired or records a death), or names this worker's own name but this process does not hold it (a previous run
under the same `--name` was killed). Orphans go back to the front of their queue, their requeue counter in
`job.meta` goes up; past `max_requeues` the job is handed to `fail_poison` right after its claim instead, so a job
that crashes workers cannot do so forever. Ids stuck in a queue's intermediate list (a worker died between dequeue and
start) go back to their queue too (`IntermediateWatch`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from rq.job import Job
from rq.queue import Queue

from rose.jobs import keys
from rose.worker import rq_scan, rq_store
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

log = logging.getLogger(__name__)


def worker_alive(conn: redis.Redis, name: str) -> bool:
    registered, dead, _ = rq_scan.registration(conn, name)
    return registered and not dead


def name_in_use(conn: redis.Redis, name: str, heartbeat_timeout: int) -> bool:
    """Whether a live process holds worker name `name` (checked before this process registers under it).

    rose-worker names its Redis connections after the worker, and a killed process's connections close at once,
    so a stale `rq:worker:<name>` key without a connection named so means a dead worker. Where CLIENT LIST is
    not allowed, a heartbeat older than `heartbeat_timeout` decides.
    """
    registered, dead, age = rq_scan.registration(conn, name)
    if not registered or dead:
        return False
    try:
        return any(c.get("name") == name for c in conn.client_list())
    except redis.ResponseError:
        return age is not None and age < heartbeat_timeout


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


@dataclass(frozen=True, slots=True)
class Poison:
    """An orphan requeued `requeues` times already (last by `owner`): failed instead."""

    run: Running
    owner: str
    requeues: int


FailPoison = Callable[[Poison], None]


@dataclass(slots=True)
class Recovered:
    requeued: int = 0  # orphans of dead workers put back on their queues
    poisoned: int = 0  # orphans failed instead (past max_requeues)
    unstuck: int = 0  # ids moved from an intermediate list back to their queue


def find_orphans(rq: RQWorker, queue: Queue, mine: set[str]) -> list[tuple[str, str, str]]:
    """(composite key, job id, worker name) of started entries whose worker is gone, or that name this worker but
    are none of `mine` (executions it holds, ids it may have started)."""
    conn = rq.connection
    entries = rq_scan.started_entries(conn, queue)
    if not entries:
        return []
    alive: dict[str, bool] = {rq.name: True}
    orphans = []
    for (job_id, execution_id), owner in zip(entries, rq_scan.execution_owners(conn, entries), strict=True):
        composite = f"{job_id}:{execution_id}"
        if owner == rq.name:
            if composite not in mine and job_id not in mine:
                orphans.append((composite, job_id, owner))
            continue
        if owner not in alive:
            alive[owner] = bool(owner) and worker_alive(conn, owner)
        if not alive[owner]:
            orphans.append((composite, job_id, owner))
    return orphans


def recover_queue(
    rq: RQWorker, queue: Queue, mine: set[str], max_requeues: int, fail_poison: FailPoison
) -> Recovered:
    """Requeue every orphan of `queue`; those past `max_requeues` go to `fail_poison`, each right after its claim
    (a claimed entry is out of the registry: nothing would find it again)."""
    conn = rq.connection
    recovered = Recovered()
    for composite, job_id, owner in find_orphans(rq, queue, mine):
        if not rq_scan.claim_orphan(conn, queue, composite):  # another live worker's scan was quicker
            continue
        try:
            job = Job.fetch(job_id, connection=conn, serializer=rq.serializer)
        except Exception:  # deleted meanwhile, or unreadable: nothing to run
            log.warning(
                "orphaned job %s (of worker %s) no longer exists; dropped its registry entry", job_id, owner
            )
            _drop_execution(conn, composite, owner)
            continue
        if not rq_scan.is_started(job):
            _drop_execution(conn, composite, owner)
            continue
        requeues = int(job.meta.get(keys.META_REQUEUES, 0)) if isinstance(job.meta, dict) else 0
        if requeues >= max_requeues:
            run = Running(
                job=job,
                queue=queue,
                execution=rq_scan.orphan_execution(conn, composite, owner),
                started_wall=time.time(),
                started_mono=time.monotonic(),
                timeout=None,
            )
            fail_poison(Poison(run, owner, requeues))
            recovered.poisoned += 1
            continue
        with conn.pipeline() as pipe:
            if isinstance(job.meta, dict) and "unserialized" not in job.meta:
                meta = {**job.meta, keys.META_REQUEUES: requeues + 1, keys.META_LAST_WORKER: owner}
                rq_scan.mark_requeued(pipe, rq, job, meta)
            rq_store.requeue_started(pipe, job, queue, composite, owner, at_front=True)
            pipe.execute()
        recovered.requeued += 1
        log.warning(
            "requeued job %s: its worker %s died while running it (requeue %d of at most %d)",
            job_id,
            owner or "?",
            requeues + 1,
            max_requeues,
            extra={
                "event": "requeued",
                "job_id": job_id,
                "queue": queue.name,
                "reason": "worker died",
                "owner": owner,
            },
        )
    return recovered


def _drop_execution(conn: redis.Redis, composite: str, owner: str) -> None:
    with conn.pipeline(transaction=False) as pipe:
        rq_store.drop_execution(pipe, composite, owner)
        pipe.execute()


class IntermediateWatch:
    """Ids stuck in a queue's intermediate list (a worker died between dequeue and start) go back to the queue.

    An id must be seen in two scans in a row, so a live worker between its dequeue and its start (milliseconds)
    is never disturbed. RQ's own maintenance would fail such jobs after a minute; scans here come sooner.
    """

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}

    def scan(self, conn: redis.Redis, queue: Queue) -> int:
        ids = rq_scan.intermediate_ids(conn, queue)
        previous = self._seen.get(queue.name, set())
        self._seen[queue.name] = ids
        moved = 0
        for job_id in sorted(ids & previous):
            if rq_scan.requeue_stuck(conn, queue, job_id):
                moved += 1
                log.warning("job %s was stuck between dequeue and start (dead worker?); requeued it", job_id)
        return moved


def recover(
    rq: RQWorker, watch: IntermediateWatch, mine: set[str], max_requeues: int, fail_poison: FailPoison
) -> Recovered:
    """One scan of every queue of the worker. `mine`: the executions (composite keys) this process holds and the
    job ids it may have started."""
    started = time.monotonic()
    total = Recovered()
    for queue in rq.queues:
        found = recover_queue(rq, queue, mine, max_requeues, fail_poison)
        total.requeued += found.requeued
        total.poisoned += found.poisoned
        total.unstuck += watch.scan(rq.connection, queue)
    handled = total.requeued + total.poisoned + total.unstuck
    if handled:
        log.info("recovery: %d orphaned jobs handled in %.3f s", handled, time.monotonic() - started)
    return total
