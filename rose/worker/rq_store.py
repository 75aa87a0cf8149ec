"""Every write rose-worker makes into RQ's data, and every RQ internal it touches (RQ 3).

rose-worker runs many jobs at once in one process; RQ's own worker runs one per work-horse. So the worker does RQ's
bookkeeping itself, the same way RQ does it, and this module is the one place that knows how:

- start: an `Execution` per job (`rq:execution:<job>:<exec>`, the job's ExecutionRegistry, the StartedJobRegistry
  and, RQ 3, the worker's execution index `rq:worker:<name>:executions`), the job marked started, the worker `busy`;
- success: RQ's `handle_job_success` one job at a time, or its exact writes recorded into a batch (retirer.py);
- failure / stop: RQ's `handle_job_failure` (Retry, failure_ttl, dependents, rate-limit slots, webhooks);
- cancel: the execution removed (RQ's `job.cancel()` already set the status);
- requeue: a started job put back on its queue (drain, dead workers' orphans) with its execution removed;
- callbacks: RQ's own runners (`rq.callbacks`, RQ 3);
- key names: from RQ's classes (`Job.key_for`, `Execution.key`, `ExecutionRegistry.key`, the worker prefix), so
  `RQ_KEY_PREFIX` is honoured.

Contract: functions that take a `pipe` only queue commands (the caller executes, and only then calls the matching
`hold` / `release`); the others talk to Redis themselves. In-memory `worker.executions` (RQ 3's per-worker dict,
behind `worker.execution` and `get_current_job_id()`) mirrors the executions this process holds: `hold` after a
start committed, `release` after an end committed (RQ's handlers release their own).

Requires RQ >= 3 (`handle_job_success(..., execution)`, `handle_job_failure(..., execution=)`, no
`set_current_job_id`, callbacks in `rq.callbacks`). Producers on RQ 2.x and 3.x enqueue compatible jobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rq.version import VERSION

if int(VERSION.split(".")[0]) < 3:  # pragma: no cover - pyproject pins rq>=3
    raise ImportError(f"rose-worker needs rq>=3,<4 (installed: rq {VERSION})")

from rq.callbacks import (  # noqa: E402
    execute_failure_callback,
    execute_stopped_callback,
    execute_success_callback,
)
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.rate_limit import release_slot
from rq.utils import parse_composite_key
from rq.worker import BaseWorker, WorkerStatus

if TYPE_CHECKING:
    from redis import Redis
    from redis.client import Pipeline

    from rose.worker.intake import Running


STARTED = JobStatus.STARTED

# HSET the worker's state only if its key exists: a plain HSET on a lapsed key would leave a TTL-less hash that
# makes the name look taken (RQ's register_birth refuses it); the heartbeat re-registers a lapsed key instead.
_SET_STATE_IF_REGISTERED = (
    "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'state', ARGV[1]) end"
)


# ---- key names ------------------------------------------------------------------------------------------------


def worker_key(name: str) -> str:
    """The worker's registration hash (`rq:worker:<name>`)."""
    return BaseWorker.redis_worker_namespace_prefix + name


def worker_executions_key(name: str) -> str:
    """The worker's execution index (RQ 3): a set of `<job id>:<execution id>`, read by `get_current_executions`."""
    return WORKER_EXECUTIONS_KEY_TEMPLATE.format(name)


def execution_key(composite: str) -> str:
    job_id, execution_id = parse_composite_key(composite)
    return Execution(execution_id, job_id, connection=None).key  # type: ignore[arg-type]


# ---- the worker's registration ----------------------------------------------------------------------------------


def set_ip_address(worker: BaseWorker, connection: Redis) -> None:
    """RQ 3's `_set_ip_address` (run by `BaseWorker.__init__`), tolerating a CLIENT INFO reply redis-py cannot
    parse (fakeredis, used by `rose demo --redis fake`: ValueError, where RQ only expects a ResponseError)."""
    try:
        BaseWorker._set_ip_address(worker, connection)
    except ValueError:
        worker.ip_address = "unknown"


# ---- start ----------------------------------------------------------------------------------------------------


def record_start(pipe: Pipeline, worker: BaseWorker, job: Job, ttl: int) -> Execution:
    """Queue what RQ's `prepare_execution` + `prepare_job_execution` write for one job: a new Execution (job's
    execution registry, StartedJobRegistry, the worker's execution index), the job `started` by this worker, its
    hash persisted; and the worker `busy` (once per pipeline is enough, repeating is harmless)."""
    execution = Execution.create(job, ttl, pipeline=pipe, worker_name=worker.name)
    job.prepare_for_execution(worker.name, pipeline=pipe)
    pipe.persist(job.key)  # as RQ 3's prepare_job_execution: a running job must not expire under us
    if worker.get_state() != WorkerStatus.BUSY:
        _set_state(pipe, worker, WorkerStatus.BUSY)
    return execution


