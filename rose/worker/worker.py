"""RoseWorker: a real RQ worker (registered, heartbeating, using RQ's handlers) whose loop feeds many jobs at once
into a continuous-batching engine.

One thread owns the engine and all job bookkeeping. Per iteration: take jobs while the engine has room (block on
the queues only when idle), step the engine, check cancels / stop commands / timeouts every `check_interval`
(rose.worker.checks), retire finished jobs (in batches, by pipelined rounds read a step later: rose.worker.retirer),
send the step's events (rose.worker.publisher: sent at once, acknowledged at the next send). On a busy loop nothing
waits for a Redis round trip.
Heartbeats, orphan recovery and RQ maintenance run on timers.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Any

import redis
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.timeouts import TimerDeathPenalty, UnixSignalDeathPenalty
from rq.worker import BaseWorker, WorkerStatus

from rose.config import WorkerSettings
from rose.worker import intake, metrics, probe, recovery, rq_store
from rose.worker.checks import Checks
from rose.worker.intake import Running
from rose.worker.isolate import isolate
from rose.worker.lifecycle import Lifecycle
from rose.worker.outcomes import Outcomes
from rose.worker.publisher import Outgoing, Publisher
from rose.worker.retirer import Retirer

log = logging.getLogger(__name__)

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
IDLE_BLOCK_S = 1  # longest blocking dequeue: bounds how late a signal, heartbeat or recovery scan can be


class NameInUse(RuntimeError):
    pass


class RoseWorker(Lifecycle, Checks, Outcomes, BaseWorker):
    """`RoseWorker(["rose"], engine=engine, connection=r, settings=WorkerSettings(...)).work()`."""

    def __init__(
        self,
        queues: Any,
        *,
        engine: Any,
        connection: redis.Redis,
        settings: WorkerSettings | None = None,
        name: str | None = None,
        **kwargs: Any,
    ):
        self.settings = settings or WorkerSettings()
        name = name or self.settings.name
        if name and recovery.name_in_use(connection, name, self.settings.heartbeat_timeout):
            raise NameInUse(f"a live worker named {name!r} is already running; give this one another --name")
        kwargs.setdefault("worker_ttl", self.settings.heartbeat_timeout)
        super().__init__(queues, name=name, connection=connection, serializer=JSONSerializer, **kwargs)
        # Every connection of this process carries the worker's name, so a restart can tell a live holder of
        # the name (connections open) from a killed one (connections closed by the kernel).
        self.connection.connection_pool.connection_kwargs["client_name"] = self.name
        self.engine = engine
        self.running: dict[str, Running] = {}
        self.publisher = Publisher(self.connection)
        self._outbox: list[Outgoing] = []
        self._retirer = Retirer(self)
        self._limbo: list[tuple[str, Any]] = []  # taken ids whose start may not have gone through
        self._stop_job_ids: collections.deque[str] = collections.deque()
        self._queue_lengths: list[int] | None = None  # as of the last probe, for the next intake
        self._probe = probe.InFlightProbe(self)
        self._lengths_probe = probe.InFlightProbe(
            self
        )  # queue lengths only: sent after a step, read at intake
        self._next_check = 0.0  # monotonic time the next probe is due (rose.worker.checks)
        self._check_forced = False  # a running job needs its status read before RQ's handler stores it
        self._drain_deadline: float | None = None
        self._force_stop = False
        self._suspended = False
        self._redis_down_until = 0.0
        self._redis_backoff = 0.5
        self._next_heartbeat = 0.0
        self._next_recovery = 0.0
        self._intermediate = recovery.IntermediateWatch()
        self.completed = 0
        self.started_at = time.time()
        self.metrics = metrics.for_worker(self)
        self.metrics_server: metrics.HealthServer | None = None
        self.loop_beat = time.monotonic()  # each loop iteration: /health's liveness
        self.redis_ok = True  # the last Redis-touching stage worked: /health's readiness
        self.started = False  # registered and serving (the loop runs)
        self.stopped = False

    def _set_ip_address(self, connection: redis.Redis) -> None:
        rq_store.set_ip_address(self, connection)

    @property
    def connection_timeout(self) -> int:
        # RQ sizes the socket timeout for its ~7-minute blocking dequeue; ours blocks IDLE_BLOCK_S at most, and a
        # stalled Redis must not freeze the engine loop for long.
        return IDLE_BLOCK_S + 9

    # ---- public helpers -------------------------------------------------------------------------------------

    def held_executions(self) -> set[str]:
        """The executions this process holds: running jobs, and finished ones whose results are being stored."""
        return {run.composite_key for run in self.running.values()} | self._retirer.held_executions()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    # ---- the loop ---------------------------------------------------------------------------------------------

    def work(  # type: ignore[override]
        self,
        burst: bool = False,
        max_idle_time: int | None = None,
        with_scheduler: bool | None = None,
        **_: Any,
    ) -> bool:
        """Run until a signal (or, with burst=True, until the queues are empty and nothing runs).

        with_scheduler (default: --with-scheduler): also run RQ's scheduler for these queues, as `rq worker
        --with-scheduler` does, so scheduled jobs (`enqueue_in`/`enqueue_at`) and `Retry(interval=...)` run.
        """
        if threading.current_thread() is not threading.main_thread():
            self.death_penalty_class = TimerDeathPenalty  # SIGALRM-based timeouts need the main thread
        else:
            self.death_penalty_class = UnixSignalDeathPenalty
        self._install_signal_handlers()
        self.serve_metrics()
        self._startup()
        if self.settings.with_scheduler if with_scheduler is None else with_scheduler:
            # RQ's own scheduler process (one per queue set across all workers, by Redis lock); maintenance
            # restarts it if it dies and another worker does not hold the lock.
            self._start_scheduler(burst, logging_level=self.settings.log_level)
        idle_since = time.monotonic()
        try:
            while not self._should_exit():
                took = self._iteration(block=not burst)
                if self.running or took:
                    idle_since = time.monotonic()
                    continue
                if burst and not self.engine.has_unfinished() and self._queues_empty():
                    break
                if max_idle_time is not None and time.monotonic() - idle_since > max_idle_time:
                    break
        finally:
            self._shutdown()
        return self.completed > 0

    def _check_suspension(self) -> None:
        suspended = bool(is_suspended(self.connection, self))
        if suspended != self._suspended:
            log.warning(
                "worker %s: %s",
                self.name,
                "suspended (rq suspend): taking no new jobs" if suspended else "resumed",
            )
            self.set_state(WorkerStatus.SUSPENDED if suspended else WorkerStatus.IDLE)
        self._suspended = suspended

    def _queues_empty(self) -> bool:
        with self.connection.pipeline(transaction=False) as pipe:
            for queue in self.queues:
                pipe.llen(queue.key)
            return not any(pipe.execute())

    def _should_exit(self) -> bool:
        if self._drain_deadline is None:
            return False
        if self._force_stop or time.monotonic() >= self._drain_deadline:
            return True
        return not self.running and not self._retirer.busy

    def _startup(self) -> None:
        key = self.key
        if self.connection.exists(key) and not self.connection.hexists(key, "death"):
            # Checked in __init__: nobody holds the name, this is the key of our killed predecessor.
            log.warning(
                "worker %s: previous run under this name died without unregistering; taking over", self.name
            )
            self.connection.delete(key)
        self.register_birth()
        self.heartbeat()
        self.subscribe()
        self.set_state(WorkerStatus.IDLE)
        # Jobs our predecessor held (same name) are orphans now: requeue them before anything else.
        recovery.recover(self, self._intermediate)
        self._flush_outbox()
        self._next_recovery = time.monotonic() + self.settings.recovery_interval
        log.info(
            "worker %s: serving %s with %s (max %d jobs at once)",
            self.name,
            ", ".join(self.queue_names()),
            getattr(self.engine, "model_name", type(self.engine).__name__),
            self._max_jobs(),
        )
        self.started = True

    def serve_metrics(self) -> None:
        """Start the /metrics + /health server (--metrics-port), once. Raises OSError if the port is taken."""
        if self.metrics_server is None:
            self.metrics_server = metrics.serve(self)

    def _max_jobs(self) -> int:
        return int(getattr(self.engine, "max_num_seqs", 1))

    def _iteration(self, block: bool) -> int:
        self.loop_beat = time.monotonic()
        self._timers()
        took = 0
        if not self.running and not self.draining:
            # Idle: `rq suspend` / `rq resume` are noticed within a second (busy: at each heartbeat).
            self._redis("suspension", self._check_suspension)
        if not self.draining and not self._suspended:
            took = self._redis("intake", self._intake, block)
        else:
            self._lengths_probe.abandon()  # no intake to read it
            if self._suspended and not self.running:
                time.sleep(IDLE_BLOCK_S)
        if self.engine.has_unfinished():
            self._redis("checks", self._send_checks)  # when due; answered while the model runs
            self._step()
        if self._checks_due():  # before any retirement: a canceled job is not stored as finished
            self._redis("checks", self._checks)
        if self.engine.has_unfinished():  # ahead of the retirement's writes, so that Redis answers it first
            self._redis("checks", self._ask_lengths)
        if self._retirer.busy:  # results sent earlier: collect Redis's replies, send the next round
            self._redis("retire", self._retirer.advance, not self.engine.has_unfinished())
        if self._stop_job_ids:
            self._redis("checks", self._apply_stops)
        if self.running:
            self._redis("retire", self._retire)
        if not self.running and not self._retirer.busy and not self._limbo:
            self._redis("state", rq_store.sync_state, self, False)  # busy since the first start (rq_store)
        self._flush_outbox()
        if time.monotonic() < self._redis_down_until and not self.engine.has_unfinished():
            time.sleep(min(0.5, self._redis_down_until - time.monotonic()))
        return took or 0

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
            self._redis("recovery", recovery.recover, self, self._intermediate)
            self._flush_outbox()
            self._next_recovery = t + self.settings.recovery_interval
        if self.should_run_maintenance_tasks and not self.draining:
            self._redis("maintenance", self.run_maintenance_tasks)

    def _intake(self, block: bool) -> int:
        # lengths known from the step's probe, or asked after the step, spare a round trip here
        lengths, self._queue_lengths = self._queue_lengths, None
        if self._lengths_probe.pending:  # asked after the step (rose.worker.checks)
            asked = self._lengths_probe.receive()[1]
            lengths = lengths if lengths is not None and any(lengths) else asked
        room = self._room()
        if room <= 0:
            return 0
        taken, self._limbo = self._limbo, []
        try:
            if taken:  # a start whose reply was lost last time
                runs = intake.adopt(self, taken)
            else:
                taken = intake.take(self, room, lengths)
                if not taken and block and not self.running and not self.engine.has_unfinished():
                    taken = intake.wait_for_one(self, IDLE_BLOCK_S)
                    if taken and room > 1:
                        taken += intake.take(self, room - 1)
                runs = intake.start(self, taken)
        except _REDIS_ERRORS:
            self._limbo = taken
            raise
        for run in runs:
            self._admit(run)
        return len(runs)

    def _room(self) -> int:
        return self._max_jobs() - int(self.engine.num_running) - int(self.engine.num_waiting)

    def _admit(self, run: Running) -> None:
        stale = self.running.get(run.id)
        if stale is not None:  # requeued behind our back (we were taken for dead) and dequeued by us again
            self._forget(stale)
        self._on_taken(run)
        if run.restarted:
            self._emit_reset(run)
        message = intake.validate(self, run)
        if message is not None:
            self._fail(run, message, retry=False, callbacks=intake.may_run_callbacks(run))
            return
        try:
            self._add_to_engine(run)
        except ValueError as exc:  # prompt too long for the context, text prompt without tokenizer, ...
            self._fail(run, str(exc), retry=False)
            return
        except Exception as exc:
            log.exception("engine refused job %s", run.id)
            self._fail(run, f"engine error while adding the job: {exc!r}")
            return
        run.in_engine = True
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
            if run is None:
                continue
            if out.new_token_ids or out.new_text:
                n = len(out.new_token_ids)
                tokens += n
                if run.token_ids:
                    steady += n
                elif n:
                    self._on_first_token(run, now)
                run.text.append(out.new_text)
                run.token_ids.extend(out.new_token_ids)
                self._emit_token(run, out.new_text, list(out.new_token_ids))
            if out.finished:
                run.in_engine = False
                if out.finish_reason == "error":  # the request could not run (its grammar failed to compile)
                    self.running.pop(run.id, None)
                    # deterministic (a grammar that will not compile): RQ's Retry would fail the same way
                    fail = functools.partial(self._fail, retry=False)
                    self._redis("engine failure", fail, run, out.output.error or "engine error")
                    continue
                run.output = out.output
        self.metrics.on_step(self.engine, step_s, tokens, steady, now)

    def _isolate(self) -> list[Any]:
        """Fail only the jobs whose presence makes the step raise (rose.worker.isolate); RQ Retry applies."""
        in_engine = [run for run in self.running.values() if run.in_engine]
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
            run = self.running[rid]
            self._forget(run)  # out of the engine even if Redis is down now (recovery requeues the job then)
            self._redis("engine failure", self._fail, run, f"engine error: {error!r}")
        return found.outputs

    def _retire(self) -> None:
        finished = [r for r in self.running.values() if r.output is not None]
        if not finished:
            return
        self._flush_outbox()  # their last token events reach the publisher before their `done` events
        batch = []
        for run in finished:
            if run.retire_inline:  # handed back by the retirer, or a success callback to run: RQ's handler
                if not run.needs_check:  # once checked (rose.worker.checks)
                    try:
                        self._succeed(run)
                    except _REDIS_ERRORS:
                        self._force_check([run])  # canceled meanwhile? read again before the next try
                        raise
            elif run.job.success_callback and not run.callback_done:
                run.retire_inline = True  # its status is checked first, then RQ's handler runs the callback
                self._force_check([run])
            else:
                self.running.pop(run.id, None)
                batch.append(run)
        self._retirer.submit(batch)
        if not self.engine.has_unfinished():
            self._retirer.drain()  # no step to overlap the round trips with

    def _flush_outbox(self) -> None:
        """Send the queued events (and collect the publisher's replies from Redis, or retry after an outage)."""
        if self._outbox:
            self.publisher.send(self._outbox)
            self._outbox = []
        else:
            self.publisher.poll()
