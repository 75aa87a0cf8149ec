"""Stores finished jobs' results through RQ's own steps, without the engine loop ever waiting for Redis.

RQ's `handle_job_success` takes three round trips per job (WATCH the job's dependents key, read it, MULTI/EXEC the
result and the bookkeeping): ~1.5 ms a job on a busy 2-core host, in which the engine would not step, and a thread
doing it instead competes with the loop for the GIL. So the jobs that finished since the last batch are retired
together, in one round trip sent after a step and read after the next (while the model runs, Redis answers): a
script (batch_store.store_if_ours) that checks every job is still `started` by this worker with no dependents to
enqueue and, only then, writes for each job what `handle_job_success` writes (RQ's own calls, recorded: worker
counters, the job's status and Result, registries, expiry, execution cleanup; less the writes that change nothing,
and one write per shared key for the batch: rq_store.success_commands, rose.worker.coalesce) and its `done` event
(XADD, EXPIRE, PUBLISH: its token events are already in its stream, rose.worker.loop); then the job's two streams
(RQ's result, rose's events) are stored again at their size (batch_store.COMPACT_ENTRIES). Atomic, as RQ's WATCH +
MULTI/EXEC is: a job's end and its announcement become visible together, whatever the instant of a crash.

`submit`, `advance` and `drain` return what became of the jobs (`Retired`: stored, or handed back to the loop). A
batch in which a job is no longer `started` by this worker (canceled, stopped, deleted, taken over), or has
dependents, repeats or a rate limit, is handed back to the loop, which checks its jobs (rose.worker.watch) and
stores what is still ours through `handle_job_success` itself, job by job: a canceled job is never stored as
finished. When the engine has nothing to run the reply is read at once. On a Redis error the batch's jobs go back
to the loop the same way: the check notices a result that landed (its reply lost), and the loop stores the others
through RQ's handler.
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
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

log = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


@dataclass(slots=True)
class _Batch:
    runs: list[Running]
    reply: resp.Pending  # the store_if_ours script's, read at `advance`


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
        self.batched_jobs = 0  # jobs stored by batches (the others went through RQ's handler)

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
        # the jobs' streams kept at their size, not in Redis's 4 KB first node (batch_store.COMPACT_ENTRIES)
        streams = [key for run in runs for key in (keys.rq_results_key(run.id), keys.stream_key(run.id))]
        packed = resp.pack_command(batch_store.store_if_ours(self.rq.name, runs, writes, streams))
        try:
            self._batches.append(_Batch(runs, resp.Pending(self.rq.connection, packed, 1)))
        except _REDIS_ERRORS as exc:
            return self._hand_back(runs, exc)
        return Retired()

    def advance(self, wait: bool = False) -> Retired:
        """Settle every batch whose reply is in (`wait`: all of them, waiting for Redis)."""
        retired = Retired()
        for batch in list(self._batches):
            try:
                if not wait and not batch.reply.ready():
                    continue
                self._batches.remove(batch)
                retired.add(self._settle(batch, batch.reply.read()[0]))
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

    def _settle(self, batch: _Batch, reply: Any) -> Retired:
        if isinstance(reply, Exception):
            raise redis.ConnectionError(f"storing {len(batch.runs)} results failed: {reply}")
        stored, refusals = batch_store.stored_if_ours(reply)
        if not stored:
            # canceled, deleted, taken over, dependents to enqueue: the loop checks them, then stores what is
            # still ours through RQ's handler
            return Retired(handed_back=batch.runs)
        if refusals:
            raise redis.ConnectionError(f"storing {len(batch.runs)} results failed: {refusals[0]}")
        self.batched_jobs += len(batch.runs)
        for run in batch.runs:
            rq_store.after_success(self.rq, run)
        return Retired(stored=batch.runs)

    def _hand_back(self, runs: list[Running], exc: BaseException) -> Retired:
        log.error("could not store the results of %d jobs (%s); the loop retries them", len(runs), exc)
        if self._batches:
            self._batches = collections.deque(b for b in self._batches if b.runs is not runs)
        return Retired(handed_back=runs)
