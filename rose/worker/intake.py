"""Taking jobs off the queues and starting them.

`Intake.take(room, lengths, block_s)` returns the jobs it started, as `Running` records (phase TAKEN): ids are moved
into RQ's intermediate list of their queue (rq_start.dequeue, the queue's order; or rose.worker.fair_queue, by tenant
and deadline), and starting a job removes its id from there in the
same transaction that records its execution, so a crash at any point leaves the job findable (rose.worker.recovery
puts it back). A start whose reply was lost (Redis dropped the connection) stays in limbo and is settled by the next
take: the jobs that did start are carried on, the others started. The job loop then holds each job to the job
contract (rose.jobs.contract.parse).
"""

from __future__ import annotations

import logging
import time

from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue

from rose.jobs import keys
from rose.worker import rq_start, rq_store
from rose.worker.fair_queue import FairQueue
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running, job_timeout

log = logging.getLogger(__name__)

MULTI_QUEUE_BLOCK_S = 0.2  # idle with several queues: how often the lower-priority ones are looked at

Taken = list[tuple[str, Queue]]  # dequeued ids, each with its queue


class Intake:
    """Starts jobs for the worker `rq` (whose connection and queues it uses). Owns the ids in limbo. `fair`: the
    fair-share policy's taker (None: the queues' order)."""

    def __init__(self, rq: RQWorker, fair: FairQueue | None = None) -> None:
        self.rq = rq
        self.fair = fair
        self._limbo: Taken = []  # dequeued ids whose start may not have gone through
        self._drained = False  # the last dequeue found the queues empty

    def limbo_ids(self) -> set[str]:
        """Ids this worker dequeued and may have started: not orphans, whatever the registries say."""
        return {job_id for job_id, _ in self._limbo}

    def take(self, room: int, lengths: list[int] | None, block_s: float = 0.0) -> list[Running]:
        """Start up to `room` jobs, highest-priority queue first. `lengths`: the queues' lengths if a probe just
        read them (all zero: no round trip; None: as the last dequeue left them); `block_s` > 0: wait that long for
        a job if there is none (only when the worker is idle)."""
        if room <= 0:
            return []
        if lengths is not None:
            self._drained = not any(lengths)
        taken, self._limbo = self._limbo, []
        try:
            if taken:  # a start whose reply was lost last time
                return self._adopt(taken)
            fetched = [] if self._drained and block_s <= 0 else self._dequeue(room)
            taken = [(job_id, queue) for job_id, queue, _ in fetched]
            jobs = [job for _, _, job in fetched]
            if not fetched and block_s > 0:
                taken = self._wait_for_one(block_s)
                if not taken:
                    return []
                jobs = rq_start.fetch_jobs(self.rq.connection, [taken[0][0]], self.rq)
                if room > 1:
                    fetched = self._dequeue(room - 1)
                    taken += [(job_id, queue) for job_id, queue, _ in fetched]
                    jobs += [job for _, _, job in fetched]
            return self._start(taken, jobs)
        except BaseException:
            self._limbo = taken
            raise

    def _dequeue(self, limit: int) -> list[tuple[str, Queue, Job | None]]:
        """Up to `limit` jobs without blocking, in one round trip (ids moved, each job's status and timeout read). Fewer
        than asked: the queues are empty now, and no dequeue is tried until a probe says otherwise."""
        if self.fair is not None:
            fetched = self.fair.take(self.rq.queues, limit)
        else:
            fetched = rq_start.dequeue(self.rq.connection, self.rq.queues, limit, self.rq.serializer)
        self._drained = len(fetched) < limit
        return fetched

    def _wait_for_one(self, timeout: float) -> Taken:
        """Block for a job, crash-safe (BLMOVE). RQ's multi-queue dequeue is a BLPOP, which loses the id if the
        worker dies before starting the job, so with several queues this blocks on the highest-priority one only
        and briefly: the non-blocking dequeue covers every queue between waits."""
        queue = self.rq.queues[0]
        if len(self.rq.queues) > 1:
            timeout = min(timeout, MULTI_QUEUE_BLOCK_S)
        job_id = rq_start.dequeue_blocking(self.rq.connection, queue, timeout)
        return [] if job_id is None else [(job_id, queue)]

    def _start(self, taken: Taken, jobs: list[Job | None] | None = None) -> list[Running]:
        """Start the taken jobs the RQ way (Execution, StartedJobRegistry, status started), in one transaction.
        `jobs`: as the dequeue read them (else fetched here)."""
        if not taken:
            return []
        conn = self.rq.connection
        if jobs is None:
            jobs = rq_start.fetch_jobs(conn, [job_id for job_id, _ in taken], self.rq)
        started: list[Running] = []
        recorder = rq_start.Recorder(conn)  # the start's writes, sent in one transaction, coalesced
        for (job_id, queue), job in zip(taken, jobs, strict=True):
            rq_start.settle_dequeued(recorder.pipe, queue, job_id)
            if job is None:
                log.info("job %s vanished before it started; skipping", job_id)
                continue
            if not rq_start.is_queued(job):
                # e.g. canceled between dequeue and now: a canceled job never starts.
                log.info("job %s is %s, not queued; not starting it", job_id, job.get_status(refresh=False))
                continue
            run = _running(job, queue, None)
            run.execution = rq_start.record_start(recorder.pipe, self.rq, job, run.registry_ttl())
            started.append(run)
        if started:
            rq_start.mark_busy(recorder.pipe, self.rq)
        # and each job's hash as started, and whether its stream exists (a restart: it starts over with a reset)
        reads = [
            read
            for run in started
            for read in (rq_start.start_read(run.job), ("EXISTS", keys.stream_key(run.id)))
        ]
        results = recorder.execute(reads)
        rq_store.hold(self.rq, [run.execution for run in started])
        kept: list[Running] = []
        for run, fields, exists in zip(started, results[::2], results[1::2], strict=True):
            if not rq_start.restore(run.job, fields):
                self._undo(run)
                continue
            run.restarted = bool(exists)
            kept.append(run)
            log.debug(
                "job %s started from %s%s", run.id, run.queue.name, " (restart)" if run.restarted else ""
            )
        return kept

    def _undo(self, run: Running) -> None:
        """A job deleted between its take and its start: the start's writes (which made a hash of the job again)
        are taken back. A Redis error leaves the start in limbo (`take`), where `_adopt` undoes it."""
        log.info("job %s vanished before it started; skipping", run.id)
        rq_store.release(self.rq, run.execution)
        rq_start.undo_start(self.rq.connection, run.id, run.queue, run.execution)

    def _adopt(self, taken: Taken) -> list[Running]:
        """Jobs whose start transaction may or may not have gone through: pick up those we did start, start those
        still queued. Without this they would be orphans, restarted later."""
        conn, name = self.rq.connection, self.rq.name
        to_start: Taken = []
        adopted: list[Running] = []
        states = rq_start.job_states(conn, [job_id for job_id, _ in taken])
        for (job_id, queue), (status, owner) in zip(taken, states, strict=True):
            if status == rq_store.QUEUED:
                to_start.append((job_id, queue))
            elif status == rq_store.STARTED and owner == name:
                execution = rq_start.started_execution(conn, queue, job_id, name)
                if execution is None:
                    continue
                try:
                    job = Job.fetch(job_id, connection=conn, serializer=self.rq.serializer)
                except NoSuchJobError:  # deleted before its start, which made a hash of it again
                    log.info("job %s vanished before it started; taking its start back", job_id)
                    rq_start.undo_start(conn, job_id, queue, execution)
                    continue
                rq_store.hold(self.rq, [execution])
                run = _running(job, queue, execution)
                run.restarted = bool(conn.exists(keys.stream_key(job_id)))
                adopted.append(run)
                log.info("job %s: its start went through before the connection broke; carrying on", job_id)
        return adopted + self._start(to_start)


def _running(job: Job, queue: Queue, execution: rq_store.Execution | None) -> Running:
    return Running(
        job=job,
        queue=queue,
        execution=execution,  # type: ignore[arg-type]
        started_wall=time.time(),
        started_mono=time.monotonic(),
        timeout=job_timeout(job),
    )
