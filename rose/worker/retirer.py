"""Stores finished jobs' results through RQ's own steps, without the engine loop ever waiting for Redis.

RQ's `handle_job_success` takes three round trips per job (WATCH the job's dependents key, read it, MULTI/EXEC the
result and the bookkeeping): ~1.5 ms a job on a busy 2-core host, in which the engine would not step, and a thread
doing it instead competes with the loop for the GIL. So the jobs that finished since the last batch are retired
together in two rounds on one connection (rose.worker.batch_store), each sent after a step and read after the next
(while the model runs, Redis answers): round 1 WATCHes every job's hash and dependents set and reads its status,
owner and dependents; round 2, only if every job is still `started` by this worker with no dependents to enqueue,
writes in one MULTI/EXEC what `handle_job_success` writes for each job (RQ's own calls, recorded: worker counters, the
job's status and Result, registries, expiry, execution cleanup; less the writes that change nothing, and one write
per shared key for the batch: rq_store.success_commands, rose.worker.coalesce) and its `done` event (XADD, EXPIRE,
PUBLISH: its token events are already in its stream, rose.worker.loop), each stream it creates (RQ's result, a
not-streamed job's events) RESTOREd at its size instead (rose.worker.stream_dump, once Redis has shown it takes one);
then each stream that was there (a streamed job's events) is stored again at its size (batch_store.COMPACT_BYTES).
Atomic, as RQ's own WATCH + MULTI/EXEC: a job's end and its announcement become visible together, whatever the
instant of a crash.

`submit`, `advance` and `drain` return what became of the jobs (`Retired`: stored, or handed back to the loop). A
batch in which a job is no longer `started` by this worker (canceled, stopped, deleted, taken over), or has
dependents, repeats or a rate limit, or whose EXEC a watched key's change aborted, is handed back to the loop, which
checks its jobs (rose.worker.watch) and stores what is still ours through `handle_job_success` itself, job by job: a
canceled job is never stored as finished. When the engine has nothing to run the replies are read at once. On a
Redis error the batch's jobs go back to the loop the same way: the check notices a result that landed (its reply
lost), and the loop stores the others through RQ's handler. A batch a full Redis refused (nothing written) comes
back as `full`: the loop retires it again a while later, its ends and `done` events still one transaction.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from rose.jobs import keys
from rose.worker import batch_store, resp, rq_store
from rose.worker.coalesce import coalesced
from rose.worker.redis_guard import is_oom
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

log = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


@dataclass(slots=True)
class _Batch:
    runs: list[Running]
    writes: list[tuple[Any, ...]]
    streams: list[str]  # to restore if round 1 finds them not there, else to compact if small
    asks: batch_store.Asks  # what round 1 asked beyond the jobs
    # round 1's replies, then round 2's (once `sent`), on the one connection WATCH holds on
    reply: resp.Pending
    sent: list[tuple[Any, ...]] | None = None  # round 2's first transaction, once sent
    probe: bool = False  # round 2 asks whether Redis takes restored streams


@dataclass(slots=True)
class Retired:
    """What became of retiring jobs: `stored` (their results and `done` events are in Redis), `handed_back` (the
    loop must check them and store what is still ours through RQ's handler), `full` (Redis refused the batch for
    memory, nothing written: the loop retires them again once Redis may have room, their ends and `done` events
    still one transaction)."""

    stored: list[Running] = field(default_factory=list)
    handed_back: list[Running] = field(default_factory=list)
    full: list[Running] = field(default_factory=list)

    def add(self, other: Retired) -> Retired:
        self.stored += other.stored
        self.handed_back += other.handed_back
        self.full += other.full
        return self


class Retirer:
    def __init__(self, rq: RQWorker, announce: Callable[[Running], list[tuple[Any, ...]]]) -> None:
        """`announce(run)`: the commands writing the job's `done` event (rose.worker.outbox `done_commands`)."""
        self.rq = rq
        self.announce = announce
        self._batches: collections.deque[_Batch] = collections.deque()
        self.batched_jobs = 0  # jobs stored by batches (the others went through RQ's handler)
        self._copy: bool | None = None  # whether Redis has COPY (None: the next batch's round 1 asks)
        # whether Redis takes a stream restored at its size (stream_dump; None: the next batch's round 2 asks)
        self._restore: bool | None = None

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
        """Start storing these finished jobs (their `result` built, their token events delivered). Returns the
        jobs handed back at once (repeats or a rate limit: RQ's handler; a Redis error)."""
        if not runs:
            return Retired()
        if not all(map(rq_store.batchable, runs)):
            return Retired(handed_back=runs)
        writes = coalesced(
            [
                *rq_store.success_commands(self.rq, runs),
                *(command for run in runs for command in self.announce(run)),
            ]
        )
        # the jobs' streams kept at their size, not in Redis's 4 KB first node: restored where Redis takes it, else
        # copied where it has COPY (batch_store.COMPACT_BYTES; asked in the first batch)
        streams = (
            [key for run in runs for key in (keys.rq_results_key(run.id), keys.stream_key(run.id))]
            if self._copy is not False or self._restore is not False
            else []
        )
        asks = batch_store.Asks(copy=self._copy is None, clock=self._restore is True)
        check = batch_store.check_commands(runs, streams, asks)
        try:
            pending = resp.Pending(self.rq.connection, resp.pack_commands(check), len(check))
        except _REDIS_ERRORS as exc:
            return self._hand_back(runs, exc)
        self._batches.append(_Batch(runs, writes, streams, asks, pending))
        return Retired()

    def advance(self, wait: bool = False) -> Retired:
        """Move on every batch whose replies are in: round 1's read sends round 2, round 2's settles the batch
        (`wait`: both rounds of every batch, waiting for Redis)."""
        retired = Retired()
        for batch in list(self._batches):
            try:
                while wait or batch.reply.ready():
                    # round 1 read: round 2 sent (None: its replies next), or the batch ends here
                    ended = (
                        self._settle(batch, batch.reply.read())
                        if batch.sent is not None
                        else self._store(batch)
                    )
                    if ended is not None:
                        self._batches.remove(batch)
                        retired.add(ended)
                        break
            except _REDIS_ERRORS as exc:
                batch.reply.abandon()
                retired.add(self._hand_back(batch.runs, exc))
            except Exception as exc:  # a bug must not take the loop down nor lose the jobs
                log.exception("retiring %d jobs failed", len(batch.runs))
                batch.reply.abandon()
                retired.add(self._hand_back(batch.runs, exc))
        return retired

    def drain(self) -> Retired:
        """Store every pending result now (shutdown, or an idle engine)."""
        return self.advance(wait=True)

    def _store(self, batch: _Batch) -> Retired | None:
        """Round 1 read: round 2 sent (None), or the batch handed back (not ours, dependents: the loop checks them,
        then stores what is still ours through RQ's handler)."""
        found = batch_store.checked(
            self.rq.name,
            batch.runs,
            batch.streams,
            batch.writes,
            batch.reply.read(keep=True),
            batch.asks,
            self._copy,
        )
        if found.copy is not None:
            self._copy = found.copy
        if found.refusal is not None:  # a full Redis: nothing sent
            if not is_oom(found.refusal):
                raise redis.ConnectionError(f"storing {len(batch.runs)} results failed: {found.refusal}")
            batch.reply.abandon()  # its WATCH goes with the connection
            return self._full(batch.runs, found.refusal)
        if not found.ours:
            batch.reply.abandon()  # its WATCH goes with the connection
            return Retired(handed_back=batch.runs)
        batch.probe = self._restore is None  # does Redis take restored streams? asked after the writes
        commands, batch.sent = batch_store.store_commands(
            batch.writes, found.compact, found.restore, found.now_ms, batch.probe
        )
        batch.reply.send(resp.pack_commands(commands), len(commands))
        return None

    def _settle(self, batch: _Batch, replies: list[Any]) -> Retired:
        assert batch.sent is not None
        outcome = batch_store.stored(replies, batch.sent, batch.probe)
        if outcome.copy is False:  # COPY unknown (a failover to an older server?) or denied by an ACL
            self._copy = False
        if outcome.restorable is not None:
            self._restore = outcome.restorable
        if outcome.unrestored:
            # a stream Redis would not restore (made between the rounds, or a failover to another server): its entry
            # is written now, out of the transaction (the loop waits for this one round trip: it should never come)
            log.warning(
                "Redis refused to restore %d streams; writing them as entries", len(outcome.unrestored)
            )
            with self.rq.connection.pipeline() as pipe:
                for command in batch_store.rewrites(batch.writes, outcome.unrestored):
                    pipe.execute_command(*command)
                pipe.execute()
        if outcome.stored is batch_store.Stored.ABORTED:
            # a watched key changed (canceled, stopped, a dependent enqueued): the loop checks them, then stores
            # what is still ours through RQ's handler
            return Retired(handed_back=batch.runs)
        if outcome.stored is batch_store.Stored.REFUSED and outcome.full:
            return self._full(batch.runs, outcome.refusals[0])
        if outcome.stored is batch_store.Stored.REFUSED:
            raise redis.ConnectionError(f"storing {len(batch.runs)} results failed: {outcome.refusals[0]}")
        self.batched_jobs += len(batch.runs)
        for run in batch.runs:
            rq_store.after_success(self.rq, run)
        return Retired(stored=batch.runs)

    def _full(self, runs: list[Running], refusal: object) -> Retired:
        log.warning("Redis is full: the results of %d jobs wait (%s)", len(runs), refusal)
        return Retired(full=runs)

    def _hand_back(self, runs: list[Running], exc: BaseException) -> Retired:
        log.error("could not store the results of %d jobs (%s); the loop retries them", len(runs), exc)
        if self._restore:  # after a reconnect (a failover?): asked again
            self._restore = None
        if self._batches:
            self._batches = collections.deque(b for b in self._batches if b.runs is not runs)
        return Retired(handed_back=runs)
