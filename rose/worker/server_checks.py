"""What rose-worker requires of the Redis server it is given, checked once at start (rose.worker.cli): a version
that has the commands it takes jobs with (`version_problem`) and room to write (`full_problem`: the worker refuses
to start, rather than die at its first write after loading its model), and a memory policy that never drops RQ's
keys (`eviction_warning`: it warns). A server that will not answer INFO (an ACL without it, a server that lacks
it) is checked for neither of the two INFO says."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import redis

from rose.worker.redis_guard import is_oom, probe_write

log = logging.getLogger(__name__)

# LMOVE / BLMOVE (rq_start, fair_scripts: RQ itself moves ids so from 6.2 on, LPOP before), LPOS, COPY
MIN_REDIS = (6, 2)


def server_info(conn: redis.Redis) -> dict[str, Any]:
    """INFO's default sections (server, memory, ...) as one dict; empty when the server refuses it."""
    try:
        return dict(conn.info())
    except redis.ResponseError:
        log.debug("INFO refused: the server's version and memory policy are not checked", exc_info=True)
        return {}


def version_problem(info: dict[str, Any]) -> str | None:
    """Why this worker cannot serve from the server: one that names a version older than `MIN_REDIS`; else None
    (a version this cannot read too)."""
    reported = str(info.get("redis_version", ""))
    parts = []
    for part in reported.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            return None
        parts.append(int(digits))
    if tuple(parts) >= MIN_REDIS:
        return None
    need = ".".join(map(str, MIN_REDIS))
    return (
        f"runs version {reported}; rose-worker needs Redis {need} or newer (it moves jobs with LMOVE and BLMOVE, "
        "as RQ does from 6.2 on)"
    )


def eviction_warning(info: dict[str, Any]) -> str | None:
    """What a server that evicts keys when full may drop, or None: with a `maxmemory` and any policy but
    `noeviction`, Redis deletes keys to make room: queued jobs (their hashes), results, and the keys with a TTL
    that say a job or a worker is alive (executions, worker keys: their jobs would be run twice)."""
    policy, limit = info.get("maxmemory_policy"), int(info.get("maxmemory") or 0)
    if policy is None or policy == "noeviction" or limit == 0:
        return None
    return (
        f"evicts keys when full (maxmemory {info.get('maxmemory_human', limit)}, maxmemory-policy {policy}): "
        "it may drop queued jobs, results and the records that say a job or a worker is alive; a job queue wants "
        "maxmemory-policy noeviction (docs/deploy.md)"
    )


def full_problem(conn: redis.Redis) -> str | None:
    """Why the worker cannot start now: the server is full (maxmemory, noeviction) and refuses writes."""
    try:
        probe_write(conn)
    except redis.ResponseError as exc:
        if not is_oom(exc):
            raise
        return f"is full (maxmemory) and refuses writes ({exc}); give it room, or shorten results' result_ttl"
    return None
