"""Stores finished jobs' results through RQ's own steps, without the engine loop ever waiting for Redis.

RQ's `handle_job_success` takes three round trips per job (WATCH the job's dependents key, read it, MULTI/EXEC the
result and the bookkeeping): ~1.5 ms a job on a busy 2-core host, in which the engine would not step, and a thread
doing it instead competes with the loop for the GIL. So the jobs that finish in one engine step are retired as one
batch, in two pipelined rounds on a connection of their own, each sent after one step and read after the next (while
the model runs, Redis answers):

1. WATCH every job's hash and dependents key; read the dependents (SMEMBERS) and each job's status and owner;
2. MULTI, then for each job exactly what `handle_job_success` writes (RQ's own calls: worker counters, the job's
   status and Result, registries, expiry, execution cleanup), EXEC.

A batch in which a job is no longer `started` by this worker (canceled, stopped, deleted, taken over), or has
dependents or repeats, or whose EXEC the WATCH aborted (a job or its dependents changed meanwhile), goes back to the
loop, which checks its jobs (rose.worker.checks) and stores what is still ours through `handle_job_success` itself,
job by job: a canceled job is never stored as finished. When the engine has nothing to run the rounds are read at
once, so a job's result is never stored later than two steps after its last token. On a Redis error the batch's jobs
go back to the loop the same way: the check notices a result that landed (its reply lost), and the loop stores the
others through RQ's handler.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from rq.job import JobStatus
from rq.utils import now

from rose.worker import resp, rq_store
from rose.worker.intake import Running
from rose.worker.outcomes import result_dict

if TYPE_CHECKING:
    from rose.worker.worker import RoseWorker

log = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
WATCHING, COMMITTING = 1, 2


@dataclass
class _Batch:
    runs: list[Running]
    conn: Any  # a pool connection, held (and WATCHing) until the batch is done
    phase: int = WATCHING
    replies: int = 0  # replies the round in flight will get


class Retirer:
    def __init__(self, worker: RoseWorker) -> None:
        self.worker = worker
        self._batches: collections.deque[_Batch] = collections.deque()
        self._started, self._name = JobStatus.STARTED.value.encode(), worker.name.encode()  # a job still ours
        self.batched_jobs = 0  # jobs retired by the pipelined rounds (the others went through RQ's handler)

    @property
    def busy(self) -> bool:
        """Jobs whose result is not stored yet (the worker must not exit)."""
        return bool(self._batches)

    def held_executions(self) -> set[str]:
        """The executions of the jobs being retired (not in the loop's running jobs, still this worker's)."""
        return {run.composite_key for batch in self._batches for run in batch.runs}

    def submit(self, runs: list[Running]) -> None:
        """Start retiring jobs that finished (out of the loop's running jobs, their token events already queued)."""
        if not runs:
            return
        pool = self.worker.connection.connection_pool
        batch = _Batch(runs, None)
        try:
            for run in runs:
                run.job.ended_at = now()
                run.job._result = result_dict(self.worker, run)
            batch.conn = pool.get_connection()
            keys = [run.job.dependents_key for run in runs]
            commands = [
                ("WATCH", *keys, *(run.key for run in runs)),
                *(("SMEMBERS", key) for key in keys),
                *(("HMGET", run.key, "status", "worker_name") for run in runs),
            ]
            batch.conn.send_packed_command([b"".join(map(resp.pack_command, commands))], check_health=False)
        except _REDIS_ERRORS as exc:
            self._hand_back(batch, exc)
            return
        self._batches.append(batch)

    def advance(self, wait: bool = False) -> None:
        """Move every batch whose replies are in (`wait`: all of them, waiting for Redis) to its next round."""
        for batch in list(self._batches):
            try:
                if not wait and not batch.conn.can_read(timeout=0):
                    continue
                if batch.phase == WATCHING:
                    self._commit(batch)
                else:
                    self._finish(batch)
            except _REDIS_ERRORS as exc:
                self._hand_back(batch, exc)
            except Exception as exc:  # a bug must not take the loop down nor lose the jobs
                log.exception("retiring %d jobs failed", len(batch.runs))
                self._hand_back(batch, exc)

    def drain(self) -> None:
        """Store every pending result now (shutdown, or an idle engine)."""
        while self._batches:
            self.advance(wait=True)

    def _commit(self, batch: _Batch) -> None:
        n = len(batch.runs)
        replies = _read(batch.conn, 1 + 2 * n)
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            raise redis.ConnectionError(f"reading the jobs to retire failed: {errors[0]}")
        dependents, owners = replies[1 : 1 + n], replies[1 + n :]
        if (
            any(
                owner != [self._started, self._name] for owner in owners
            )  # canceled, deleted, taken over, ...
            or any(dependents)  # dependents to enqueue: RQ's handler does it
            or not all(rq_store.batchable(run) for run in batch.runs)  # repeats, rate limits
        ):
            self._release(batch, unwatch=True)
            self._by_handler(
                batch
            )  # the loop checks them, then stores what is still ours through RQ's handler
            return
        recorder = self.worker.connection.pipeline(transaction=False)  # records RQ's writes, never executed
        for run in batch.runs:
            rq_store.record_success(recorder, self.worker, run)
        commands = [("MULTI",), *(args for args, _ in recorder.command_stack), ("EXEC",)]
        recorder.reset()
        # hiredis's packer called directly: redis-py's pack_commands costs twice as much for these ~15 per job
        batch.conn.send_packed_command([b"".join(map(resp.pack_command, commands))], check_health=False)
        batch.phase, batch.replies = COMMITTING, len(commands)

    def _finish(self, batch: _Batch) -> None:
        replies = _read(batch.conn, batch.replies)
        self._batches.remove(batch)
        self._release(batch)
        executed = replies[-1]
        if executed is None:  # the WATCH aborted the transaction: a dependent was added meanwhile
            log.info("retiring %d jobs: dependents changed meanwhile, using RQ's handler", len(batch.runs))
            self._by_handler(batch)
            return
        errors = [
            r for r in (executed if isinstance(executed, list) else [executed]) if isinstance(r, Exception)
        ]
        if errors:
            raise redis.ConnectionError(f"storing {len(batch.runs)} results failed: {errors[0]}")
        self.batched_jobs += len(batch.runs)
        for run in batch.runs:
            rq_store.after_success(self.worker, run)
            self.worker._announce_done(run, run.job._result)

    def _by_handler(self, batch: _Batch) -> None:
        if batch in self._batches:
            self._batches.remove(batch)
        for run in batch.runs:
            run.retire_inline = True
            self.worker.running[run.id] = run  # retired by the loop's `_retire`, through RQ's handler...
        self.worker._force_check(
            batch.runs
        )  # ...once the loop has checked they are still ours and not canceled

    def _hand_back(self, batch: _Batch, exc: BaseException) -> None:
        log.error("could not store the results of %d jobs (%s); the loop retries them", len(batch.runs), exc)
        if batch.conn is not None:
            self._release(batch, broken=True)
        self._by_handler(batch)

    def _release(self, batch: _Batch, unwatch: bool = False, broken: bool = False) -> None:
        """Give the batch's connection back to the pool: closed if `broken` (an unread reply must never reach its
        next user), else after UNWATCH if the transaction was not sent."""
        conn, batch.conn = batch.conn, None
        try:
            if broken:
                conn.disconnect()
            elif unwatch:
                conn.send_command("UNWATCH", check_health=False)
                conn.read_response()
        except _REDIS_ERRORS:
            conn.disconnect()
        self.worker.connection.connection_pool.release(conn)


def _read(conn: Any, count: int) -> list[Any]:
    """`count` replies in order; an error reply comes back as its exception (redis-py raises it)."""
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(conn.read_response())
        except redis.ResponseError as exc:
            replies.append(exc)
    return replies
