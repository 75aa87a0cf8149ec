"""rose-worker's face to RQ: an RQ 3 `BaseWorker` that the loop (rose.worker.loop) holds, never inherits.

It is what RQ and its tools see of a rose-worker: the registration hash `rq:worker:<name>` (birth, heartbeats, state,
death, counters), the worker's executions (`Worker.get_current_executions()`), the pub/sub channel of worker commands
(`send_stop_job_command`, `send_stop_execution_command`, `send_shutdown_command`), RQ's scheduler and maintenance,
and RQ's job handlers (`handle_job_success` / `handle_job_failure`), which rose.worker.rq_store calls. The rest of the
worker uses RQ's public worker API on it (name, connection, queues, default_result_ttl, worker_ttl, maintenance) and
the methods below; RQ's private attributes are touched only here, in rq_store.py and in rq_scan.py.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.command import parse_payload
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.timeouts import TimerDeathPenalty, UnixSignalDeathPenalty
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus

from rose.worker.redis_guard import REDIS_ERRORS

log = logging.getLogger(__name__)

PUBSUB_RETRY_S = 0.1  # while Redis is unreachable the command channel is reconnected this often
PUBSUB_POLL_S = 1.0  # longest the pub/sub thread blocks on a read (how late it notices it must stop)

Command = tuple[str, str, str]  # (command, job id, execution id): "stop-job" / "stop-execution" / "shutdown"

# HSET the worker's state only if its key exists: a plain HSET on a lapsed key would leave a TTL-less hash that
# makes the name look taken (RQ's register_birth refuses it); the heartbeat re-registers a lapsed key instead.
_SET_STATE_IF_REGISTERED = (
    "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'state', ARGV[1]) end"
)


class CompactJSONSerializer(JSONSerializer):
    """RQ's JSONSerializer writing JSON without spaces and its text as UTF-8, not `\\uXXXX`: the same values for any
    JSON reader, RQ's JSONSerializer included. What the worker writes through RQ, a job's result above all (base64'd
    by RQ), is smaller by the spaces between its token ids (~1 byte a token) and, for text outside ASCII, by up to
    half of its text. A value holding what UTF-8 cannot (a lone surrogate, which a producer's JSON can carry) is
    written all-ASCII, as RQ's JSONSerializer would, still without spaces."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        try:
            return _COMPACT_UTF8(obj).encode()
        except UnicodeEncodeError:
            return _COMPACT_ASCII(obj).encode()


_COMPACT_UTF8 = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_COMPACT_ASCII = json.JSONEncoder(separators=(",", ":")).encode


class RQWorker(BaseWorker):
    """`RQWorker(queues, name=..., connection=r, worker_ttl=s, on_command=fn, socket_timeout=s)`. `on_command`
    receives each worker command (on RQ's pub/sub thread) as a `Command`."""

    def __init__(
        self,
        queues: Any,
        *,
        connection: redis.Redis,
        on_command: Callable[[Command], None],
        socket_timeout: int,
        **kwargs: Any,
    ) -> None:
        self._on_command = on_command
        self._socket_timeout = socket_timeout
        self.suspended = False  # `rq suspend` held at the last `check_suspended`
        super().__init__(queues, connection=connection, serializer=CompactJSONSerializer, **kwargs)
        # Every connection of this process carries the worker's name, so a restart can tell a live holder of
        # the name (connections open) from a killed one (connections closed by the kernel).
        self.connection.connection_pool.connection_kwargs["client_name"] = self.name
        # No retries inside redis-py: a command that meets an outage fails at once, and the worker's guard backs
        # off (rose.worker.redis_guard) while the engine keeps stepping. redis-py's default for clients made with
        # Redis(host=...) retries with sleeps of up to 10 s, in the engine loop.
        self.connection.set_retry(Retry(NoBackoff(), 0))

    # ---- RQ's hooks -------------------------------------------------------------------------------------------

    def _set_ip_address(self, connection: redis.Redis) -> None:
        # tolerate a CLIENT INFO reply redis-py cannot parse (fakeredis, for `rose demo --redis fake`: ValueError,
        # where RQ only expects a ResponseError)
        try:
            super()._set_ip_address(connection)
        except ValueError:
            self.ip_address = "unknown"

    @property
    def connection_timeout(self) -> int:
        # RQ sizes the socket timeout for its ~7-minute blocking dequeue; rose's blocks a second at most, and a
        # stalled Redis must not freeze the engine loop for long.
        return self._socket_timeout

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        # RQ adds 60 s to worker_ttl; here the key must lapse within --heartbeat-timeout of the last beat.
        super().heartbeat(timeout or self.worker_ttl, pipeline=pipeline)

    def subscribe(self) -> None:
        """Listen to the worker's command channel on a thread, as RQ does, but reconnect and resubscribe within
        PUBSUB_RETRY_S of Redis answering again (RQ's thread waits 2 s between tries: a stop command sent right
        after a Redis restart reached nobody). A command published while the channel is down is lost: pub/sub
        keeps nothing."""
        log.info("worker %s: subscribing to %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self._pubsub_down_since: float | None = None
        self.pubsub_thread = self.pubsub.run_in_thread(
            sleep_time=PUBSUB_POLL_S, daemon=True, exception_handler=self._pubsub_error
        )

    def _pubsub_error(self, exc: BaseException, pubsub: Any, thread: Any) -> None:
        if not isinstance(exc, redis.ConnectionError | redis.TimeoutError):
            log.error("worker %s: command channel thread stops on %r", self.name, exc)
            raise exc
        if self._pubsub_down_since is None:
            self._pubsub_down_since = time.monotonic()
            log.warning("worker %s: command channel lost (%s); reconnecting", self.name, exc)
        time.sleep(PUBSUB_RETRY_S)
        conn = pubsub.connection
        if conn is None:
            return
        try:
            conn.connect()  # a no-op if connected; else it resubscribes (PubSub.on_connect) once Redis answers
        except (redis.ConnectionError, redis.TimeoutError):
            return
        log.warning(
            "worker %s: command channel back after %.1f s",
            self.name,
            time.monotonic() - self._pubsub_down_since,
        )
        self._pubsub_down_since = None

    def unsubscribe(self) -> None:
        """Stop listening. The thread closes the pub/sub connection on its way out (closing it here too, as RQ does,
        races with that: redis-py's close is not idempotent)."""
        thread = self.pubsub_thread
        if thread is None:
            return
        thread.stop()
        thread.join(timeout=PUBSUB_POLL_S + 1)
        self.pubsub_thread = None

    def handle_payload(self, message: dict) -> None:
        """RQ worker commands (pub/sub thread): handed to the loop's callback."""
        try:
            payload = parse_payload(message)
        except Exception:
            log.warning("ignoring unreadable worker command %r", message)
            return
        command = str(payload.get("command"))
        if command in ("stop-job", "stop-execution") and not payload.get("job_id"):
            log.info("ignoring worker command %r without a job id", command)
            return
        # RQ 3's send_stop_execution_command names the job too: rose holds one execution per job
        self._on_command((command, str(payload.get("job_id") or ""), str(payload.get("execution_id") or "")))

    # ---- what the loop calls ----------------------------------------------------------------------------------

    def choose_death_penalty(self, main_thread: bool) -> None:
        """Callback timeouts: SIGALRM-based where the loop runs on the main thread, a timer thread elsewhere."""
        self.death_penalty_class = UnixSignalDeathPenalty if main_thread else TimerDeathPenalty

    def start(self) -> None:
        """Register (taking over the key of a killed predecessor under the same name), beat, listen to commands."""
        if self.connection.exists(self.key) and not self.connection.hexists(self.key, "death"):
            # The name was checked free before: this is the key of our killed predecessor.
            log.warning(
                "worker %s: previous run under this name died without unregistering; taking over", self.name
            )
            self.connection.delete(self.key)
        self.register_birth()
        self.heartbeat()
        self.subscribe()
        self.set_state(WorkerStatus.IDLE)

    def start_scheduler(self, burst: bool, logging_level: str) -> None:
        self._start_scheduler(burst, logging_level=logging_level)

    def shutdown_requested(self) -> None:
        self._shutdown_requested_date = self._shutdown_requested_date or now()

    def check_suspended(self) -> bool:
        """Whether `rq suspend` holds, kept in `suspended`; the registered state follows it."""
        suspended = bool(is_suspended(self.connection, self))
        if suspended != (self.get_state() == WorkerStatus.SUSPENDED):
            self.set_state(WorkerStatus.SUSPENDED if suspended else WorkerStatus.IDLE)
        self.suspended = suspended
        return suspended

    def sync_state(self, busy: bool, pipe: Any = None) -> None:
        """Set the registered state (busy / idle) if it changed; `suspended` is left to `check_suspended`."""
        state = self.get_state()
        if state == WorkerStatus.SUSPENDED:
            return
        want = WorkerStatus.BUSY if busy else WorkerStatus.IDLE
        if state != want:
            if pipe is None:
                with self.connection.pipeline(transaction=False) as own:
                    self.set_state_if_registered(own, want)
                    own.execute()
            else:
                self.set_state_if_registered(pipe, want)

    def set_state_if_registered(self, pipe: Any, state: WorkerStatus) -> None:
        self._state = state
        pipe.eval(_SET_STATE_IF_REGISTERED, 1, self.key, state.value)

    def stop(self) -> None:
        """Unregister (its death recorded, as RQ does), stop listening, stop the scheduler it started."""
        try:
            self.register_death()
        except REDIS_ERRORS as exc:
            log.error("could not register the worker's death (%s); its key will lapse on its own", exc)
        self.unsubscribe()
        if self.scheduler is not None:
            self.stop_scheduler()
