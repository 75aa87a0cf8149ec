"""Redis-touching stages of the worker run through one guard: while Redis is unreachable, or full (a `maxmemory`
under `noeviction` refuses writes until room is made), the stage is skipped and the engine keeps stepping; the
guard backs off (0.1 s doubling to 0.5 s: a refused connection costs nothing, and the worker must be back at work
within a second of Redis answering again), says whether Redis answered last time (/health's readiness) and counts
the outages, so that the worker can reconcile with Redis after each one (rose.worker.worker: a restart or a
failover may have lost writes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import OutOfMemoryError

from rose.jobs import keys

log = logging.getLogger(__name__)

# Redis unreachable, or full: a write refused (OOM) is retried as a stage cut off by an outage is, and what a
# pipeline of several commands wrote before it is reconciled after it
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, OutOfMemoryError)
_OOM = "OOM command not allowed"  # Redis before 7.0 wraps a script's refused write in a plain script error


def probe_write(conn: redis.Redis) -> None:
    """A write that changes nothing (the key is never set): refused, as any write is, while Redis is full."""
    conn.set(keys.OOM_PROBE_KEY, "", xx=True)


def is_oom(exc: BaseException) -> bool:
    """A write Redis refused because it is full (maxmemory, noeviction), whether redis-py names it so or not."""
    return isinstance(exc, OutOfMemoryError) or (isinstance(exc, redis.ResponseError) and _OOM in str(exc))


FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.1, 0.5
LOG_EVERY_S = 10.0  # while an outage lasts, one log line this often


class RedisGuard:
    """`connection`: PINGed once the backoff ends, before any stage runs again (a stage that happens not to touch
    Redis must not pass for Redis being back); after a write refused for memory, sent a write that changes nothing
    instead (a full Redis answers PING).

    A Redis at its memory limit takes some writes and refuses others as its memory moves: its refusals are one
    episode, logged when it starts, every `LOG_EVERY_S` while it lasts and once no write was refused for
    `LOG_EVERY_S`; each refusal still counts as an outage (the stage that met it is retried, and what the worker
    wrote is reconciled)."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection
        self.ok = True  # the last stage that ran reached Redis
        self.outages = 0  # times Redis became unreachable, or refused a write for memory
        self._down_until = 0.0
        self._backoff = FIRST_BACKOFF_S
        self._down_since = 0.0
        self._logged_at = 0.0
        self._full = False  # the last error: a write refused for memory
        self._full_since: float | None = None  # the episode of refusals for memory, while it lasts
        self._refused_at = 0.0
        self._refusals = 0

    @property
    def full(self) -> bool:
        """In an episode of writes refused for memory (it ends once none was refused for LOG_EVERY_S)."""
        return self._full_since is not None

    @property
    def down(self) -> bool:
        """Backing off after an error: stages are skipped until the backoff ends."""
        return time.monotonic() < self._down_until

    def run(self, stage: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, or None if Redis is down or fails now (logged, naming `stage`)."""
        if self.down:
            return None
        try:
            if not self.ok:
                # a write, refused as any is while Redis is full; else a no-op (the key never exists)
                if self._full:
                    probe_write(self.connection)
                else:
                    self.connection.ping()
                    log.warning("Redis reachable again after %.1f s", time.monotonic() - self._down_since)
                self._backoff = FIRST_BACKOFF_S
                self.ok = True
            self._end_full_episode()
            return fn(*args, **kwargs)
        except (*REDIS_ERRORS, redis.ResponseError) as exc:
            if not isinstance(exc, REDIS_ERRORS) and not is_oom(exc):
                raise
            self._failed(stage, exc)
            return None

    def pause(self) -> None:
        """Sleep out a short part of the backoff (an idle loop would otherwise spin)."""
        left = self._down_until - time.monotonic()
        if left > 0:
            time.sleep(min(0.5, left))

    def _failed(self, stage: str, exc: BaseException) -> None:
        now = time.monotonic()
        self._full = is_oom(exc)
        was_ok, self.ok = self.ok, False
        if was_ok:
            self.outages += 1
            self._down_since = now
        if self._full:
            self._refused(stage, exc, now)
        elif was_ok:
            self._logged_at = now
            log.error(
                "Redis unreachable during %s (%s); retrying every %.1f s at most", stage, exc, MAX_BACKOFF_S
            )
        elif now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.error("Redis still unreachable after %.0f s (%s: %s)", now - self._down_since, stage, exc)
        self._down_until = now + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def _refused(self, stage: str, exc: BaseException, now: float) -> None:
        self._refusals += 1
        self._refused_at = now
        if self._full_since is None:
            self._full_since = self._logged_at = now
            log.error(
                "Redis is full (maxmemory) and refuses writes: %s waits (%s); retrying every %.1f s at most",
                stage,
                exc,
                MAX_BACKOFF_S,
            )
        elif now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.error(
                "Redis still full after %.0f s: %d writes refused (%s: %s)",
                now - self._full_since,
                self._refusals,
                stage,
                exc,
            )

    def _end_full_episode(self) -> None:
        """Once Redis took every write for LOG_EVERY_S, the episode of refusals for memory is over."""
        if self._full_since is not None and time.monotonic() - self._refused_at >= LOG_EVERY_S:
            log.warning(
                "Redis takes writes again: %d refused for memory over %.1f s",
                self._refusals,
                self._refused_at - self._full_since,
            )
            self._full_since, self._refusals = None, 0
