"""RoseWorker: the loop that feeds many RQ jobs at once into a continuous-batching engine.

One thread owns the engine and the running jobs (`running`: job id -> rose.worker.running.Running, whose phase only
this module changes). Each iteration reads top to bottom:

    take     jobs while the engine has room (rose.worker.intake; blocking on the queues only when idle)
    step     the engine; each job's tokens queued as events (rose.worker.outbox)
    watch    cancels, deletions, lost jobs, timeouts, stop commands (rose.worker.watch: findings applied here)
    retire   finished jobs: batched by the retirer (rose.worker.retirer), or by RQ's handler once checked
    publish  the iteration's events (rose.worker.publisher: sent at once, acknowledged at the next send)

On a busy loop nothing waits for a Redis round trip: the probe and the retirer's rounds are sent before a step and
read after it. Heartbeats, orphan recovery (rose.worker.recovery) and RQ's maintenance run on timers. What RQ sees
of the worker (registration, state, executions, commands, scheduler) is an RQ 3 worker it holds
(rose.worker.rq_worker); every write into RQ's data goes through rose.worker.rq_store.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any

import redis
from rq.worker import WorkerStatus

from rose import __version__
from rose.config import WorkerSettings
from rose.jobs import keys
from rose.worker import intake, metrics, probe, recovery, rq_store
from rose.worker.endings import Endings, RoseJobTimeout, result_dict
from rose.worker.intake import Intake
from rose.worker.isolate import isolate
from rose.worker.outbox import Outbox
from rose.worker.publisher import Publisher
from rose.worker.retirer import Retired, Retirer
from rose.worker.rq_worker import Command, RQWorker
from rose.worker.running import CHECKED_PHASE, STORE_RETRY_PHASE, Phase, Running
from rose.worker.watch import Finding, Verdict, Watch, owed

log = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
IDLE_BLOCK_S = 1  # longest blocking dequeue: bounds how late a signal, heartbeat or recovery scan can be


class NameInUse(RuntimeError):
    pass


class RoseWorker:
    """`RoseWorker(["rose"], engine=engine, connection=r, settings=WorkerSettings(...)).work()`."""

    def __init__(
        self,
        queues: Any,
        *,
        engine: Any,
        connection: redis.Redis,
        settings: WorkerSettings | None = None,
        name: str | None = None,
        **rq_kwargs: Any,
    ):
        self.settings = settings or WorkerSettings()
        name = name or self.settings.name
        if name and recovery.name_in_use(connection, name, self.settings.heartbeat_timeout):
            raise NameInUse(f"a live worker named {name!r} is already running; give this one another --name")
        rq_kwargs.setdefault("worker_ttl", self.settings.heartbeat_timeout)
        self.rq = RQWorker(
            queues,
            name=name,
            connection=connection,
            on_command=self._command,
            socket_timeout=IDLE_BLOCK_S + 9,
            **rq_kwargs,
        )
        self.engine = engine
        self.running: dict[str, Running] = {}
        self.metrics = metrics.for_worker(self)
        self.outbox = Outbox(Publisher(self.connection), self.rq.default_result_ttl)
        self.endings = Endings(self.rq, self.outbox, self.metrics)
        self.intake = Intake(self.rq)
        target = probe.Target(self.connection, self.name, tuple(q.key for q in self.rq.queues))
        self.watch = Watch(target, self.settings.check_interval)
        self.retirer = Retirer(self.rq)
        self._intermediate = recovery.IntermediateWatch()
        self._drain_deadline: float | None = None
        self._force_stop = False
        self._suspended = False
        self._redis_down_until = 0.0
        self._redis_backoff = 0.5
        self._next_heartbeat = 0.0
        self._next_recovery = 0.0
        self.started_at = time.time()
        self.metrics_server: metrics.HealthServer | None = None
        self.loop_beat = time.monotonic()  # each loop iteration: /health's liveness
        self.redis_ok = True  # the last Redis-touching stage worked: /health's readiness
        self.started = False  # registered and serving (the loop runs)
        self.stopped = False

    # ---- what the worker is ------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.rq.name

    @property
    def connection(self) -> redis.Redis:
        return self.rq.connection

    def queue_names(self) -> list[str]:
        return self.rq.queue_names()

    @property
    def completed(self) -> int:
        return self.endings.completed

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def held_executions(self) -> set[str]:
        """The executions this process holds: running jobs, and finished ones whose results are being stored."""
        return {run.composite_key for run in self.running.values()} | self.retirer.held_executions()

    def serve_metrics(self) -> None:
        """Start the /metrics + /health server (--metrics-port), once. Raises OSError if the port is taken."""
        if self.metrics_server is None:
            self.metrics_server = metrics.serve(self)

    # ---- start, run, stop ----------------------------------------------------------------------------------------

    def work(
        self, burst: bool = False, max_idle_time: int | None = None, with_scheduler: bool | None = None
    ) -> bool:
        """Run until a signal (or, with burst=True, until the queues are empty and nothing runs).

        with_scheduler (default: --with-scheduler): also run RQ's scheduler for these queues, as `rq worker
        --with-scheduler` does, so scheduled jobs (`enqueue_in`/`enqueue_at`) and `Retry(interval=...)` run.
        """
        main = threading.current_thread() is threading.main_thread()
        self.rq.choose_death_penalty(main_thread=main)
        if main:
            signal.signal(signal.SIGINT, self.request_stop)
            signal.signal(signal.SIGTERM, self.request_stop)
        self.serve_metrics()
        self._startup()
        if self.settings.with_scheduler if with_scheduler is None else with_scheduler:
            # RQ's own scheduler process (one per queue set across all workers, by Redis lock); maintenance
            # restarts it if it dies and another worker does not hold the lock.
            self.rq.start_scheduler(burst, logging_level=self.settings.log_level)
        idle_since = time.monotonic()
        try:
            while not self._should_exit():
                took = self._iteration(block=not burst)
                if self.running or took:
                    idle_since = time.monotonic()
                    continue
                if burst and not self.engine.has_unfinished() and not any(self._queue_lengths()):
                    break
                if max_idle_time is not None and time.monotonic() - idle_since > max_idle_time:
                    break
        finally:
            self._shutdown()
        return self.completed > 0

    def request_stop(self, signum: int, frame: Any) -> None:
        """First signal: stop taking jobs and drain; second: stop waiting. Never raises (unlike RQ's)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.settings.drain_timeout
            self.rq.shutdown_requested()
            log.warning(
                "signal %s: draining %d running jobs (up to %.0f s); signal again to stop now",
                signum,
                len(self.running),
                self.settings.drain_timeout,
            )
        else:
            self._force_stop = True
            log.warning("signal %s again: requeueing running jobs and stopping now", signum)

    def _command(self, command: Command) -> None:
        """RQ's worker commands (pub/sub thread): stops go to the watch, read by the loop."""
        kind, job_id, execution_id = command
        if kind in ("stop-job", "stop-execution"):
            self.watch.stop_command(job_id, execution_id)
        elif kind == "shutdown":
            self.request_stop(signal.SIGTERM, None)
        else:
            log.info("ignoring worker command %r", kind)

    def _startup(self) -> None:
        self.rq.start()
        self._recover()  # jobs our predecessor held (same name) are orphans now: requeued before anything else
        self._next_recovery = time.monotonic() + self.settings.recovery_interval
        log.info(
            "worker %s: serving %s with %s (max %d jobs at once)",
            self.name,
            ", ".join(self.queue_names()),
            getattr(self.engine, "model_name", type(self.engine).__name__),
            self._max_jobs(),
        )
        self.started = True

    def _should_exit(self) -> bool:
        if self._drain_deadline is None:
            return False
        if self._force_stop or time.monotonic() >= self._drain_deadline:
            return True
        return not self.running and not self.retirer.busy

    def _shutdown(self) -> None:
        """Store what finished, requeue what still runs at the front of its queue (start order kept), unregister."""
        try:
            self._redis("stops", self._stop_commanded)
            if self.running:
                self._redis("checks", self._check)
                self._redis("retire", self._retire)
            self._retired(self.retirer.drain())
            if owed(self.running.values()):  # handed back: checked, one more try
                self._redis("checks", self._check)
                self._redis("retire", self._retire)
            left = sorted(self.running.values(), key=lambda r: r.started_mono)
            for run in left:
                self._let_go(run)
            if left:
                self._requeue_on_exit(left)
            self.outbox.flush()
            self.outbox.publisher.close(timeout=10)
        finally:
            with contextlib.suppress(_REDIS_ERRORS):  # it lapses on its own
                self.connection.delete(keys.worker_info_key(self.name))
            self.rq.stop()
            self.stopped = True
            if self.metrics_server is not None:
                self.metrics_server.close()
            log.info("worker %s: stopped (%d jobs completed)", self.name, self.completed)

    def _requeue_on_exit(self, runs: list[Running]) -> None:
        delay = 0.5
        for attempt in range(5):
            try:
                with self.connection.pipeline() as pipe:
                    for run in reversed(runs):  # LPUSH in reverse: the first started ends up first
                        rq_store.requeue_started(
                            pipe, run.job, run.queue, run.composite_key, self.name, at_front=True
                        )
                    self.rq.sync_state(busy=False, pipe=pipe)
                    pipe.execute()
                for run in runs:
                    self.endings.requeued(run, "shutdown")
                log.warning("requeued %d unfinished jobs at the front of their queues", len(runs))
                return
            except _REDIS_ERRORS as exc:
                log.error("could not requeue %d jobs (%s), attempt %d", len(runs), exc, attempt + 1)
                time.sleep(delay)
                delay *= 2
        log.error("gave up requeueing; live workers will requeue them once this worker's heartbeat lapses")

    # ---- one iteration -------------------------------------------------------------------------------------------

    def _iteration(self, block: bool) -> int:
        self.loop_beat = time.monotonic()
        self._timers()
        took = self._take_stage(block)
        if self.engine.has_unfinished():
            self._redis("checks", self.watch.before_step, self.running)  # answered while the model runs
            self._step()
        if self.watch.due(self.running, self.engine.has_unfinished()):  # before any retirement
            self._redis("checks", self._check)
        if self.engine.has_unfinished() and self._wants_jobs() and self._room() > 0:
            self._redis("checks", self.watch.ask_lengths)  # ahead of the retirement's writes: answered first
        if self.retirer.busy:  # results sent earlier: collect Redis's replies, send the next round
            self._redis("retire", self._advance_retirer)
        self._redis("stops", self._stop_commanded)
        if self.running:
            self._redis("retire", self._retire)
        if not self.running and not self.retirer.busy and not self.intake.limbo_ids():
            self._redis("state", self.rq.sync_state, False)  # busy since the first start (rq_store)
        self.outbox.flush()
        if time.monotonic() < self._redis_down_until and not self.engine.has_unfinished():
            time.sleep(min(0.5, self._redis_down_until - time.monotonic()))
        return took

    def _redis(self, stage: str, fn: Any, *args: Any) -> Any:
        """Run a Redis-touching stage; while Redis is unreachable, back off and keep stepping the engine."""
        if time.monotonic() < self._redis_down_until:
            return None
        try:
            result = fn(*args)
        except _REDIS_ERRORS as exc:
            self.redis_ok = False
            log.error("Redis unreachable during %s (%s); retrying in %.1f s", stage, exc, self._redis_backoff)
            self._redis_down_until = time.monotonic() + self._redis_backoff
            self._redis_backoff = min(self._redis_backoff * 2, 30.0)
            return None
        self._redis_backoff = 0.5
        self.redis_ok = True
        return result

    def _timers(self) -> None:
        t = time.monotonic()
        if t >= self._next_heartbeat and self._redis("heartbeat", self._heartbeat) is not None:
            self._next_heartbeat = t + self.settings.heartbeat_interval
        if t >= self._next_recovery and not self.draining:
            self._redis("recovery", self._recover)
            self._next_recovery = t + self.settings.recovery_interval
        if self.rq.should_run_maintenance_tasks and not self.draining:
            self._redis("maintenance", self.rq.run_maintenance_tasks)

    # ---- take ----------------------------------------------------------------------------------------------------

    def _wants_jobs(self) -> bool:
        return not self.draining and not self._suspended

    def _max_jobs(self) -> int:
        return int(getattr(self.engine, "max_num_seqs", 1))

    def _room(self) -> int:
        return self._max_jobs() - int(self.engine.num_running) - int(self.engine.num_waiting)

    def _take_stage(self, block: bool) -> int:
        if not self.running and not self.draining:
            # Idle: `rq suspend` / `rq resume` are noticed within a second (busy: at each heartbeat).
            self._redis("suspension", self._check_suspension)
        if not self._wants_jobs():
            self.watch.abandon_lengths()
            if self._suspended and not self.running:
                time.sleep(IDLE_BLOCK_S)
            return 0
        return self._redis("intake", self._take, block) or 0

    def _take(self, block: bool) -> int:
        lengths = self.watch.queue_lengths()
        idle = not self.running and not self.engine.has_unfinished()
        runs = self.intake.take(self._room(), lengths, IDLE_BLOCK_S if block and idle else 0.0)
        for run in runs:
            self._admit(run)
        return len(runs)

    def _admit(self, run: Running) -> None:
        stale = self.running.get(run.id)
        if stale is not None:  # requeued behind our back (we were taken for dead) and dequeued by us again
            self._let_go(stale)
        self.endings.taken(run)
        request = intake.parse(
            run.job, run.queue.name, self.queue_names(), self.settings.trust_request_chat_template
        )
        if isinstance(request, str):
            self._fail(run, request, retry=False, callbacks=intake.may_run_callbacks(run.job))
            return
        run.request = request
        try:
            self._add_to_engine(run)
        except ValueError as exc:  # prompt too long for the context, text prompt without tokenizer, ...
            self._fail(run, str(exc), retry=False)
            return
        except Exception as exc:
            log.exception("engine refused job %s", run.id)
            self._fail(run, f"engine error while adding the job: {exc!r}")
            return
        run.phase = Phase.GENERATING
        self.running[run.id] = run

    def _add_to_engine(self, run: Running) -> None:
        request = run.request
        assert request is not None
        self.engine.add_request(
            run.id,
            request.engine_prompt(self.engine.tokenizer),
            request.to_sampling_params(),
            priority=request.priority,
        )

    # ---- step ----------------------------------------------------------------------------------------------------

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; looking for the job(s) that cause it")
            outputs = self._isolate()
        step_s, now = time.perf_counter() - t0, time.time()
        tokens = steady = 0  # tokens generated; those of them by jobs that already had one (for the ITL)
        for out in outputs:
            run = self.running.get(out.request_id)
            if run is None or run.phase is not Phase.GENERATING:
                continue
            if out.new_token_ids or out.new_text:
                n = len(out.new_token_ids)
                tokens += n
                if run.token_ids:
                    steady += n
                elif n:
                    self.endings.first_token(run, now)
                run.text.append(out.new_text)
                run.token_ids.extend(out.new_token_ids)
                self.outbox.token(run, out.new_text, list(out.new_token_ids))
            if out.finished:
                run.phase = Phase.FINISHED  # out of the engine
                if out.finish_reason == "error":  # the request could not run (its grammar failed to compile)
                    # deterministic (a grammar that will not compile): RQ's Retry would fail the same way
                    self._redis("engine failure", self._fail, run, out.output.error or "engine error", False)
                    continue
                run.output = out.output
                run.result = result_dict(run, self.name)
        self.metrics.on_step(self.engine, step_s, tokens, steady, now)

    def _isolate(self) -> list[Any]:
        """Fail only the jobs whose presence makes the step raise (rose.worker.isolate); RQ Retry applies."""
        in_engine = [run for run in self.running.values() if run.phase is Phase.GENERATING]
        # newest first: a fresh admission is the likeliest culprit; jobs with tokens passed earlier steps
        fresh = [run.id for run in reversed(in_engine) if not run.token_ids]
        found = isolate(
            self.engine.step, fresh, self.engine.abort, lambda rid: self._add_to_engine(self.running[rid])
        )
        failed = dict(found.culprits)
        if found.error is not None:  # not the fresh jobs: the others (or the engine) fail, as step errors did
            log.error("engine step fails without the %d newest jobs; failing the others", len(fresh))
            failed.update((run.id, found.error) for run in in_engine if run.id not in fresh)
        for rid, error in failed.items():
            # out of the engine even if Redis is down now (recovery requeues the job then)
            self._redis("engine failure", self._fail, self.running[rid], f"engine error: {error!r}")
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
            self.endings.cancel(run, verdict.value)  # the job is let go once Redis has it: else checked again
            self._let_go(run)
        elif verdict is Verdict.STORED:  # our retirement reached Redis but its reply was lost
            self._let_go(run)
            self.endings.stored(run)
        elif verdict is Verdict.LOST:  # requeued by another worker that took us for dead (a long outage)
            log.warning("job %s is now %s; dropping our copy", run.id, finding.detail)
            self._let_go(run)
        elif verdict is Verdict.TIMED_OUT:
            message = f"Job exceeded maximum timeout value ({run.timeout} seconds)"
            self._fail(run, message, exc_class=RoseJobTimeout)
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
        self.outbox.flush()  # their last token events reach the publisher before their `done` events
        batch: list[Running] = []
        for run in finished:
            if run.phase is Phase.FINISHED:
                if run.job.success_callback:
                    run.phase = Phase.CHECKING  # its status is read before the callback runs
                else:
                    batch.append(run)
            else:
                self._store_by_handler(run)
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
        except _REDIS_ERRORS:
            run.phase = STORE_RETRY_PHASE[run.phase]  # stored meanwhile? canceled? read again before retrying
            raise
        self._let_go(run)

    def _advance_retirer(self) -> None:
        self._retired(self.retirer.advance(wait=not self.engine.has_unfinished()))

    def _retired(self, retired: Retired) -> None:
        for run in retired.stored:
            self.endings.stored(run)
        for (
            run
        ) in retired.handed_back:  # the loop checks them, then stores what is still ours by RQ's handler
            run.phase = Phase.CHECKING
            self.running[run.id] = run

    # ---- letting jobs go -----------------------------------------------------------------------------------------

    def _leave_engine(self, run: Running) -> None:
        if run.phase is Phase.GENERATING:
            try:
                self.engine.abort(run.id)
            except Exception:  # the request may already be gone from a broken engine
                log.debug("engine.abort(%s) failed", run.id, exc_info=True)

    def _let_go(self, run: Running) -> None:
        """The job is no longer this worker's to run (it ended, or someone else has it)."""
        if self.running.get(run.id) is run:
            del self.running[run.id]
        self._leave_engine(run)
        rq_store.release(self.rq, run.execution)  # RQ 3's in-memory `worker.executions`

    def _fail(self, run: Running, message: str, retry: bool = True, **kwargs: Any) -> None:
        """Fail the job, let go first: out of the engine even if Redis is down (recovery requeues it then)."""
        self._let_go(run)
        self.endings.fail(run, message, retry=retry, **kwargs)

    # ---- timers --------------------------------------------------------------------------------------------------

    def _recover(self) -> None:
        mine = self.held_executions() | self.intake.limbo_ids()
        found = recovery.recover(self.rq, self._intermediate, mine, self.settings.max_requeues)
        self.metrics.requeued.inc(found.requeued)
        for poison in found.poison:
            self.endings.fail_orphan(poison.run, poison.owner, poison.requeues)
        self.outbox.flush()

    def _check_suspension(self) -> None:
        suspended = self.rq.check_suspended()
        if suspended != self._suspended:
            log.warning(
                "worker %s: %s",
                self.name,
                "suspended (rq suspend): taking no new jobs" if suspended else "resumed",
            )
        self._suspended = suspended

    def _queue_lengths(self) -> list[int]:
        return rq_store.queue_lengths(self.connection, self.rq.queues)

    def _heartbeat(self) -> bool:
        busy = self.running or self.retirer.busy
        state = (
            WorkerStatus.SUSPENDED if self._suspended else WorkerStatus.BUSY if busy else WorkerStatus.IDLE
        )
        with self.connection.pipeline(transaction=False) as pipe:
            rq_store.heartbeat(pipe, self.rq, self.running.values(), state)  # reply 1: the key had lapsed
            pipe.hset(keys.worker_info_key(self.name), mapping=self._info())
            pipe.expire(keys.worker_info_key(self.name), self.rq.worker_ttl)
            replies = pipe.execute()
        if replies[0] == 1:
            # Our key had lapsed (Redis outage longer than the heartbeat timeout): register again.
            log.warning("worker %s: registration had expired; registering again", self.name)
            with self.connection.pipeline() as pipe:
                rq_store.reregister(pipe, self.rq, self.held_executions())
                pipe.execute()
        self._check_suspension()
        return True

    def _info(self) -> dict[str, Any]:
        """The worker's `rose:worker:<name>` hash (`rose status`)."""
        e = self.engine
        self.metrics.gauges(e)  # also when no step ran since the last jobs ended (e.g. canceled)
        info = {
            "model": str(getattr(e, "model_name", "")),
            "device": str(getattr(e, "device", "")),
            "dtype": metrics.dtype_name(e),
            "max_num_seqs": self._max_jobs(),
            "running_jobs": len(self.running),
            "updated_at": time.time(),
            "started_at": self.started_at,
            "tokens_per_s": round(self.metrics.rate(), 3),
            "queues": ",".join(self.queue_names()),
            "version": __version__,
        }
        for attr in ("max_model_len", "num_running", "num_waiting", "kv_slots_used", "kv_slots_total"):
            value = getattr(e, attr, None)
            if value is not None:
                info[attr] = int(value)
        return info