def started_execution(conn: Redis, queue: Queue, job_id: str, worker_name: str) -> Execution | None:
    """The execution of `job_id` in `queue`'s StartedJobRegistry (a start whose reply was lost), or None."""
    for jid, execution_id in queue.started_job_registry.get_job_and_execution_ids(cleanup=False):
        if jid == job_id:
            execution = Execution(execution_id, job_id, connection=conn)
            execution.worker_name = worker_name
            return execution
    return None


def hold(worker: BaseWorker, executions: Iterable[Execution]) -> None:
    """After a start committed: the worker holds these executions (in memory; Redis has them already)."""
    for execution in executions:
        worker.executions[execution.id] = execution


def release(worker: BaseWorker, execution: Execution) -> None:
    worker.executions.pop(execution.id, None)


def sync_state(worker: BaseWorker, busy: bool, pipe: Pipeline | None = None) -> None:
    """Set the worker's `state` (busy / idle) if it changed; `suspended` is left to the suspension check."""
    state = worker.get_state()
    if state == WorkerStatus.SUSPENDED:
        return
    want = WorkerStatus.BUSY if busy else WorkerStatus.IDLE
    if state != want:
        if pipe is None:
            with worker.connection.pipeline(transaction=False) as own:
                _set_state(own, worker, want)
                own.execute()
        else:
            _set_state(pipe, worker, want)


def _set_state(pipe: Pipeline, worker: BaseWorker, state: WorkerStatus) -> None:
    worker._state = state
    pipe.eval(_SET_STATE_IF_REGISTERED, 1, worker.key, state.value)


def heartbeat(pipe: Pipeline, worker: BaseWorker, runs: Iterable[Running], state: WorkerStatus) -> None:
    """Queue the heartbeat of the worker's state and every running job's execution (TTL: the job's timeout plus
    grace). The worker key and its execution index get their TTLs from `BaseWorker.heartbeat`."""
    worker.set_state(state, pipeline=pipe)
    for run in runs:
        run.execution.heartbeat(run.job.started_job_registry, run.registry_ttl(), pipeline=pipe)


def reregister(pipe: Pipeline, worker: BaseWorker, composites: Iterable[str]) -> None:
    """Our worker key had lapsed (long Redis outage): register again, with the executions we still hold."""
    from rq import worker_registration

    pipe.hset(worker.key, mapping=worker.serialize())
    worker_registration.register(worker, pipe)
    members = list(composites)
    if members:
        pipe.sadd(worker.executions_key, *members)
        pipe.expire(worker.executions_key, worker.worker_ttl)


# ---- ends -----------------------------------------------------------------------------------------------------


def succeed(worker: BaseWorker, run: Running) -> None:
    """Store a finished job through RQ's `handle_job_success` (dependents, repeats, result, counters, execution,
    rate-limit slot) and send its webhooks. `job._result`, `ended_at` and `_status` are set by the caller."""
    job = run.job
    worker.handle_job_success(job, run.queue, run.queue.started_job_registry, execution=run.execution)
    job.send_webhooks(JobStatus.FINISHED)


def record_success(pipe: Pipeline, worker: BaseWorker, run: Running) -> None:
    """Queue exactly what RQ 3's `handle_job_success` writes inside its transaction for a job with no dependents
    and no repeats (retirer.py checks both under WATCH). Call `after_success` once the transaction committed."""
    job = run.job
    job._status = JobStatus.FINISHED
    worker.increment_successful_job_count(pipeline=pipe)
    worker.increment_total_working_time(job.ended_at - job.started_at, pipe)
    result_ttl = job.get_result_ttl(worker.default_result_ttl)
    if result_ttl != 0:
        job._handle_success(
            result_ttl,
            pipeline=pipe,
            worker_name=worker.name,
            execution_id=run.execution.id,
            execution_started_at=run.execution.created_at,
            execution_ended_at=job.ended_at,
        )
    job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
    run.execution.delete(job=job, pipeline=pipe)


def after_success(worker: BaseWorker, run: Running) -> None:
    """After a recorded success committed: what RQ does after its EXEC (rate-limit slot, webhooks)."""
    release(worker, run.execution)
    release_slot(run.job)
    run.job.send_webhooks(JobStatus.FINISHED)


