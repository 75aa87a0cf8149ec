"""Stores finished jobs' results through RQ's own steps, without the engine loop ever waiting for Redis.

RQ's `handle_job_success` takes three round trips per job (WATCH the job's dependents key, read it, MULTI/EXEC the
result and the bookkeeping): ~1.5 ms a job on a busy 2-core host, in which the engine would not step, and a thread
doing it instead competes with the loop for the GIL. So the jobs that finish in one engine step are retired as one
batch, in two pipelined rounds on a connection of their own, each sent after one step and read after the next (while
the model runs, Redis answers):

1. WATCH every job's hash and dependents key; read the dependents and each job's status and owner;
2. MULTI, then for each job exactly what `handle_job_success` writes (RQ's own calls: worker counters, the job's
   status and Result, registries, expiry, execution cleanup) and its `done` event (XADD, EXPIRE, PUBLISH: its token
   events are already in its stream, rose.worker.loop), EXEC: a job's end and its announcement become visible
   together, whatever the instant of a crash.

Both rounds' commands come from rose.worker.rq_store; this module only pipelines them. `submit`, `advance` and
`drain` return what became of the jobs (`Retired`: stored, or handed back to the loop).

A batch in which a job is no longer `started` by this worker (canceled, stopped, deleted, taken over), or has
dependents, repeats or a rate limit, or whose EXEC the WATCH aborted (a job or its dependents changed meanwhile), is handed back to
the loop, which checks its jobs (rose.worker.watch) and stores what is still ours through `handle_job_success`
itself, job by job: a canceled job is never stored as finished. When the engine has nothing to run the rounds are read at
once, so a job's result is never stored later than two steps after its last token. On a Redis error the batch's jobs
go back to the loop the same way: the check notices a result that landed (its reply lost), and the loop stores the
others through RQ's handler.
"""

from __future__ import annotations

import collections
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from rose.worker import resp, rq_store
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

log = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class Round(enum.Enum):
    WATCHING = 1  # WATCH + reads sent
    COMMITTING = 2  # MULTI ... EXEC sent


@dataclass(slots=True)
class _Batch:
    runs: list[Running]
    conn: Any  # a pool connection, held (and WATCHing) until the batch is done
    round: Round = Round.WATCHING
    replies: int = 0  # replies the round in flight will get


@dataclass(slots=True)
class Retired:
    """What became of retiring jobs: `stored` (their results and `done` events are in Redis), `handed_back` (the
    loop must check them and store what is still ours through RQ's handler)."""

    stored: list[Running] = field(default_factory=list)
    handed_back: list[Running] = field(default_factory=list)

    def add(self, other: Retired) -> Retired:
        self.stored += other.stored
        self.handed_back += other.handed_back
        return self


