"""Every read and write rose-worker makes in RQ's data, and every RQ internal it touches (RQ 3).

rose-worker runs many jobs at once in one process; RQ's own worker runs one per work-horse. So the worker does RQ's
bookkeeping itself, the same way RQ does it, and this module is the one place that knows how (with rq_start.py,
dequeue and start; rq_scan.py, the reads for recovery and repair; and rq_worker.py, the worker's registration), so
that an RQ upgrade touches these four files:

- success: RQ's `handle_job_success` one job at a time, or its writes recorded for a batch (retirer.py), less the
  ones that change nothing (`success_commands`);
- failure / stop: RQ's `handle_job_failure` (Retry, failure_ttl, dependents, rate-limit slots, webhooks) and RQ's
  callback runners (`rq.callbacks`);
- cancel: the execution removed (RQ's `job.cancel()` already set the status);
- requeue / recovery: a started job put back on its queue with its execution removed; the registries, execution
  hashes and intermediate lists read raw (RQ's own readers would FAIL expired entries);
- names: keys from RQ's classes (`Job.key_for`, `Execution.key`, `ExecutionRegistry.key`, the worker prefix), so
  `RQ_KEY_PREFIX` is honoured, and the job-hash fields other modules read (`JOB_STATUS_FIELD`, `JOB_OWNER_FIELD`,
  `JOB_ENQUEUED_FIELD`).

Contract: functions that take a `pipe` only queue commands (the caller executes, and only then calls the matching
`hold` / `release`); the others talk to Redis themselves. The in-memory `worker.executions` (RQ 3's per-worker dict,
behind `worker.execution` and `get_current_job_id()`) mirrors the executions this process holds: `hold` after a
start committed, `release` after an end committed.

Requires RQ >= 3 (`handle_job_success(..., execution)`, `handle_job_failure(..., execution=)`, callbacks in
`rq.callbacks`). Producers on RQ 2.x and 3.x enqueue compatible jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import redis
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
from rq.utils import now, parse_composite_key
from rq.worker import BaseWorker, WorkerStatus

from rose.worker.redis_guard import is_oom, probe_write  # noqa: E402

if TYPE_CHECKING:
    from redis import Redis
    from redis.client import Pipeline

    from rose.worker.rq_worker import RQWorker
    from rose.worker.running import Running

log = logging.getLogger(__name__)

JOB_STATUS_FIELD, JOB_OWNER_FIELD, JOB_TIMEOUT_FIELD = (
    "status",
    "worker_name",
    "timeout",
)  # fields of RQ's job hash
JOB_ENQUEUED_FIELD = "enqueued_at"  # RQ stamps it at each enqueue, a requeue too (ISO 8601, UTC)
STARTED, QUEUED, FINISHED = JobStatus.STARTED.value, JobStatus.QUEUED.value, JobStatus.FINISHED.value
CANCELED, STOPPED, FAILED = JobStatus.CANCELED.value, JobStatus.STOPPED.value, JobStatus.FAILED.value


def decoded(value: bytes | str | None) -> str | None:
    """A Redis reply as text (None stays None)."""
    return value.decode() if isinstance(value, bytes) else value


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


# ---- queues and dequeue ---------------------------------------------------------------------------------------


def queue_lengths(conn: Redis, queues: list[Queue]) -> list[int]:
    with conn.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.llen(queue.key)
        return [int(n) for n in pipe.execute()]


def hold(worker: BaseWorker, executions: Iterable[Execution]) -> None:
    """After a start committed: the worker holds these executions (in memory; Redis has them already)."""
    for execution in executions:
        worker.executions[execution.id] = execution


def release(worker: BaseWorker, execution: Execution) -> None:
    worker.executions.pop(execution.id, None)


def heartbeat(pipe: Pipeline, worker: BaseWorker, runs: Iterable[Running], state: WorkerStatus) -> None:
    """Queue the worker's heartbeat (its key and execution index get their TTLs from `BaseWorker.heartbeat`; reply
    1 of the pipeline's first command means the key had lapsed), its state, and every running job's execution
    (TTL: the job's timeout plus grace)."""
    worker.heartbeat(pipeline=pipe)
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


# ---- success --------------------------------------------------------------------------------------------------


def run_success_callback(worker: BaseWorker, job: Job, result: Any) -> None:
    """RQ's success callback runner (raises what the callback raises: RQ then fails the job)."""
    execute_success_callback(job, worker.death_penalty_class, result)


def succeed(worker: BaseWorker, run: Running, result: dict[str, Any]) -> None:
    """Store a finished job through RQ's `handle_job_success` (dependents, repeats, result, counters, execution,
    rate-limit slot) and send its webhooks."""
    job = run.job
    job.ended_at = now()
    job._result = result
    job._status = JobStatus.FINISHED
    worker.handle_job_success(job, run.queue, run.queue.started_job_registry, execution=run.execution)
    job.send_webhooks(JobStatus.FINISHED)


def batchable(run: Running) -> bool:
    """Whether the batched path may store this job (else `succeed`: repeats and rate limits need RQ's handler)."""
    left = run.job.repeats_left
    return not (left is not None and left > 0) and not run.job.has_rate_limit


def success_commands(worker: BaseWorker, runs: list[Running], slim: bool = True) -> list[tuple[Any, ...]]:
    """What RQ 3's `handle_job_success` writes inside its transaction, for each job (no dependents, no repeats or
    rate limit: `batchable`), recorded from RQ's own calls, less what would leave Redis as it is (`_slimmed`; not
    with `slim=False`: every write as recorded, for comparison); the caller stores them (rose.worker.batch_store;
    `coalesce.coalesced` first, if it likes) and, once they are in, calls `after_success`. `job.ended_at` and
    `job._result` are set here."""
    recorder = worker.connection.pipeline(transaction=False)  # records RQ's writes, never executed
    encode = worker.connection.get_encoder().encode
    out: list[tuple[Any, ...]] = []
    for run in runs:
        job = run.job
        # as Redis has it: an earlier try of this job's batch (a full Redis refused it) set it finished
        job._status = JobStatus.STARTED
        as_started = {k: encode(v) for k, v in job.to_dict(include_meta=False, include_result=False).items()}
        job.ended_at = now()
        job._result = run.result
        job._status = JobStatus.FINISHED
        worker.increment_successful_job_count(pipeline=recorder)
        worker.increment_total_working_time(job.ended_at - job.started_at, recorder)
        result_ttl = job.get_result_ttl(worker.default_result_ttl)
        if result_ttl != 0:
            job._handle_success(
                result_ttl,
                pipeline=recorder,
                worker_name=worker.name,
                execution_id=run.execution.id,
                execution_started_at=run.execution.created_at,
                execution_ended_at=job.ended_at,
            )
        job.cleanup(result_ttl, pipeline=recorder, remove_from_queue=False)
        run.execution.delete(job=job, pipeline=recorder)
        recorded = [args for args, _ in recorder.command_stack]
        out += _slimmed(job, as_started, recorded, encode) if slim else recorded
        recorder.reset()
    return out


def _slimmed(
    job: Job, as_started: dict[str, bytes], commands: list[tuple[Any, ...]], encode: Any
) -> list[tuple[Any, ...]]:
    """One job's recorded success writes less what leaves Redis as it is. RQ sets the status, then saves the whole
    job hash (its payload and description, the prompt twice, with every field it read at the start): the fields
    are written once, in one HSET, and only those whose value differs from the job as started (the status,
    `ended_at`). RQ then EXPIREs the job's dependents set, which the retirer finds empty (no such key), and its
    dependencies set, which exists only for a job enqueued with dependencies: EXPIRE of a missing key does
    nothing, so neither is sent. What is left writes the same data as RQ's own handler, but for fields a third
    party changed while the job ran, which RQ's save would put back as they were at the start."""
    noop_expires = {job.dependents_key} | (set() if job._dependency_ids else {job.dependencies_key})
    fields: dict[Any, Any] = {}
    out: list[tuple[Any, ...]] = []
    at = -1  # where the job hash's one HSET goes: at RQ's first
    for command in commands:
        name, key = str(command[0]).upper(), command[1] if len(command) > 1 else None
        if name == "HSET" and key == job.key:
            for field, value in zip(command[2::2], command[3::2], strict=True):
                if as_started.get(str(field)) != encode(value):
                    fields[field] = value
            at = len(out) if at < 0 else at
        elif not (name == "EXPIRE" and key in noop_expires):
            out.append(command)
    if fields:
        out.insert(max(at, 0), ("HSET", job.key, *(x for item in fields.items() for x in item)))
    return out


def after_success(worker: BaseWorker, run: Running) -> None:
    """After `success_commands` committed: what RQ does after its EXEC (rate-limit slot, webhooks)."""
    release(worker, run.execution)
    release_slot(run.job)
    run.job.send_webhooks(JobStatus.FINISHED)


# ---- failure, stop, cancel ------------------------------------------------------------------------------------


def will_retry(job: Job, retry: bool) -> bool:
    """Whether failing the job makes RQ retry it (`retry=False`: never; else its Retry has attempts left)."""
    return retry and bool(job.should_retry)


def fail(
    worker: BaseWorker,
    run: Running,
    exc: BaseException,
    *,
    retry: bool = True,
    callbacks: bool = True,
) -> bool:
    """Fail the job as RQ's worker does: its failure callback (unless `callbacks=False`: an untrusted payload),
    then `handle_job_failure` (Retry unless `retry=False`, FailedJobRegistry, result, dependents, rate-limit slot,
    webhooks). Returns whether RQ requeued / scheduled it for a retry."""
    job = run.job
    job.ended_at = now()
    job._status = JobStatus.FAILED
    if not retry:
        job.retries_left = None
    if callbacks:
        try:
            execute_failure_callback(job, worker.death_penalty_class, type(exc), exc, None)
        except Exception:
            log.exception("job %s: failure callback failed", job.id)
    will_retry = bool(job.should_retry)
    worker.handle_job_failure(
        job,
        run.queue,
        started_job_registry=run.queue.started_job_registry,
        exc_string=f"{type(exc).__name__}: {exc}\n",
        execution=run.execution,
    )
    _ensure_ended(worker, run)
    return will_retry


def stop(worker: BaseWorker, run: Running) -> None:
    """`send_stop_job_command` / `send_stop_execution_command`: status `stopped` and the job's stopped callback, as
    RQ's own worker does."""
    job = run.job
    job.ended_at = now()
    worker._stopped_job_id = job.id
    worker.handle_job_failure(
        job,
        run.queue,
        started_job_registry=run.queue.started_job_registry,
        exc_string="Job stopped by user, work-horse terminated.",
        execution=run.execution,
    )
    _ensure_ended(worker, run)
    if job.stopped_callback is not None:
        try:
            execute_stopped_callback(job, worker.death_penalty_class)
        except Exception:
            log.exception("job %s: stopped callback failed", job.id)


def _ensure_ended(worker: BaseWorker, run: Running) -> None:
    """RQ's `handle_job_failure` logs, and swallows, a Redis error of its transaction: check that it went through
    (it deletes the execution) and raise the error it swallowed, so the caller retries."""
    if worker.connection.exists(run.execution.key):
        # a full Redis (maxmemory) refused it: say so, as the probe's own refusal (not an outage of the network)
        try:
            probe_write(worker.connection)
        except redis.ResponseError as exc:
            if is_oom(exc):
                raise
        raise redis.ConnectionError(f"the end of job {run.id} was not stored (see RQ's log above)")


def cancel(conn: Redis, worker: BaseWorker, run: Running) -> None:
    """The job was canceled or deleted by someone else: remove our execution (RQ set the status already)."""
    with conn.pipeline() as pipe:
        run.execution.delete(run.job, pipeline=pipe)
        pipe.execute()
    release(worker, run.execution)


# ---- requeue and recovery -------------------------------------------------------------------------------------


def requeue_started(
    pipe: Pipeline, job: Job, queue: Queue, composite: str, owner: str, *, at_front: bool
) -> None:
    """Queue putting a started job back on its queue as queued: its execution (hash, the job's execution registry,
    StartedJobRegistry, `owner`'s execution index) removed, the job queued without a worker."""
    drop_execution(pipe, composite, owner, queue)
    pipe.hset(job.key, mapping={JOB_STATUS_FIELD: QUEUED, JOB_OWNER_FIELD: ""})
    pipe.sadd(Queue.redis_queues_keys, queue.key)
    if at_front:
        pipe.lpush(queue.key, job.id)
    else:
        pipe.rpush(queue.key, job.id)


def requeue_ours(worker: RQWorker, runs: list[Running]) -> list[Running]:
    """Put the jobs back at the front of their queues (the first of `runs` ending up first), those still started by
    this worker only (one canceled, or stored by a retirement whose reply was lost, stays as it is), in one
    transaction under WATCH, with the worker `idle`. Returns the jobs requeued."""
    conn = worker.connection
    while True:
        with conn.pipeline() as pipe:
            try:
                pipe.watch(*(run.key for run in runs))
                states = [pipe.hmget(run.key, JOB_STATUS_FIELD, JOB_OWNER_FIELD) for run in runs]
                mine = [STARTED.encode(), worker.name.encode()]
                ours = [run for run, state in zip(runs, states, strict=True) if state == mine]
                pipe.multi()
                for run in reversed(ours):  # LPUSH in reverse: the first started ends up first
                    requeue_started(pipe, run.job, run.queue, run.composite_key, worker.name, at_front=True)
                worker.sync_state(busy=False, pipe=pipe)
                pipe.execute()
                return ours
            except redis.WatchError:
                continue


def drop_execution(pipe: Pipeline, composite: str, owner: str, queue: Queue | None = None) -> None:
    """Queue removing an execution's records (its job may be gone: no Job needed)."""
    job_id, execution_id = parse_composite_key(composite)
    if queue is not None:
        pipe.zrem(queue.started_job_registry.key, composite)
    pipe.delete(execution_key(composite))
    pipe.zrem(ExecutionRegistry(job_id, connection=None).key, execution_id)  # type: ignore[arg-type]
    if owner:
        pipe.srem(worker_executions_key(owner), composite)
