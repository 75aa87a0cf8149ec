"""Taking jobs off RQ's queues and starting them, the RQ way (with rose.worker.rq_store, rq_scan and rq_worker, the
one place that knows RQ's internals: an RQ upgrade that changes how a job starts touches this file).

Ids move into the queue's intermediate list (`dequeue`: LMOVE, reading each job's status and timeout in the same
script; `dequeue_blocking`: BLMOVE, as RQ's own dequeue), so a crash between dequeue and start loses none
(rose.worker.recovery puts them back); a start is what RQ's `prepare_execution` + `prepare_job_execution` write
(`record_start`): an Execution (its hash, the job's ExecutionRegistry, the StartedJobRegistry, the worker's execution
index), the job `started` by this worker and persisted, sent for a take's jobs as one transaction (`Recorder`,
`coalesced`: one write a take for the keys they share), which reads each started job's hash last (`start_read`,
`restore`).

A script reads only a job's status and timeout (`CLAIM_FIELDS`, `claimed`: what the start needs to write), never its
whole hash: each value a script reads is converted to Lua and back, and a job's hash through a script cost Redis
about five times an HGETALL of it.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import TYPE_CHECKING, Any

from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import resolve_serializer
from rq.utils import parse_timeout
from rq.worker import BaseWorker, WorkerStatus

from rose.worker.coalesce import coalesced
from rose.worker.rq_store import JOB_OWNER_FIELD, JOB_STATUS_FIELD, JOB_TIMEOUT_FIELD, decoded

if TYPE_CHECKING:
    from redis import Redis
    from redis.client import Pipeline

    from rose.worker.rq_worker import RQWorker

# ---- dequeue --------------------------------------------------------------------------------------------------

CLAIM_FIELDS = (JOB_STATUS_FIELD, JOB_TIMEOUT_FIELD)  # what a script reads of a job it moves (HMGET)

# KEYS: each queue's list, then its intermediate list, highest priority first; ARGV[1]: the most ids to move;
# ARGV[2]: the prefix of job hashes; ARGV[3], ARGV[4]: CLAIM_FIELDS. Moves ids as RQ's own dequeue does (LMOVE into
# the intermediate list) and returns {queue index (1-based), id, {the job's status, its timeout} (false: none), ...}:
# dequeue in one round trip, with no need to know the queues' lengths first.
_DEQUEUE = """
local out, left = {}, tonumber(ARGV[1])
for i = 1, #KEYS, 2 do
  while left > 0 do
    local id = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'LEFT', 'RIGHT')
    if not id then break end
    out[#out + 1] = (i + 1) / 2
    out[#out + 1] = id
    out[#out + 1] = redis.call('HMGET', ARGV[2] .. id, ARGV[3], ARGV[4])
    left = left - 1
  end
end
return out
"""


def dequeue(
    conn: Redis, queues: list[Queue], limit: int, serializer: Any
) -> list[tuple[str, Queue, Job | None]]:
    """Up to `limit` jobs from the queues, highest priority first, without blocking, in one round trip: (id, queue,
    the job as `claimed` (its status and timeout), None if it has no status). A crash before the start leaves the
    ids in the intermediate lists, findable (`requeue_stuck`)."""
    keys = [key for q in queues for key in (q.key, q.intermediate_queue_key)]
    flat = conn.eval(_DEQUEUE, len(keys), *keys, limit, job_hash_prefix(), *CLAIM_FIELDS)
    taken: list[tuple[str, Queue, Job | None]] = []
    for i in range(0, len(flat), 3):
        queue, job_id = queues[int(flat[i]) - 1], decoded(flat[i + 1])
        status, timeout = flat[i + 2]
        taken.append((job_id, queue, claimed(conn, job_id, queue, status, timeout, serializer)))
    return taken


def job_hash_prefix() -> str:
    """What a job's id follows in the key of its hash (`rq:job:`)."""
    return Job.redis_job_namespace_prefix


def claimed(
    conn: Redis, job_id: str, queue: Queue, status: bytes | None, timeout: bytes | None, serializer: Any
) -> Job | None:
    """A job as a script read it (its status and timeout, `CLAIM_FIELDS`): what `record_start` needs; the rest of
    its hash is read by the start (`restore`). None: no status (no such job)."""
    if not status:
        return None
    job = Job(job_id, connection=conn, serializer=serializer)
    job.origin = queue.name
    job._status = JobStatus(decoded(status))
    job.timeout = parse_timeout(decoded(timeout)) if timeout else None
    return job


def restore(job: Job, fields: dict[bytes, bytes]) -> bool:
    """`job` as its hash was read (HGETALL); False if the hash holds no job (deleted, or written only by the start:
    deleted between the take and the start)."""
    try:
        job.restore(fields)
    except NoSuchJobError:
        return False
    return True


def start_read(job: Job) -> tuple[str, ...]:
    """What a start reads of each job it started, after its writes (`Recorder.execute`): its whole hash."""
    return ("HGETALL", job.key)


def job_kwargs(data: bytes, serializer: Any) -> dict[str, Any] | None:
    """A job's kwargs from its hash's `data` field (RQ: the serialized (func, instance, args, kwargs), zlib-compressed
    unless it was written raw); None if it will not read."""
    if not data:
        return None
    try:
        with contextlib.suppress(zlib.error):
            data = zlib.decompress(data)
        kwargs = resolve_serializer(serializer).loads(data)[3]
    except Exception:
        return None
    return kwargs if isinstance(kwargs, dict) else None


def dequeue_blocking(conn: Redis, queue: Queue, timeout: float) -> str | None:
    """Block up to `timeout` s for one id of `queue` (BLMOVE into its intermediate list, as RQ does)."""
    return decoded(conn.blmove(queue.key, queue.intermediate_queue_key, timeout, "LEFT", "RIGHT"))


# ---- start ----------------------------------------------------------------------------------------------------


def fetch_jobs(conn: Redis, job_ids: list[str], worker: BaseWorker) -> list[Job | None]:
    return Job.fetch_many(job_ids, connection=conn, serializer=worker.serializer)


def job_states(conn: Redis, job_ids: list[str]) -> list[tuple[str | None, str | None]]:
    """(status, owning worker) of each job, as its hash says (None: no such field / no such job)."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(Job.key_for(job_id), JOB_STATUS_FIELD, JOB_OWNER_FIELD)
        return [(decoded(status), decoded(owner)) for status, owner in pipe.execute()]


def settle_dequeued(pipe: Pipeline, queue: Queue, job_id: str) -> None:
    """Queue removing a dequeued id from the queue's intermediate list (started in the same transaction, or
    dropped: the job vanished or is no longer queued)."""
    pipe.lrem(queue.intermediate_queue_key, 1, job_id)


def is_queued(job: Job) -> bool:
    return job.get_status(refresh=False) == JobStatus.QUEUED


def record_start(pipe: Pipeline, worker: RQWorker, job: Job, ttl: int) -> Execution:
    """Queue what RQ's `prepare_execution` + `prepare_job_execution` write for one job: a new Execution (job's
    execution registry, StartedJobRegistry, the worker's execution index), the job `started` by this worker, its
    hash persisted. The worker's `busy` state: `mark_busy`."""
    job.redis_server_version = worker.get_redis_server_version()
    execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker.name)
    job.prepare_for_execution(worker.name, pipeline=pipe)
    pipe.persist(job.key)  # as RQ 3's prepare_job_execution: a running job must not expire under us
    return execution


def undo_start(conn: Redis, job_id: str, queue: Queue, execution: Execution) -> None:
    """Take back `record_start`'s writes for a job deleted meanwhile: the hash they made, the Execution (its hash,
    the job's ExecutionRegistry, the StartedJobRegistry, the worker's execution index)."""
    job = Job(job_id, connection=conn)
    job.origin = queue.name
    with conn.pipeline() as pipe:
        pipe.delete(job.key)
        execution.delete(job, pipeline=pipe)
        pipe.execute()


def mark_busy(pipe: Pipeline, worker: RQWorker) -> None:
    """Queue the worker's `busy` state, as RQ's start writes it, unless it is busy already."""
    if worker.get_state() != WorkerStatus.BUSY:
        worker.set_state_if_registered(pipe, WorkerStatus.BUSY)


class Recorder:
    """Writes queued through RQ's own calls (`pipe`), sent as one MULTI/EXEC, `coalesced`."""

    def __init__(self, conn: Redis) -> None:
        self.conn = conn
        self.pipe = conn.pipeline(transaction=False)  # records, never executed

    def execute(self, reads: list[tuple[Any, ...]] = ()) -> list[Any]:  # type: ignore[assignment]
        """Send the writes and then `reads` in one transaction; returns the replies of `reads`."""
        writes = coalesced([args for args, _ in self.pipe.command_stack])
        self.pipe.reset()
        if not writes and not reads:
            return []
        with self.conn.pipeline() as pipe:
            for command in [*writes, *reads]:
                pipe.execute_command(*command)
            return pipe.execute()[len(writes) :]


def started_execution(conn: Redis, queue: Queue, job_id: str, worker_name: str) -> Execution | None:
    """The execution of `job_id` in `queue`'s StartedJobRegistry (a start whose reply was lost), or None."""
    for jid, execution_id in queue.started_job_registry.get_job_and_execution_ids(cleanup=False):
        if jid == job_id:
            execution = Execution(execution_id, job_id, connection=conn)
            execution.worker_name = worker_name
            return execution
    return None
