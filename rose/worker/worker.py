"""RoseWorker: the rose-worker daemon. It holds what RQ sees of it (an RQ 3 worker, rose.worker.rq_worker) and the job
loop (rose.worker.loop), and runs the loop until a signal, with heartbeats, orphan recovery (rose.worker.recovery)
and RQ's maintenance on timers, and a drain at the end: jobs that finish in time are stored, the others requeued at
the front of their queues.

Ownership: the job loop owns the running jobs; this class owns the lifecycle (rose.worker.lifecycle: one
`WorkerState`), the timers and the Redis guard every Redis-touching stage runs through; the RQ worker owns RQ's state
of the worker (registration, suspended / busy / idle, executions, scheduler).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
import types
from collections.abc import Mapping
from typing import Any

import redis
from rq.worker import WorkerStatus

from rose import __version__
from rose.config import WorkerSettings
from rose.jobs import keys
from rose.worker import metrics, recovery, rq_store, seal
from rose.worker.endings import Endings
from rose.worker.engine_protocol import WorkerEngine
from rose.worker.lifecycle import Lifecycle, WorkerState
from rose.worker.loop import JobLoop
from rose.worker.outbox import Outbox
from rose.worker.publisher import Publisher
from rose.worker.redis_guard import REDIS_ERRORS, RedisGuard
from rose.worker.rq_worker import Command, RQWorker
from rose.worker.running import Running

log = logging.getLogger(__name__)

IDLE_BLOCK_S = 1  # longest blocking dequeue: bounds how late a signal, heartbeat or recovery scan can be
FULL_RECONCILE_EVERY_S = 1.0  # while Redis is full (maxmemory), the most often the worker reconciles


class NameInUse(RuntimeError):
    pass


class RoseWorker:
    """`RoseWorker(["rose"], engine=engine, connection=r, settings=WorkerSettings(...)).work()`."""

    def __init__(
        self,
        queues: Any,
        *,
        engine: WorkerEngine,
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
        self.metrics = metrics.for_worker(self)
        self.guard = RedisGuard(self.connection)
        self.outbox = Outbox(
            Publisher(self.connection), self.rq.default_result_ttl, self.settings.stream_interval
        )
        self.endings = Endings(self.rq, self.outbox, self.metrics)
        self.jobs = JobLoop(
            engine, self.rq, self.settings, self.outbox, self.endings, self.guard, self.metrics
        )
        self._intermediate = recovery.IntermediateWatch()
        self._seals = seal.SealWatch()
        self.lifecycle = Lifecycle()
        self._next_heartbeat = 0.0
        self._next_recovery = 0.0
        self._reconciled_outages = 0  # the guard's outage count at the last reconciliation
        self._reconcile_owed = False  # an outage, or events refused or lost, not reconciled yet
        self._next_reconcile = 0.0  # while Redis is full: the next reconciliation, at the earliest
        self.started_at = time.time()
        self.metrics_server: metrics.HealthServer | None = None
        self.loop_beat = time.monotonic()  # each loop iteration: /health's liveness

    # ---- what the worker is ------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.rq.name

    @property
    def connection(self) -> redis.Redis:
        return self.rq.connection

    @property
    def running(self) -> Mapping[str, Running]:
        """The jobs being run, read-only (the job loop owns them)."""
        return types.MappingProxyType(self.jobs.running)

    def queue_names(self) -> list[str]:
        return self.rq.queue_names()

    @property
    def completed(self) -> int:
        return self.endings.completed

    @property
    def state(self) -> WorkerState:
        return self.lifecycle.state

    @property
    def started(self) -> bool:
        """The start-up is done: registered and serving (or draining since)."""
        return self.lifecycle.started

    @property
    def draining(self) -> bool:
        """Taking no new jobs, for good: a stop request came."""
        return self.lifecycle.draining

    @property
    def stopped(self) -> bool:
        return self.lifecycle.state is WorkerState.STOPPED

    @property
    def redis_ok(self) -> bool:
        """The last Redis-touching stage worked: /health's readiness."""
        return self.guard.ok

    def held_executions(self) -> set[str]:
        return self.jobs.held_executions()

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
                if burst and not self.engine.has_unfinished():
                    # through the guard: an idle worker must outlive a Redis outage like a busy one
                    lengths = self.guard.run(
                        "intake", rq_store.queue_lengths, self.connection, self.rq.queues
                    )
                    if lengths is not None and not any(lengths):
                        break
                if max_idle_time is not None and time.monotonic() - idle_since > max_idle_time:
                    break
        finally:
            self._shutdown()
        return self.completed > 0

    def request_stop(self, signum: int, frame: Any) -> None:
        """First signal: stop taking jobs and drain (DRAINING); second: stop waiting (STOPPING). Never raises
        (unlike RQ's)."""
        if self.lifecycle.request_stop(self.settings.drain_timeout):
            self.rq.shutdown_requested()
            log.warning(
                "signal %s: draining %d running jobs (up to %.0f s); signal again to stop now",
                signum,
                len(self.running),
                self.settings.drain_timeout,
            )
        else:
            log.warning("signal %s again: requeueing running jobs and stopping now", signum)

    def _command(self, command: Command) -> None:
        """RQ's worker commands (pub/sub thread)."""
        kind, job_id, execution_id = command
        if kind in ("stop-job", "stop-execution"):
            self.jobs.stop_job(job_id, execution_id)
        elif kind == "shutdown":
            self.request_stop(signal.SIGTERM, None)
        else:
            log.info("ignoring worker command %r", kind)

    def _startup(self) -> None:
        self.rq.start()
        self._recover(
            startup=True
        )  # our predecessor's (same name) jobs are orphans now: requeued before anything
        self._next_recovery = time.monotonic() + self.settings.recovery_interval
        log.info(
            "worker %s: serving %s with %s (max %d jobs at once), %s",
            self.name,
            ", ".join(self.queue_names()),
            self.engine.model_name,
            int(self.engine.max_num_seqs),
            _policy(self.settings),
        )
        parser = self.jobs.tool_parser  # rose.jobs.tools.resolve_parser
        how = (
            "no parser: such jobs fail (--tool-call-parser)"
            if parser is None
            else f"the {parser.name} parser"
        )
        if parser is not None and self.settings.tool_call_parser is None:
            how += " (the chat template's format)"
        log.info("worker %s: tool calls (tool_choice 'auto') read by %s", self.name, how)
        self.lifecycle.advance(WorkerState.RUNNING)  # a stop request meanwhile keeps it DRAINING

    def _should_exit(self) -> bool:
        return self.lifecycle.should_exit(busy=self.jobs.busy)

    def _shutdown(self) -> None:
        """Store what finished, requeue what still runs at the front of its queue (start order kept), unregister."""
        self.lifecycle.advance(WorkerState.STOPPING)
        try:
            left = self.jobs.wind_down()
            if left:
                self._requeue_on_exit(left)
            self.outbox.publisher.close(timeout=10)
        finally:
            with contextlib.suppress(*REDIS_ERRORS):  # it lapses on its own
                self.connection.delete(keys.worker_info_key(self.name))
            self.rq.stop()
            self.lifecycle.advance(WorkerState.STOPPED)
            if self.metrics_server is not None:
                self.metrics_server.close()
            log.info("worker %s: stopped (%d jobs completed)", self.name, self.completed)

    def _requeue_on_exit(self, runs: list[Running]) -> None:
        delay = 0.5
        for attempt in range(5):
            try:
                requeued = rq_store.requeue_ours(self.rq, runs)
                for run in requeued:
                    self.endings.requeued(run, "shutdown")
                log.warning("requeued %d unfinished jobs at the front of their queues", len(requeued))
                return
            except REDIS_ERRORS as exc:
                log.error("could not requeue %d jobs (%s), attempt %d", len(runs), exc, attempt + 1)
                time.sleep(delay)
                delay *= 2
        log.error("gave up requeueing; live workers will requeue them once this worker's heartbeat lapses")

    # ---- each iteration ------------------------------------------------------------------------------------------

    def _iteration(self, block: bool) -> int:
        self.loop_beat = time.monotonic()
        self._timers()
        if not self.running and not self.draining:
            # Idle: `rq suspend` / `rq resume` are noticed within a second (busy: at each heartbeat).
            self.guard.run("suspension", self._check_suspension)
        if self.rq.suspended and not self.running:
            time.sleep(IDLE_BLOCK_S)
        done = self.jobs.iterate(
            taking=not self.draining and not self.rq.suspended, block_s=IDLE_BLOCK_S if block else 0.0
        )
        self._reconcile_owed |= done.reconcile or (
            self.guard.ok and self.guard.outages != self._reconciled_outages
        )
        # a Redis at its memory limit refuses some writes each iteration: reconciled once a second at most then
        if self._reconcile_owed and (not self.guard.full or time.monotonic() >= self._next_reconcile):
            self._reconcile()
        if not self.engine.has_unfinished():
            self.guard.pause()  # while Redis is down, an idle loop would spin
        return done.took

    def _reconcile(self) -> None:
        """After an outage, or events Redis refused or lost: Redis may have restarted, or failed over to a replica
        that lacks its last writes (replication is asynchronous). Compare at once what Redis says of this worker
        with what it holds, rather than at the next timers: its registration (the heartbeat re-registers a lapsed
        key), its running jobs' statuses (a job whose start was lost is LOST, one whose hash was lost DELETED), the
        registry entries naming it that it does not hold (a job stored before the failover but not replicated runs
        again: recovery requeues it), seal markers of jobs it no longer holds (their streams repaired), and its
        publisher's batch counter (lost events: every held job's stream starts over, rose.worker.loop)."""
        self._reconciled_outages = self.guard.outages
        self._reconcile_owed = False
        self._next_reconcile = time.monotonic() + FULL_RECONCILE_EVERY_S
        self.metrics.reconciliations.inc()
        level = logging.DEBUG if self.guard.full else logging.WARNING  # full: the guard's lines say it
        log.log(level, "worker %s: reconciling its jobs and streams with Redis", self.name)
        self._next_heartbeat = 0.0
        self.jobs.watch.check_all()
        if not self.draining and not self.guard.full:
            self.guard.run("recovery", self._recover)
            self._next_recovery = time.monotonic() + self.settings.recovery_interval
        self.outbox.publisher.verify()

    def _timers(self) -> None:
        t = time.monotonic()
        if t >= self._next_heartbeat and self.guard.run("heartbeat", self._heartbeat) is not None:
            self._next_heartbeat = t + self.settings.heartbeat_interval
        # recovery claims an orphan, then requeues it: a full Redis takes the claim and refuses the rest
        if t >= self._next_recovery and not self.draining and not self.guard.full:
            self.guard.run("recovery", self._recover)
            self._next_recovery = t + self.settings.recovery_interval
        if self.rq.should_run_maintenance_tasks and not self.draining:
            self.guard.run("maintenance", self.rq.run_maintenance_tasks)

    def _recover(self, startup: bool = False) -> None:
        """Requeue dead workers' jobs, fail poison ones, repair the streams of jobs a worker died ending."""
        found = recovery.recover(
            self.rq, self._intermediate, self.jobs.mine(), self.settings.max_requeues, self._fail_poison
        )
        self.metrics.requeued.inc(found.requeued)
        self.outbox.flush()
        alive = functools.partial(recovery.worker_alive, self.connection)
        in_flight = self.outbox.in_flight()  # ended jobs whose terminal events are not acknowledged yet
        self._seals.scan(
            self.rq,
            alive,
            predecessor=startup,
            held=lambda job_id: job_id in in_flight or self.jobs.holds(job_id),
        )

    def _fail_poison(self, poison: recovery.Poison) -> None:
        self.endings.fail_orphan(poison.run, poison.owner, poison.requeues)

    def _check_suspension(self) -> None:
        was = self.rq.suspended
        suspended = self.rq.check_suspended()
        if suspended != was:
            log.warning(
                "worker %s: %s",
                self.name,
                "suspended (rq suspend): taking no new jobs" if suspended else "resumed",
            )

    def _heartbeat(self) -> bool:
        busy = WorkerStatus.BUSY if self.jobs.busy else WorkerStatus.IDLE
        state = WorkerStatus.SUSPENDED if self.rq.suspended else busy
        if self.settings.intake_policy == "fair":
            self.jobs.tenants.read_queued(self.connection, self.queue_names())
        # not a transaction: a full Redis refuses its HSETs and ZADDs one by one, but its EXPIREs go through and keep
        # this worker alive to the others (a write refused first would stop them; after --heartbeat-timeout its jobs
        # would be taken over)
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
        engine = self.engine
        self.metrics.gauges(engine)  # also when no step ran since the last jobs ended (e.g. canceled)
        self.metrics.read_prefix_stats(engine)  # the engine's counters (LoRA loads, ...) after its last steps
        return {
            "model": str(engine.model_name),
            "device": str(engine.device),
            "dtype": metrics.dtype_name(engine),
            "max_num_seqs": int(engine.max_num_seqs),
            "max_model_len": int(engine.max_model_len),
            "num_running": int(engine.num_running),
            "num_waiting": int(engine.num_waiting),
            "kv_blocks_used": int(engine.kv_blocks_used),
            "kv_blocks_total": int(engine.kv_blocks_total),
            "running_jobs": len(self.running),
            "updated_at": time.time(),
            "started_at": self.started_at,
            "tokens_per_s": round(self.metrics.rate(), 3),
            "queues": ",".join(self.queue_names()),
            "version": __version__,
            **self.jobs.adapters.info(),
            **self.jobs.tenants.info(self.running.values()),
        }


def _policy(settings: WorkerSettings) -> str:
    if settings.intake_policy == "fcfs":
        return "each queue first come, first served"
    weights = ", ".join(f"{name}={w:g}" for name, w in settings.tenant_weights.items())
    return f"tenants in fair share ({'weights ' + weights if weights else 'equal weights'}), deadlines first"
