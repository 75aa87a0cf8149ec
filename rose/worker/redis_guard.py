"""Redis-touching stages of the worker run through one guard: while Redis is unreachable, the stage is skipped and
the engine keeps stepping; the guard backs off (0.1 s doubling to 0.5 s: a refused connection costs nothing, and
the worker must be back at work within a second of Redis answering again), says whether Redis answered last time
(/health's readiness) and counts the outages, so that the worker can reconcile with Redis after each one
(rose.worker.worker: a restart or a failover may have lost writes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.1, 0.5
LOG_EVERY_S = 10.0  # while an outage lasts, one log line this often


class RedisGuard:
    """`connection`: PINGed once the backoff ends, before any stage runs again (a stage that happens not to touch
    Redis must not pass for Redis being back)."""

    def __init__(self, connection: redis.Redis) -> None:
        self.connection = connection
        self.ok = True  # the last stage that ran reached Redis
        self.outages = 0  # times Redis became unreachable
        self._down_until = 0.0
        self._backoff = FIRST_BACKOFF_S
        self._down_since = 0.0
        self._logged_at = 0.0

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
                self.connection.ping()
                log.warning("Redis reachable again after %.1f s", time.monotonic() - self._down_since)
                self._backoff = FIRST_BACKOFF_S
                self.ok = True
            return fn(*args, **kwargs)
        except REDIS_ERRORS as exc:
            self._failed(stage, exc)
            return None

    def pause(self) -> None:
        """Sleep out a short part of the backoff (an idle loop would otherwise spin)."""
        left = self._down_until - time.monotonic()
        if left > 0:
            time.sleep(min(0.5, left))

    def _failed(self, stage: str, exc: BaseException) -> None:
        now = time.monotonic()
        if self.ok:
            self.ok = False
            self.outages += 1
            self._down_since = now
            self._logged_at = now
            log.error(
                "Redis unreachable during %s (%s); retrying every %.1f s at most", stage, exc, MAX_BACKOFF_S
            )
        elif now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.error("Redis still unreachable after %.0f s (%s: %s)", now - self._down_since, stage, exc)
        self._down_until = now + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
