"""RoseWorker's lifecycle around the loop: signals and RQ worker commands, heartbeats, drain and shutdown."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from rq.command import parse_payload
from rq.utils import now
from rq.worker import WorkerStatus

from rose import __version__
from rose.jobs import keys
from rose.worker import metrics, rq_store
from rose.worker.intake import Running

if TYPE_CHECKING:
    from rose.worker.worker import RoseWorker

log = logging.getLogger("rose.worker.worker")

_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


class Lifecycle:
    """Mixin of RoseWorker."""

    # ---- signals and commands -------------------------------------------------------------------------------

    def _install_signal_handlers(self: RoseWorker) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.request_stop)
            signal.signal(signal.SIGTERM, self.request_stop)

    def request_stop(self: RoseWorker, signum: int, frame: Any) -> None:
        """First signal: stop taking jobs and drain; second: stop waiting. Never raises (unlike RQ's)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.settings.drain_timeout
            self._shutdown_requested_date = self._shutdown_requested_date or now()
            log.warning(
                "signal %s: draining %d running jobs (up to %.0f s); signal again to stop now",
                signum,
                len(self.running),
                self.settings.drain_timeout,
            )
        else:
            self._force_stop = True
            log.warning("signal %s again: requeueing running jobs and stopping now", signum)

    def handle_payload(self: RoseWorker, message: dict) -> None:
        """RQ worker commands (pubsub thread): hand them to the loop."""
        try:
            payload = parse_payload(message)
        except Exception:
            log.warning("ignoring unreadable worker command %r", message)
            return
        command = payload.get("command")
        if command == "stop-job" and payload.get("job_id"):
            self._stop_job_ids.append(str(payload["job_id"]))
        elif command == "stop-execution" and payload.get("job_id"):
            # RQ 3's send_stop_execution_command: rose holds one execution per job, so it names the job. The
            # loop stops it (checked there: the job must still run under that execution).
            self._stop_job_ids.append(f"{payload['job_id']}:{payload.get('execution_id', '')}")
        elif command == "shutdown":
            self.request_stop(signal.SIGTERM, None)
        else:
            log.info("ignoring worker command %r", command)

    # ---- heartbeats -------------------------------------------------------------------------------------------

    def heartbeat(self: RoseWorker, timeout: int | None = None, pipeline: Any = None) -> None:
        # RQ adds 60 s to worker_ttl; here the key must lapse within --heartbeat-timeout of the last beat.
        super().heartbeat(timeout or self.worker_ttl, pipeline=pipeline)

    def _heartbeat(self: RoseWorker) -> bool:
        with self.connection.pipeline(transaction=False) as pipe:
            self.heartbeat(pipeline=pipe)  # HSET last_heartbeat (reply 1 = the key had expired) + EXPIREs
            state = WorkerStatus.BUSY if self.running or self._retirer.busy else WorkerStatus.IDLE
            rq_store.heartbeat(
                pipe, self, self.running.values(), WorkerStatus.SUSPENDED if self._suspended else state
            )
            info = self._info()
            pipe.hset(keys.worker_info_key(self.name), mapping=info)
            pipe.expire(keys.worker_info_key(self.name), self.worker_ttl)
            replies = pipe.execute()
        if replies[0] == 1:
            # Our key had lapsed (Redis outage longer than the heartbeat timeout): register again.
            log.warning("worker %s: registration had expired; registering again", self.name)
            with self.connection.pipeline() as pipe:
                rq_store.reregister(pipe, self, self.held_executions())
                pipe.execute()
        self._check_suspension()
        return True

    def _info(self: RoseWorker) -> dict[str, Any]:
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

    # ---- shutdown ---------------------------------------------------------------------------------------------

    def _shutdown(self: RoseWorker) -> None:
        """Requeue what is still running at the front of its queue (start order kept), then unregister."""
        try:
            if self._stop_job_ids:
                self._redis("checks", self._apply_stops)
            if self.running:
                self._redis("checks", self._checks)
                self._redis("retire", self._retire)
            self._retirer.drain()
            if any(run.retire_inline for run in self.running.values()):  # handed back: checked, one more try
                self._redis("checks", self._checks)
                self._redis("retire", self._retire)
            left = sorted(self.running.values(), key=lambda r: r.started_mono)
            for run in left:
                self._forget(run)
            if left:
                self._requeue_on_exit(left)
            self._flush_outbox()
            self.publisher.close(timeout=10)
        finally:
            try:
                self.connection.delete(keys.worker_info_key(self.name))
                self.register_death()
            except _REDIS_ERRORS as exc:
                log.error("could not register the worker's death (%s); its key will lapse on its own", exc)
            self.unsubscribe()
            if self.scheduler is not None:
                self.stop_scheduler()
            self.stopped = True
            if self.metrics_server is not None:
                self.metrics_server.close()
            log.info("worker %s: stopped (%d jobs completed)", self.name, self.completed)

    def _requeue_on_exit(self: RoseWorker, runs: list[Running]) -> None:
        delay = 0.5
        for attempt in range(5):
            try:
                with self.connection.pipeline() as pipe:
                    for run in reversed(runs):  # LPUSH in reverse: the first started ends up first
                        rq_store.requeue_started(
                            pipe, run.job, run.queue, run.composite_key, self.name, at_front=True
                        )
                    rq_store.sync_state(self, busy=False, pipe=pipe)
                    pipe.execute()
                for run in runs:
                    rq_store.release(self, run.execution)
                self.metrics.requeued.inc(len(runs))
                for run in runs:
                    log.info(
                        "job %s requeued", run.id, extra=self._end_fields(run, "requeued", reason="shutdown")
                    )
                log.warning("requeued %d unfinished jobs at the front of their queues", len(runs))
                return
            except _REDIS_ERRORS as exc:
                log.error("could not requeue %d jobs (%s), attempt %d", len(runs), exc, attempt + 1)
                time.sleep(delay)
                delay *= 2
        log.error("gave up requeueing; live workers will requeue them once this worker's heartbeat lapses")
