"""Helpers shared by the producer / operator subcommands (submit, batch, status, cancel, result)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

    from rose.jobs.client import Client

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
DEFAULT_QUEUE = "rose"  # = rose.jobs.keys.DEFAULT_QUEUE (not imported: keeps `rose --help` quick)

# Exit codes of the job commands (argparse and bad arguments use 2; Ctrl-C 130).
EXIT_FAILED = 1  # the job (or a batch line) failed, or was canceled; an unknown job id
EXIT_TIMEOUT = 124  # like timeout(1): gave up waiting, the job goes on


def add_redis_args(parser: argparse.ArgumentParser, queue: bool = True) -> None:
    """--redis-url (default $ROSE_REDIS_URL) and, where relevant, --queue."""
    default_url = os.environ.get("ROSE_REDIS_URL") or DEFAULT_REDIS_URL
    parser.add_argument(
        "--redis-url",
        default=default_url,
        help=f"Redis to use: redis://, rediss://, unix:// or, through Redis Sentinel, "
        f"redis+sentinel://host:port[,host:port...]/service_name[/db] (default: $ROSE_REDIS_URL, else "
        f"{DEFAULT_REDIS_URL}; now {default_url})",
    )
    if queue:
        parser.add_argument(
            "--queue", default=DEFAULT_QUEUE, help=f"queue to submit to (default: {DEFAULT_QUEUE})"
        )


def connect(args: argparse.Namespace) -> redis.Redis:
    """A Redis connection, checked at once so that a wrong URL is one clear line, not a traceback later."""
    import redis

    from rose.jobs.connection import connect as connect_url
    from rose.jobs.connection import redact_url

    try:
        conn = connect_url(args.redis_url, socket_connect_timeout=5, health_check_interval=30)
        conn.ping()
    except (redis.RedisError, ValueError) as exc:
        raise SystemExit(
            f"rose {args.command}: error: cannot reach Redis at {redact_url(args.redis_url)}: {exc}"
        ) from None
    return conn


def make_client(args: argparse.Namespace) -> Client:
    from rose.jobs.client import Client

    return Client(connect(args), queue=getattr(args, "queue", DEFAULT_QUEUE))


def workers_serving(conn: redis.Redis, queue: str) -> int:
    """How many live RQ workers (rose-workers among them) serve `queue` on this Redis database. `Worker.all`, not
    `Worker.count`: a worker killed with SIGKILL stays in the queue's worker set, but its own key expires."""
    from rq import Queue, Worker

    return len(Worker.all(connection=conn, queue=Queue(queue, connection=conn)))


def redis_flag(args: argparse.Namespace) -> str:
    """` --redis-url URL` for a command printed for the user to run later, when they gave a URL other than the one
    that command would take by default ($ROSE_REDIS_URL, else the default); '' otherwise. A password shows as ***."""
    import shlex

    from rose.jobs.connection import redact_url

    if args.redis_url == (os.environ.get("ROSE_REDIS_URL") or DEFAULT_REDIS_URL):
        return ""
    return f" --redis-url {shlex.quote(redact_url(args.redis_url))}"


def later(args: argparse.Namespace, job_id: str) -> str:
    """What the user can run to follow a job they stopped waiting for."""
    flag = redis_flag(args)
    return f"`rose result {job_id} --wait S{flag}` or `rose cancel {job_id}{flag}`"


def error(args: argparse.Namespace, message: str) -> None:
    print(f"rose {args.command}: {message}", file=sys.stderr, flush=True)


def usage_line(result: dict[str, Any]) -> str:
    usage = result.get("usage") or {}
    parts = [f"finish_reason={result.get('finish_reason')}"]
    parts += [f"{k}={v}" for k, v in usage.items()]
    return "[" + " ".join(parts) + "]"


def ended_badly(args: argparse.Namespace, job_id: str, exc: Exception) -> int | None:
    """Report a job that failed or was canceled (JobFailed / JobCanceled) and return the exit code; None otherwise."""
    from rose.jobs.client import JobCanceled, JobFailed

    if isinstance(exc, JobFailed):
        error(args, f"job {job_id} failed: {exc.message}")
    elif isinstance(exc, JobCanceled):
        error(args, f"job {job_id} {exc.reason}")
    else:
        return None
    return EXIT_FAILED
