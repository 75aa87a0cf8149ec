"""Redis-touching stages of the worker run through one guard: while Redis is unreachable, the stage is skipped and
the engine keeps stepping; the guard backs off (0.5 s doubling to 30 s) and says whether Redis answered last time
(/health's readiness)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0


class RedisGuard:
    def __init__(self) -> None:
        self.ok = True  # the last stage that ran reached Redis
        self._down_until = 0.0
        self._backoff = FIRST_BACKOFF_S

    @property
    def down(self) -> bool:
        """Backing off after an error: stages are skipped until the backoff ends."""
        return time.monotonic() < self._down_until

    def run(self, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or None if Redis is down or fails now (logged, naming `stage`)."""
        if self.down:
            return None
        try:
            result = fn(*args)
        except REDIS_ERRORS as exc:
            self.ok = False
            log.error("Redis unreachable during %s (%s); retrying in %.1f s", stage, exc, self._backoff)
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            return None
        self._backoff = FIRST_BACKOFF_S
        self.ok = True
        return result

    def pause(self) -> None:
        """Sleep out a short part of the backoff (an idle loop would otherwise spin)."""
        left = self._down_until - time.monotonic()
        if left > 0:
            time.sleep(min(0.5, left))
