"""`rose-worker`: serve rose generation jobs from RQ queues with a continuous-batching engine.

Every flag can also be set with its `ROSE_*` environment variable; flags win.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

import redis
from pydantic import ValidationError

from rose.config import WorkerSettings, redact_url
from rose.config.extras import missing_engine
from rose.config.parser import Parser
from rose.engine.tool_calls import TOOL_PARSERS
from rose.jobs import connection
from rose.worker import server_checks
from rose.worker.logs import setup_logging

if TYPE_CHECKING:
    from rose.engine.engine import Engine

log = logging.getLogger("rose.worker")

_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--redis-url", "redis_url", {"metavar": "URL"}),
    ("--queue", "queues", {"action": "append", "metavar": "NAME"}),
    ("--model", "model", {}),
    ("--tokenizer", "tokenizer", {"metavar": "DIR"}),
    ("--device", "device", {}),
    ("--dtype", "dtype", {}),
    ("--max-num-seqs", "max_num_seqs", {"type": int, "metavar": "N"}),
    ("--max-model-len", "max_model_len", {"type": int, "metavar": "TOKENS"}),
    ("--max-num-batched-tokens", "max_num_batched_tokens", {"type": int, "metavar": "N"}),
    ("--max-kv-cache-bytes", "max_kv_cache_bytes", {"metavar": "SIZE"}),
    ("--block-size", "block_size", {"type": int, "metavar": "N"}),
    ("--enable-prefix-caching", "enable_prefix_caching", {"action": "store_const", "const": True}),
    ("--enable-lora", "enable_lora", {"action": "store_const", "const": True}),
    ("--lora-modules", "lora_modules", {"nargs": "+", "action": "extend", "metavar": "NAME=PATH"}),
    ("--max-loras", "max_loras", {"type": int, "metavar": "N"}),
    ("--max-lora-rank", "max_lora_rank", {"type": int, "metavar": "RANK"}),
    ("--with-scheduler", "with_scheduler", {"action": "store_const", "const": True}),
    (
        "--trust-request-chat-template",
        "trust_request_chat_template",
        {"action": "store_const", "const": True},
    ),
    (
        "--structured-outputs-backend",
        "structured_outputs_backend",
        {"choices": ["auto", "xgrammar", "guidance"]},
    ),
    ("--disable-any-whitespace", "disable_any_whitespace", {"action": "store_const", "const": True}),
    ("--tool-call-parser", "tool_call_parser", {"choices": [*TOOL_PARSERS, "none"]}),
    ("--max-json-whitespace", "max_json_whitespace", {"type": int, "metavar": "CHARS"}),
    ("--grammar-compile-timeout", "grammar_compile_timeout", {"type": float, "metavar": "SECONDS"}),
    ("--name", "name", {}),
    ("--drain-timeout", "drain_timeout", {"type": float, "metavar": "SECONDS"}),
    ("--log-level", "log_level", {"metavar": "LEVEL"}),
    ("--log-format", "log_format", {"choices": ["text", "json"]}),
    ("--metrics-port", "metrics_port", {"type": int, "metavar": "PORT"}),
    ("--metrics-host", "metrics_host", {"metavar": "ADDR"}),
    ("--health-timeout", "health_timeout", {"type": float, "metavar": "SECONDS"}),
    ("--heartbeat-timeout", "heartbeat_timeout", {"type": int, "metavar": "SECONDS"}),
    ("--max-requeues", "max_requeues", {"type": int, "metavar": "N"}),
    ("--recovery-interval", "recovery_interval", {"type": float, "metavar": "SECONDS"}),
    ("--check-interval", "check_interval", {"type": float, "metavar": "SECONDS"}),
    ("--stream-interval", "stream_interval", {"type": float, "metavar": "SECONDS"}),
    ("--deadline-policy", "deadline_policy", {"choices": ["continue", "abort"]}),
    ("--intake-policy", "intake_policy", {"choices": ["fair", "fcfs"]}),
    ("--tenant-weight", "tenant_weights", {"nargs": "+", "action": "extend", "metavar": "NAME=W"}),
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="rose-worker",
        description="Take rose.jobs.generate jobs from RQ queues, generate many at once with a continuous-batching "
        "engine, stream tokens on Redis (pub/sub rose:tokens:<job_id> + stream rose:stream:<job_id>) and store "
        "results as RQ job results. SIGTERM/SIGINT drains; a second signal stops at once (running jobs are "
        "requeued, never lost).",
        epilog="Every option can also be given as an environment variable ROSE_<OPTION> (e.g. ROSE_REDIS_URL, "
        "ROSE_QUEUES=high,low). Command-line flags take precedence.",
    )
    fields = WorkerSettings.model_fields
    for flag, name, extra in _FLAGS:
        info = fields[name]
        default = info.default_factory() if info.default_factory else info.default  # type: ignore[call-arg]
        help_text = f"{info.description} [env ROSE_{name.upper()}; default: {default}]"
        if name == "queues":
            help_text = (
                f"Queue to serve; repeat for several, highest priority first. [env ROSE_QUEUES, "
                f"comma-separated; default: {','.join(default)}]"
            )
        elif name in ("lora_modules", "tenant_weights"):
            help_text = f"{info.description} [env ROSE_{name.upper()}; default: none]"
        # argparse formats help with %: a literal one (a percentage) is written %%
        parser.add_argument(flag, dest=name, default=None, help=help_text.replace("%", "%%"), **extra)
    parser.add_argument(
        "--burst", action="store_true", help="Exit once the queues are empty and no job runs."
    )
    parser.add_version()
    return parser


def load_settings(argv: list[str] | None = None) -> tuple[WorkerSettings, argparse.Namespace]:
    args = build_parser().parse_args(argv)
    overrides = {name: value for _, name, _ in _FLAGS if (value := getattr(args, name)) is not None}
    return WorkerSettings(**overrides), args


def connect(url: str) -> redis.Redis:
    """A client for `url`, checked with PING and INFO (rose.worker.server_checks). On failure (unreachable, wrong
    password, bad URL, a Redis too old or full) prints one line to stderr and raises SystemExit(2), the exit code of every
    start-up error; a server that may evict RQ's keys is a warning in the log."""
    try:
        conn = connection.connect(url, socket_connect_timeout=5, health_check_interval=30)
        conn.ping()
        info = server_checks.server_info(conn)
        problem = server_checks.version_problem(info) or server_checks.full_problem(conn)
    except (
        redis.ConnectionError,
        redis.TimeoutError,
        redis.AuthenticationError,
        redis.ResponseError,
        ValueError,
        OSError,
    ) as exc:
        reason = " ".join(str(exc).split()).rstrip(".") or type(exc).__name__
        if isinstance(exc, redis.ReadOnlyError):
            print(
                f"rose-worker: Redis at {redact_url(url)} is a read-only replica ({reason}); point --redis-url at "
                "the primary, or at Sentinel (redis+sentinel://...)",
                file=sys.stderr,
            )
            raise SystemExit(2) from None
        print(
            f"rose-worker: cannot reach Redis at {redact_url(url)}: {reason}. Check --redis-url / ROSE_REDIS_URL "
            "(redis://[user:password@]host:port/db, rediss:// for TLS) and that the server is running.",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    if problem is not None:
        print(f"rose-worker: Redis at {redact_url(url)} {problem}", file=sys.stderr)
        raise SystemExit(2)
    warning = server_checks.eviction_warning(info)
    if warning is not None:
        log.warning("Redis at %s %s", redact_url(url), warning)
    return conn


def build_engine(settings: WorkerSettings) -> Engine:
    from rose.engine.engine import Engine

    engine = Engine(settings.model, settings.tokenizer, settings.engine_config())
    engine.prepare_structured_outputs()  # not on the loop thread when the first constrained job comes
    return engine


def register_adapters(engine: Engine, settings: WorkerSettings) -> None:
    """Read every --lora-modules adapter and check it against the model now (rose.engine.lora raises LoRAError,
    a ValueError naming the adapter and the problem): a bad one stops the worker before it takes a job."""
    from rose.worker.adapters import lora_requests

    for request in lora_requests(settings).values():
        adapter = engine.lora.register(request)
        log.info(
            "LoRA adapter %r (id %d, rank %d, %d layers) from %s",
            request.lora_name,
            request.lora_int_id,
            adapter.rank,
            len(adapter.weights),
            request.lora_path,
        )


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as exc:  # a producer's install: no engine
        message = missing_engine(exc)
        if message is None:
            raise
        print(f"rose-worker: error: {message}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    # A signal while starting (model loading): nothing is held yet, so just leave (exit 0, as a drain would).
    early: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: early.append(signum))
    try:
        settings, args = load_settings(argv)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        print(f"rose-worker: invalid settings: {problems}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    conn = connect(settings.redis_url)

    from rose.worker import recovery
    from rose.worker.worker import NameInUse, RoseWorker

    if settings.name and not recovery.wait_for_name(conn, settings.name, settings.heartbeat_timeout):
        print(
            f"rose-worker: a live worker named {settings.name!r} is already running; use another --name",
            file=sys.stderr,
        )
        return 2
    if early:
        return 0
    try:
        engine = build_engine(settings)
    except Exception as exc:
        log.debug("engine construction failed", exc_info=True)
        print(f"rose-worker: cannot load model {settings.model!r}: {exc}", file=sys.stderr)
        return 2
    try:
        register_adapters(engine, settings)
    except ValueError as exc:  # rose.engine.lora.LoRAError: it names the adapter
        engine.close()
        print(f"rose-worker: cannot serve {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):  # an outage: the worker waits it out
        if (problem := server_checks.full_problem(conn)) is not None:  # it filled while the model loaded
            engine.close()
            print(f"rose-worker: Redis at {redact_url(settings.redis_url)} {problem}", file=sys.stderr)
            return 2
    try:
        worker = RoseWorker(settings.queues, engine=engine, connection=conn, settings=settings)
    except NameInUse as exc:
        print(f"rose-worker: {exc}", file=sys.stderr)
        return 2
    if early:
        log.warning("signal %s while starting: exiting before taking any job", early[0])
        return 0
    try:
        worker.serve_metrics()
    except OSError as exc:
        print(f"rose-worker: cannot serve metrics on port {settings.metrics_port}: {exc}", file=sys.stderr)
        return 2
    try:
        worker.work(burst=args.burst)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
