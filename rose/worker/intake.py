"""Taking jobs off the queues and starting them: dequeue, start-of-job bookkeeping, validation.

Dequeue moves ids into RQ's intermediate list (`rq:queue:<q>:intermediate`, LMOVE) and starting a job removes
the id from there in the same transaction that puts it in the StartedJobRegistry, so a crash at any point leaves
the job findable: recovery.py puts it back.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rq.exceptions import DeserializationError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue

from rose.jobs import keys
from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error
from rose.worker import rq_store

if TYPE_CHECKING:
    from rose.worker.worker import RoseWorker

log = logging.getLogger(__name__)

DEFAULT_JOB_TIMEOUT = Queue.DEFAULT_TIMEOUT  # what RQ applies when neither job nor queue sets one
# Registry entries outlive a dead worker by this much: long enough for a rose-worker to requeue its jobs
# (RQ's cleanup would FAIL them as abandoned once the score passes).
ORPHAN_GRACE_S = 3600
MULTI_QUEUE_BLOCK_S = 0.2  # idle with several queues: how often the lower-priority ones are looked at

PICKLE_MESSAGE = (
    "the job's payload is not JSON (was it enqueued with RQ's default pickle serializer?). rose-worker never "
    "unpickles anything, so nothing in this job was run. Enqueue with "
    "Queue('{queue}', connection=r, serializer=JSONSerializer).enqueue('rose.jobs.generate', "
    "kwargs={{'prompt': ..., 'max_tokens': ...}}) or use rose.Client."
)


@dataclass
class Running:
    """A job this worker has started (it may still be waiting in the engine)."""

    job: Job
    queue: Queue
    execution: Execution
    started_wall: float
    started_mono: float
    timeout: int | None  # seconds, None = no limit
    request: GenerateRequest | None = None
    restarted: bool = False  # an earlier attempt left events in the stream
    seq: int = 0  # next event seq in the current attempt
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    output: Any = None  # engine RequestOutput once finished
    in_engine: bool = False
    callback_done: bool = False  # a Redis retry of the retirement must not run the success callback twice
    retire_inline: bool = (
        False  # store the result on the loop's thread (success callback, or a failed handover)
    )
    needs_check: bool = False  # its status must be read (rose.worker.checks) before RQ's handler stores it
    stream_ttl_due: float = 0.0  # monotonic time at which the next event (re)sets the stream's expiry
    queue_s: float | None = None  # seconds on the queue (enqueued to started), when RQ recorded both
    ttft_s: float | None = None  # seconds from start to the first token
    # The job's id and hash key, read once: RQ's properties recompute them, and the loop reads them for every
    # running job at every step (events, probe).
    id: str = field(init=False)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.job.id
        self.key = self.job.key

    @property
    def composite_key(self) -> str:
        return self.execution.composite_key

    def registry_ttl(self) -> int:
        return (self.timeout or 0) + ORPHAN_GRACE_S

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1


def job_timeout(job: Job) -> int | None:
    timeout = job.timeout if job.timeout is not None else DEFAULT_JOB_TIMEOUT
    return None if timeout is None or int(timeout) < 0 else int(timeout)


def take(worker: RoseWorker, limit: int, lengths: list[int] | None = None) -> list[tuple[str, Queue]]:
    """Up to `limit` job ids, highest-priority queue first, without blocking: one round trip to size the queues
    (none when `lengths` are given, fresh from the step's probe), one to move the ids (LMOVE into each queue's
    intermediate list, as RQ's own dequeue does)."""
    conn = worker.connection
    if lengths is None:
        with conn.pipeline(transaction=False) as pipe:
            for queue in worker.queues:
                pipe.llen(queue.key)
            lengths = pipe.execute()
    if not any(lengths):
        return []
    plan: list[tuple[Queue, int]] = []
    left = limit
    for queue, length in zip(worker.queues, lengths, strict=True):
        n = min(left, int(length))
        if n > 0:
            plan.append((queue, n))
            left -= n
    taken: list[tuple[str, Queue]] = []
    with conn.pipeline(transaction=False) as pipe:
        for queue, n in plan:
            for _ in range(n):
                pipe.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
        replies = iter(pipe.execute())
    for queue, n in plan:
        for _ in range(n):
            job_id = next(replies)
            if job_id is not None:  # another worker was quicker
                taken.append((job_id.decode() if isinstance(job_id, bytes) else job_id, queue))
    return taken


def wait_for_one(worker: RoseWorker, timeout: float) -> list[tuple[str, Queue]]:
    """Block up to `timeout` s for a job, crash-safe: BLMOVE into the queue's intermediate list, as RQ does for one
    queue. RQ's multi-queue dequeue is a BLPOP, which loses the id if the worker dies before starting the job, so
    with several queues this blocks on the highest-priority one only and briefly: the caller's non-blocking take()
    covers every queue between waits."""
    queue = worker.queues[0]
    if len(worker.queues) > 1:
        timeout = min(timeout, MULTI_QUEUE_BLOCK_S)
    job_id = worker.connection.blmove(queue.key, queue.intermediate_queue_key, timeout, "LEFT", "RIGHT")
    if job_id is None:
        return []
    return [(job_id.decode() if isinstance(job_id, bytes) else job_id, queue)]


def start(worker: RoseWorker, taken: list[tuple[str, Queue]]) -> list[Running]:
    """Start the taken jobs the RQ way (StartedJobRegistry + Execution, status started), in one transaction."""
    if not taken:
        return []
    conn = worker.connection
    jobs = Job.fetch_many([i for i, _ in taken], connection=conn, serializer=worker.serializer)
    started: list[Running] = []
    exists_at: list[int] = []  # index of each started job's EXISTS reply in the pipeline's results
    with conn.pipeline() as pipe:
        for (job_id, queue), job in zip(taken, jobs, strict=True):
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            if job is None:
                log.info("job %s vanished before it started; skipping", job_id)
                continue
            status = job.get_status(refresh=False)
            if status != JobStatus.QUEUED:
                # e.g. canceled between dequeue and now: a canceled job never starts.
                log.info("job %s is %s, not queued; not starting it", job_id, status.value)
                continue
            job.redis_server_version = worker.get_redis_server_version()
            timeout = job_timeout(job)
            run = Running(
                job=job,
                queue=queue,
                execution=None,
                started_wall=time.time(),  # type: ignore[arg-type]
                started_mono=time.monotonic(),
                timeout=timeout,
            )
            run.execution = rq_store.record_start(pipe, worker, job, run.registry_ttl())
            exists_at.append(len(pipe))
            pipe.exists(keys.stream_key(job_id))
            started.append(run)
        results = pipe.execute()
    rq_store.hold(worker, [run.execution for run in started])
    for run, idx in zip(started, exists_at, strict=True):
        run.restarted = bool(results[idx])
        log.debug("job %s started from %s%s", run.id, run.queue.name, " (restart)" if run.restarted else "")
    return started


def adopt(worker: RoseWorker, taken: list[tuple[str, Queue]]) -> list[Running]:
    """Jobs whose start transaction may or may not have gone through (the connection broke before its reply):
    pick up those we did start, start those still queued. Without this they would be orphans, restarted later."""
    if not taken:
        return []
    conn = worker.connection
    with conn.pipeline(transaction=False) as pipe:
        for job_id, _ in taken:
            pipe.hmget(Job.key_for(job_id), "status", "worker_name")
        states = pipe.execute()
    to_start: list[tuple[str, Queue]] = []
    adopted: list[Running] = []
    for (job_id, queue), (status, owner) in zip(taken, states, strict=True):
        if status == JobStatus.QUEUED.value.encode():
            to_start.append((job_id, queue))
        elif status == JobStatus.STARTED.value.encode() and owner == worker.name.encode():
            execution = rq_store.started_execution(conn, queue, job_id, worker.name)
            if execution is None:
                continue
            job = Job.fetch(job_id, connection=conn, serializer=worker.serializer)
            rq_store.hold(worker, [execution])
            run = Running(
                job=job,
                queue=queue,
                execution=execution,
                started_wall=time.time(),
                started_mono=time.monotonic(),
                timeout=job_timeout(job),
            )
            run.restarted = bool(conn.exists(keys.stream_key(job_id)))
            adopted.append(run)
            log.info("job %s: its start went through before the connection broke; carrying on", job_id)
    return adopted + start(worker, to_start)


def may_run_callbacks(run: Running) -> bool:
    """Whether a failing job's RQ callbacks may be imported and run: only for a rose.jobs.generate job whose payload
    decodes as JSON. A refused job (pickle, another function such as os.system) is no job of ours: its callbacks
    are the sender's code, never run here."""
    try:
        return run.job.func_name == keys.FUNC_PATH
    except Exception:
        return False


def validate(worker: RoseWorker, run: Running) -> str | None:
    """Parse the job's arguments. Returns the failure message for a job that must fail, else None."""
    job = run.job
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except DeserializationError as exc:
        if isinstance(exc.__cause__, RecursionError):
            return (
                "the job's payload is JSON nested too deeply to decode (RecursionError); nothing in this job was "
                "run. rose.jobs.generate kwargs need only a few levels"
            )
        if isinstance(exc.__cause__, ValueError | TypeError) and not isinstance(
            exc.__cause__, UnicodeError | json.JSONDecodeError
        ):
            return (
                "the job's payload is JSON but not RQ's [\"rose.jobs.generate\", null, [], {kwargs}] layout "
                f"({exc.__cause__}); enqueue with RQ's JSONSerializer or follow docs/jobs.md"
            )
        return PICKLE_MESSAGE.format(queue=run.queue.name)
    if func_name != keys.FUNC_PATH:
        return (
            f"rose-worker only runs {keys.FUNC_PATH} jobs, not {func_name!r}: keep other jobs off the queues "
            f"it serves ({', '.join(worker.queue_names())})"
        )
    if args:
        return f"{keys.FUNC_PATH} takes keyword arguments only (kwargs={{'prompt': ...}}), got positional {json.dumps(args)[:200]}"
    try:
        run.request = GenerateRequest(**kwargs)
    except ValidationError as exc:
        return format_validation_error(exc)
    except TypeError as exc:  # e.g. non-string keys
        return f"invalid {keys.FUNC_PATH} arguments: {exc}"
    if run.request.chat_template is not None and not worker.settings.trust_request_chat_template:
        return (
            "this job sets 'chat_template' but the worker does not accept per-job chat templates: start "
            "rose-worker with --trust-request-chat-template (ROSE_TRUST_REQUEST_CHAT_TEMPLATE=1), or leave "
            "'chat_template' out to use the model's own"
        )
    return None