def batchable(run: Running) -> bool:
    """Whether `record_success` may store this job (else `succeed`: repeats and rate limits need RQ's handler)."""
    left = run.job.repeats_left
    return not (left is not None and left > 0) and not run.job.has_rate_limit


def fail(worker: BaseWorker, run: Running, exc_string: str, *, retry: bool = True) -> bool:
    """Fail the job through RQ's `handle_job_failure` (Retry unless `retry=False`, FailedJobRegistry, result,
    dependents, rate-limit slot, webhooks). Returns whether RQ requeued/scheduled it for a retry."""
    job = run.job
    job._status = JobStatus.FAILED
    if not retry:
        job.retries_left = None
    will_retry = bool(job.should_retry)
    worker.handle_job_failure(
        job,
        run.queue,
        started_job_registry=run.queue.started_job_registry,
        exc_string=exc_string,
        execution=run.execution,
    )
    return will_retry


def stop(worker: BaseWorker, run: Running) -> None:
    """`send_stop_job_command` / `send_stop_execution_command`: status `stopped`, as RQ's own worker does."""
    worker._stopped_job_id = run.job.id
    worker.handle_job_failure(
        run.job,
        run.queue,
        started_job_registry=run.queue.started_job_registry,
        exc_string="Job stopped by user, work-horse terminated.",
        execution=run.execution,
    )


def cancel(conn: Redis, worker: BaseWorker, run: Running) -> None:
    """The job was canceled or deleted by someone else: remove our execution (RQ set the status already)."""
    with conn.pipeline() as pipe:
        run.execution.delete(run.job, pipeline=pipe)
        pipe.execute()
    release(worker, run.execution)


def run_success_callback(worker: BaseWorker, job: Job, result: Any) -> None:
    execute_success_callback(job, worker.death_penalty_class, result)


def run_failure_callback(worker: BaseWorker, job: Job, exc_class: type, exc: BaseException) -> None:
    execute_failure_callback(job, worker.death_penalty_class, exc_class, exc, None)


def run_stopped_callback(worker: BaseWorker, job: Job) -> None:
    execute_stopped_callback(job, worker.death_penalty_class)


# ---- requeue and recovery -------------------------------------------------------------------------------------


def requeue_started(
    pipe: Pipeline, job: Job, queue: Queue, composite: str, owner: str, *, at_front: bool
) -> None:
    """Queue putting a started job back on its queue as queued: its execution (hash, the job's execution registry,
    StartedJobRegistry, `owner`'s execution index) removed, the job queued without a worker."""
    drop_execution(pipe, composite, owner, queue)
    pipe.hset(job.key, mapping={"status": JobStatus.QUEUED.value, "worker_name": ""})
    pipe.sadd(Queue.redis_queues_keys, queue.key)
    if at_front:
        pipe.lpush(queue.key, job.id)
    else:
        pipe.rpush(queue.key, job.id)


def drop_execution(pipe: Pipeline, composite: str, owner: str, queue: Queue | None = None) -> None:
    """Queue removing an execution's records (its job may be gone: no Job needed)."""
    job_id, execution_id = parse_composite_key(composite)
    if queue is not None:
        pipe.zrem(queue.started_job_registry.key, composite)
    pipe.delete(execution_key(composite))
    pipe.zrem(ExecutionRegistry(job_id, connection=None).key, execution_id)  # type: ignore[arg-type]
    if owner:
        pipe.srem(worker_executions_key(owner), composite)


def claim_orphan(conn: Redis, queue: Queue, composite: str) -> bool:
    """ZREM is the claim: when several live workers scan at once, only one gets True."""
    return bool(conn.zrem(queue.started_job_registry.key, composite))


def started_entries(conn: Redis, queue: Queue) -> list[tuple[str, str]]:
    """(job id, execution id) of `queue`'s StartedJobRegistry, raw: RQ's cleanup would FAIL expired entries."""
    return queue.started_job_registry.get_job_and_execution_ids(cleanup=False)


def mark_requeued(pipe: Pipeline, worker: BaseWorker, job: Job, meta: dict[str, Any]) -> None:
    """Queue writing the job's meta (requeue counter) without touching the rest of its hash."""
    job.meta = meta
    pipe.hset(job.key, "meta", worker.serializer.dumps(meta))


def is_started(job: Job) -> bool:
    return job.get_status(refresh=False) == STARTED
