"""The job loop: the worker's running jobs, and one iteration over them. rose.worker.worker runs it.

`JobLoop.iterate` reads top to bottom, like an engine step:

    take     jobs while the engine has room (rose.worker.intake, by tenant and deadline: rose.worker.fair_queue;
             blocking on the queues only when idle), each held to the contract (rose.worker.admission)
    step     the engine; each job's tokens queued as events (rose.worker.step_outputs, rose.worker.outbox)
    watch    cancels, deletions, lost jobs, timeouts, deadlines, stop commands (rose.worker.watch: applied here)
    retire   finished jobs: batched by the retirer (rose.worker.retirer), or by RQ's handler once checked
    publish  the iteration's events (rose.worker.publisher: sent at once, acknowledged at the next send)

On a busy loop nothing waits for a Redis round trip: the probe and the retirer's rounds are sent before a step and
read after it. A finished job's result is stored only once Redis has acknowledged its token events
(`Outbox.delivered`), so a job stored as finished never lacks tokens in its stream, whatever Redis went through; if
Redis refused or lost events (`Publisher.take_dropped` / `lost`), the streams of the jobs held here start over
(`Outbox.resync`; a full Redis's refusals: once it has room) before any of them is stored, and the iteration asks the
worker to reconcile with Redis. `running`
(job id -> rose.worker.running.Running) is owned here: only this module adds or removes a job, or changes its phase.
Each stage touching Redis runs through the worker's RedisGuard: while Redis is down the engine keeps stepping, and
whatever a failed stage owed (a check, a store, a stop) is tried again later.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

from rose.config import WorkerSettings
from rose.jobs import contract, tools
from rose.worker import adapters, faults, probe, rq_store
from rose.worker.admission import Admission
from rose.worker.endings import DeadlineExceeded, Endings, RoseJobTimeout
from rose.worker.engine_protocol import WorkerEngine
from rose.worker.fair_queue import FairQueue
from rose.worker.intake import Intake
from rose.worker.isolate import isolate
from rose.worker.metrics import WorkerMetrics
from rose.worker.milestones import Milestones
from rose.worker.outbox import RETRY_FULL_S, Outbox
from rose.worker.redis_guard import REDIS_ERRORS, RedisGuard
from rose.worker.retirer import Retired, Retirer
from rose.worker.rq_worker import RQWorker
from rose.worker.running import CHECKED_PHASE, STORE_RETRY_PHASE, Phase, Running
from rose.worker.step_outputs import StepOutputs
from rose.worker.tenants import Tenants
from rose.worker.watch import Finding, Verdict, Watch, owed

log = logging.getLogger(__name__)

DELIVERY_WAIT_S = 1.0  # an idle loop waits this long for Redis to acknowledge finished jobs' events
RETIRE_EVERY_S = 0.1  # while the engine runs, a retirement batch at most this often


@dataclass(frozen=True, slots=True)
class Iterated:
    """What one iteration did: `took` jobs; `reconcile`: Redis refused or lost events of this worker, so the worker
    must compare what Redis says of its jobs and streams with what it holds (rose.worker.worker)."""

    took: int = 0
    reconcile: bool = False


class JobLoop:
    def __init__(
        self,
        engine: WorkerEngine,
        rq: RQWorker,
        settings: WorkerSettings,
        outbox: Outbox,
        endings: Endings,
        guard: RedisGuard,
        metrics: WorkerMetrics,
    ) -> None:
        self.engine = engine
        self.rq = rq
        self.settings = settings
        self.outbox = outbox
        self.endings = endings
        self.guard = guard
        self.metrics = metrics
        self.running: dict[str, Running] = {}
        self._reconcile = False  # set by an iteration that found events refused or lost
        self._next_retire = 0.0  # monotonic time the next retirement batch may go
        self._full_until = 0.0  # a batch refused by a full Redis: none before this (monotonic)
        self.milestones = Milestones(outbox, metrics)
        self.tenants = Tenants(settings.tenant_weights, metrics)
        fair = None
        if settings.intake_policy == "fair":
            fair = FairQueue(rq.connection, rq.serializer, settings.tenant_weights, self.tenants)
        self.intake = Intake(rq, fair)
        self.watch = Watch(probe.target(rq), settings.check_interval, settings.deadline_policy == "abort")
        self.retirer = Retirer(rq, outbox.done_commands)
        # reads the calls of jobs with tools and tool_choice "auto" (rose.jobs.tools); None: such jobs fail
        chat_template = getattr(engine.tokenizer, "chat_template", None)
        self.tool_parser = tools.resolve_parser(settings.tool_call_parser, chat_template)
        self.adapters = adapters.Adapters(settings, metrics)  # a job's `lora` -> its LoRARequest
        self.admission = Admission(
            engine, settings, rq.queue_names, self.tool_parser, self.adapters, self.tenants, self.milestones
        )
        self.step_outputs = StepOutputs(
            outbox,
            self.milestones,
            metrics,
            engine.tokenizer,
            rq.name,
            self.tool_parser,
            self.adapters,
            self.tenants,
        )

    @property
    def busy(self) -> bool:
        """Jobs running, or results being stored."""
        return bool(self.running) or self.retirer.busy

    def held_executions(self) -> set[str]:
        """The executions this process holds: running jobs, and finished ones whose results are being stored."""
        return {run.composite_key for run in self.running.values()} | self.retirer.held_executions()

    def holds(self, job_id: str) -> bool:
        """Whether the job is this worker's: running, or its result being stored."""
        return job_id in self.running or self.retirer.holds(job_id)

    def mine(self) -> set[str]:
        """What no recovery scan may take from this worker: its executions and the ids it may have started."""
        return self.held_executions() | self.intake.limbo_ids()

    def stop_job(self, job_id: str, execution_id: str = "") -> None:
        """An `rq` stop command (any thread): the job is stopped at the next iteration."""
        self.watch.stop_command(job_id, execution_id)

    # ---- one iteration -------------------------------------------------------------------------------------------

    def iterate(self, taking: bool, block_s: float = 0.0) -> Iterated:
        """One iteration. `taking`: jobs may be taken (not draining, not suspended); `block_s`: how long an idle
        worker may wait on the queues."""
        self._reconcile = False
        took = (self.guard.run("intake", self._take, block_s) or 0) if taking else 0
        if self.engine.has_unfinished():
            self.guard.run("checks", self.watch.before_step, self.running)  # answered while the model runs
            self._step()
        if self.watch.due(self.running, self.engine.has_unfinished()):  # before any retirement
            self.guard.run("checks", self._check)
        if self.retirer.busy:  # results sent earlier: collect Redis's replies, send the next round
            self.guard.run("retire", self._advance_retirer)
        self.guard.run("stops", self._stop_commanded)
        if self.running:
            self.guard.run("retire", self._retire)
        if self.tenants.pending:
            self.guard.run("fair share", self.tenants.flush, self.rq.connection, time.monotonic())
        if not self.busy and not self.intake.limbo_ids():
            self.guard.run("state", self.rq.sync_state, False)  # busy since the first start (rq_store)
        self._publish()
        return Iterated(took, self._reconcile)

    def wind_down(self) -> list[Running]:
        """At shutdown: apply stop commands, store what finished (waiting for Redis), and let go of the jobs still
        running, returned in start order for the caller to requeue."""
        self.guard.run("stops", self._stop_commanded)
        if self.running:
            self.watch.check_all()
            self.guard.run("checks", self._check)
            self.guard.run("retire", self._retire)
        self._retired(self.retirer.drain())
        if any(run.phase is Phase.FINISHED for run in self.running.values()):
            # a full Redis refused them: one more try, once it may have room
            time.sleep(max(0.0, self._full_until - time.monotonic()))
            self._full_until = 0.0
            self.guard.run("retire", self._retire)
        if owed(self.running.values()):  # handed back: checked, one more try
            self.guard.run("checks", self._check)
            self.guard.run("retire", self._retire)
        left = sorted(self.running.values(), key=lambda r: r.started_mono)
        for run in left:
            self._let_go(run)
        self.guard.run("fair share", self.tenants.flush, self.rq.connection)
        self._publish()
        return left

    # ---- take ----------------------------------------------------------------------------------------------------

    def room(self) -> int:
        """How many more jobs the engine can take now: what its free KV blocks admit (`num_admittable`). A worker
        whose memory is full leaves the jobs to others."""
        return int(self.engine.num_admittable())

    def _take(self, block_s: float) -> int:
        lengths = self.watch.queue_lengths()
        idle = not self.running and not self.engine.has_unfinished()
        runs = self.intake.take(self.room(), lengths, block_s if idle else 0.0)
        for run in runs:
            self._admit(run)
        return len(runs)

    def _admit(self, run: Running) -> None:
        stale = self.running.get(run.id)
        if stale is not None:  # requeued behind our back (we were taken for dead) and dequeued by us again
            self._let_go(stale)
        refusal = self.admission.admit(run)
        if refusal is None:
            run.phase = Phase.GENERATING
            self.running[run.id] = run
        elif refusal.deadline:
            self._fail_deadline(run, "before this attempt started", started=False)
        else:
            self._fail(run, refusal.message, retry=refusal.retry, callbacks=refusal.callbacks)

    # ---- step ----------------------------------------------------------------------------------------------------

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; looking for the job(s) that cause it")
            outputs = self._isolate()
        step_s, now = time.perf_counter() - t0, time.time()
        read = self.step_outputs.read(outputs, self.running, now)
        for ended in read.ended:
            ended.run.phase = Phase.FINISHED  # out of the engine: its result built, or it fails
            if ended.failure is not None:
                self._fail(ended.run, ended.failure, retry=ended.retry)
        self.metrics.on_step(self.engine, step_s, read.tokens, read.steady, now)

    def _isolate(self) -> list[Any]:
        """Fail only the jobs whose presence makes the step raise (rose.worker.isolate); RQ Retry applies."""
        in_engine = [run for run in self.running.values() if run.phase is Phase.GENERATING]
        # newest first: a fresh admission is the likeliest culprit; jobs with tokens passed earlier steps
        fresh = [run.id for run in reversed(in_engine) if not run.num_tokens]
        found = isolate(
            self.engine.step,
            fresh,
            self.engine.abort,
            lambda rid: self.admission.add_to_engine(self.running[rid]),
        )
        failed = dict(found.culprits)
        if found.error is not None:  # not the fresh jobs: the others (or the engine) fail, as step errors did
            log.error("engine step fails without the %d newest jobs; failing the others", len(fresh))
            failed.update((run.id, found.error) for run in in_engine if run.id not in fresh)
        for rid, error in failed.items():
            self._fail(self.running[rid], f"engine error: {error!r}")
        return found.outputs

    # ---- watch ---------------------------------------------------------------------------------------------------

    def _check(self) -> None:
        checked = self.watch.check(self.running)
        for finding in checked.findings:
            self._apply(finding)
        # only now: a Redis error above leaves the check owed
        for run in checked.checked:
            if self.running.get(run.id) is run and run.phase in CHECKED_PHASE:
                run.phase = CHECKED_PHASE[run.phase]

    def _stop_commanded(self) -> None:
        """`rq`'s stop commands, before any retirement; a stop hit by a Redis error is tried again."""
        for finding in self.watch.stops(self.running):
            self._apply(finding)
        for run in [run for run in self.running.values() if run.phase is Phase.STOPPING]:
            self.endings.stop(run)  # the job is let go once Redis has it stopped
            self._let_go(run)

    def _apply(self, finding: Finding) -> None:
        run = finding.run
        if self.running.get(run.id) is not run:
            return
        verdict = finding.verdict
        if verdict in (Verdict.DELETED, Verdict.CANCELED):
            reason = "stopped" if finding.detail == rq_store.STOPPED else verdict.value
            self.endings.cancel(run, reason)  # the job is let go once Redis has it: else checked again
            self._let_go(run)
        elif verdict is Verdict.FAILED:
            self.endings.failed_elsewhere(run)
            self._let_go(run)
        elif verdict is Verdict.STORED:  # our retirement reached Redis but its reply was lost
            self._let_go(run, forget=False)
            try:  # its done event, after a stream waiting for a full Redis starts over
                self.endings.stored(run)
            finally:
                self.outbox.forget(run)
        elif verdict is Verdict.LOST:  # requeued by another worker that took us for dead (a long outage)
            log.warning("job %s is now %s; dropping our copy", run.id, finding.detail)
            self._let_go(run)
        elif verdict is Verdict.TIMED_OUT:
            message = f"Job exceeded maximum timeout value ({run.timeout} seconds)"
            self._fail(run, message, exc_class=RoseJobTimeout)
        elif verdict is Verdict.DEADLINE:
            self._fail_deadline(run, "while it ran (rose-worker --deadline-policy abort)", started=True)
        elif verdict is Verdict.STOP:
            self._leave_engine(run)
            run.phase = Phase.STOPPING  # stored as stopped by `_stop_commanded`

    # ---- retire --------------------------------------------------------------------------------------------------

    def _retire(self) -> None:
        """Finished jobs to the retirer in one batch; those checked for RQ's handler stored here, one by one."""
        phases = (Phase.FINISHED, Phase.STORING, Phase.CALLED_BACK)
        finished = [run for run in self.running.values() if run.phase in phases]
        if not finished:
            return
        self._publish()  # their last token events go out (and the replies in so far are read)
        faults.point("events_sent")
        if not self.engine.has_unfinished():  # no step to overlap the round trip with
            self.outbox.wait(DELIVERY_WAIT_S)
            self._publish()
        # One batch in flight at a time, at most every RETIRE_EVERY_S while the engine runs: each costs Redis two
        # round trips, whatever the number of jobs in it, and a finished job's KV blocks are free already.
        now = time.monotonic()
        # a batch a full Redis refused waits RETRY_FULL_S; with nothing to step, the loop sleeps rather than spins
        if now < self._full_until and not self.engine.has_unfinished():
            time.sleep(self._full_until - now)
            now = time.monotonic()
        batching = now >= self._full_until and (
            not self.engine.has_unfinished() or (not self.retirer.busy and now >= self._next_retire)
        )
        batch: list[Running] = []
        for run in finished:
            if run.phase is Phase.FINISHED and not self.outbox.delivered(run):
                continue  # stored once Redis has its tokens: a later iteration
            if run.phase is Phase.FINISHED:
                if run.job.success_callback:
                    run.phase = Phase.CHECKING  # its status is read before the callback runs
                elif batching:
                    batch.append(run)
            else:
                self._store_by_handler(run)
        if batch:
            self._next_retire = now + RETIRE_EVERY_S
        for run in batch:
            self.running.pop(run.id)
            run.phase = Phase.RETIRING
        self._retired(self.retirer.submit(batch))
        if not self.engine.has_unfinished():
            self._retired(self.retirer.drain())  # no step to overlap the round trips with

    def _store_by_handler(self, run: Running) -> None:
        if run.phase is Phase.STORING and run.job.success_callback:
            error = self.endings.run_success_callback(run)
            if error is not None:  # RQ: a failing success callback fails the job
                self._fail(run, f"success callback failed: {error!r}", retry=True)
                return
            run.phase = Phase.CALLED_BACK
        try:
            self.endings.succeed(run)
        except REDIS_ERRORS:
            run.phase = STORE_RETRY_PHASE[run.phase]  # stored meanwhile? canceled? read again before retrying
            raise
        self._let_go(run)

    def _advance_retirer(self) -> None:
        self._retired(self.retirer.advance(wait=not self.engine.has_unfinished()))

    def _retired(self, retired: Retired) -> None:
        for run in retired.stored:
            self.endings.stored(run, announced=True)
        for run in retired.full:  # refused for memory, nothing written: retired again in a while
            run.phase = Phase.FINISHED
            self.running[run.id] = run
        if retired.full:
            self._full_until = time.monotonic() + RETRY_FULL_S
        # handed back: the loop checks them, then stores what is still ours by RQ's handler
        for run in retired.handed_back:
            run.phase = Phase.CHECKING
            self.running[run.id] = run

    # ---- letting jobs go -----------------------------------------------------------------------------------------

    def _leave_engine(self, run: Running) -> None:
        if run.phase is Phase.GENERATING:
            try:
                self.engine.abort(run.id)
            except Exception:  # the request may already be gone from a broken engine
                log.debug("engine.abort(%s) failed", run.id, exc_info=True)

    def _let_go(self, run: Running, forget: bool = True) -> None:
        """The job is no longer this worker's to run (it ended, or someone else has it). `forget`: drop its held
        tokens (its end, if any, was queued: it released them)."""
        if self.running.get(run.id) is run:
            del self.running[run.id]
        self._leave_engine(run)
        if forget:
            self.outbox.forget(run)
        self.tenants.release(run.id)
        rq_store.release(self.rq, run.execution)  # RQ 3's in-memory `worker.executions`

    def _fail(self, run: Running, message: str, retry: bool = True, **kwargs: Any) -> None:
        """Fail the job. It is let go first, and the failure is written through the guard: if Redis is down the job
        is out of the engine all the same, and recovery requeues it later (it runs, and fails, again). Its held
        tokens go out before its error event, or are dropped if RQ retries it (rose.worker.endings)."""
        self._let_go(run, forget=False)
        try:
            self.guard.run(
                "failure", functools.partial(self.endings.fail, run, message, retry=retry, **kwargs)
            )
        finally:
            self.outbox.forget(run)  # the failure not written (Redis down, full): nothing of it stays here

    def _fail_deadline(self, run: Running, when: str, started: bool) -> None:
        assert run.request is not None and run.request.deadline is not None
        self.metrics.on_deadline_exceeded(started)
        message = contract.deadline_exceeded(run.request.deadline, when)
        self._fail(run, message, retry=False, exc_class=DeadlineExceeded)

    # ---- publish -------------------------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Hand the queued events to the publisher and act on what Redis's replies so far say (`Outbox.publish`):
        streams started over before any of their jobs is stored; the worker reconciles after a refusal or a loss."""
        self._reconcile |= self.outbox.publish(self.running, self.retirer.runs)