class Retirer:
    def __init__(self, rq: RQWorker, announce: Callable[[Running], list[tuple[Any, ...]]]) -> None:
        """`announce(run)`: the commands writing the job's `done` event (rose.worker.outbox `done_commands`)."""
        self.rq = rq
        self.announce = announce
        self._batches: collections.deque[_Batch] = collections.deque()
        self.batched_jobs = 0  # jobs stored by the pipelined rounds (the others went through RQ's handler)

    @property
    def busy(self) -> bool:
        """Jobs whose result is not stored yet (the worker must not exit)."""
        return bool(self._batches)

    def held_executions(self) -> set[str]:
        """The executions of the jobs being retired (out of the loop's running jobs, still this worker's)."""
        return {run.composite_key for batch in self._batches for run in batch.runs}

    def holds(self, job_id: str) -> bool:
        return any(run.id == job_id for batch in self._batches for run in batch.runs)

    def runs(self) -> list[Running]:
        """The jobs being retired."""
        return [run for batch in self._batches for run in batch.runs]

    def submit(self, runs: list[Running]) -> Retired:
        """Start storing these finished jobs (their `result` built, their token events queued). Returns the jobs
        handed back at once (a Redis error)."""
        if not runs:
            return Retired()
        batch = _Batch(runs, None)
        try:
            batch.conn = self.rq.connection.connection_pool.get_connection()
            _send(batch.conn, rq_store.success_watch(runs))
        except _REDIS_ERRORS as exc:
            return self._hand_back(batch, exc)
        self._batches.append(batch)
        return Retired()

    def advance(self, wait: bool = False) -> Retired:
        """Move every batch whose replies are in (`wait`: all of them, waiting for Redis) to its next round."""
        retired = Retired()
        for batch in list(self._batches):
            try:
                if not wait and not batch.conn.can_read(timeout=0):
                    continue
                if batch.round is Round.WATCHING:
                    retired.add(self._commit(batch))
                else:
                    retired.add(self._finish(batch))
            except _REDIS_ERRORS as exc:
                retired.add(self._hand_back(batch, exc))
            except Exception as exc:  # a bug must not take the loop down nor lose the jobs
                log.exception("retiring %d jobs failed", len(batch.runs))
                retired.add(self._hand_back(batch, exc))
        return retired

    def drain(self) -> Retired:
        """Store every pending result now (shutdown, or an idle engine)."""
        retired = Retired()
        while self._batches:
            retired.add(self.advance(wait=True))
        return retired

    def _commit(self, batch: _Batch) -> Retired:
        n = len(batch.runs)
        replies = _read(batch.conn, 1 + 2 * n)
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors:
            raise redis.ConnectionError(f"reading the jobs to retire failed: {errors[0]}")
        if not rq_store.still_ours(self.rq.name, batch.runs, replies[1:]):
            # canceled, deleted, taken over, dependents to enqueue, repeats: the loop checks them, then stores
            # what is still ours through RQ's handler
            self._release(batch, unwatch=True)
            return self._by_handler(batch)
        commands = [
            ("MULTI",),
            *rq_store.success_commands(self.rq, batch.runs),
            *(command for run in batch.runs for command in self.announce(run)),
            ("EXEC",),
        ]
        _send(batch.conn, commands)
        batch.round, batch.replies = Round.COMMITTING, len(commands)
        return Retired()

    def _finish(self, batch: _Batch) -> Retired:
        replies = _read(batch.conn, batch.replies)
        self._batches.remove(batch)
        self._release(batch)
        executed = replies[-1]
        if executed is None:  # the WATCH aborted the transaction: a job or its dependents changed meanwhile
            log.info("retiring %d jobs: they changed meanwhile, using RQ's handler", len(batch.runs))
            return self._by_handler(batch)
        errors = [
            r for r in (executed if isinstance(executed, list) else [executed]) if isinstance(r, Exception)
        ]
        if errors:
            raise redis.ConnectionError(f"storing {len(batch.runs)} results failed: {errors[0]}")
        self.batched_jobs += len(batch.runs)
        for run in batch.runs:
            rq_store.after_success(self.rq, run)
        return Retired(stored=batch.runs)

    def _by_handler(self, batch: _Batch) -> Retired:
        if batch in self._batches:
            self._batches.remove(batch)
        return Retired(handed_back=batch.runs)

    def _hand_back(self, batch: _Batch, exc: BaseException) -> Retired:
        log.error("could not store the results of %d jobs (%s); the loop retries them", len(batch.runs), exc)
        if batch.conn is not None:
            self._release(batch, broken=True)
        return self._by_handler(batch)

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
        self.rq.connection.connection_pool.release(conn)


def _send(conn: Any, commands: list[tuple[Any, ...]]) -> None:
    # hiredis's packer called directly: redis-py's pack_commands costs twice as much for these ~15 per job
    conn.send_packed_command([b"".join(map(resp.pack_command, commands))], check_health=False)


def _read(conn: Any, count: int) -> list[Any]:
    """`count` replies in order; an error reply comes back as its exception (redis-py raises it)."""
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(conn.read_response())
        except redis.ResponseError as exc:
            replies.append(exc)
    return replies
