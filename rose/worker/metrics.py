"""Prometheus metrics of one rose-worker (vLLM-style names under `rose_`) and the `/metrics` + `/health` server.

Each worker has its own `CollectorRegistry` (never the global one), so several workers can live in one process.
Updating is cheap: the loop calls `on_step` once per engine step with the step's token count and timings; the
per-job hooks run once per job event. Inter-token latency is recorded per step as one weighted observation
(every request that decoded in consecutive steps saw the same interval), never one call per token.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, make_wsgi_app
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer

if TYPE_CHECKING:
    from rose.jobs.contract import JobResult
    from rose.worker.engine_protocol import WorkerEngine

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0)
PREFIX_STATS_EVERY_S = 1.0


class WeightedHistogram:
    """A histogram whose observe() takes a count: one call records `count` equal observations."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float], labels: dict[str, str]):
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += count
            self.sum += value * count

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), buckets, total)
        yield family

    def describe(self) -> Iterable[Metric]:
        return self.collect()


class WorkerMetrics:
    """The metrics of one worker. `model` labels every series (`model_name`, as vLLM does)."""

    def __init__(
        self, *, name: str, model: str, device: str, dtype: str, queues: Sequence[str], version: str
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg, ln, lv = self.registry, ["model_name"], [model]
        info = Info("rose_worker", "The worker: name, model, device, dtype, queues, version.", registry=reg)
        queue_list = ",".join(queues)
        info.info(
            {
                "name": name,
                "model": model,
                "device": device,
                "dtype": dtype,
                "queues": queue_list,
                "version": version,
            }
        )
        self.running = Gauge(
            "rose_num_requests_running", "Jobs in the engine's running batch.", ln, registry=reg
        ).labels(*lv)
        self.waiting = Gauge(
            "rose_num_requests_waiting", "Jobs waiting in the engine.", ln, registry=reg
        ).labels(*lv)
        self.kv_usage = Gauge(
            "rose_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", ln, registry=reg
        ).labels(*lv)
        self.prompt_tokens = Counter(
            "rose_prompt_tokens", "Prompt tokens of finished jobs.", ln, registry=reg
        ).labels(*lv)
        self.generation_tokens = Counter(
            "rose_generation_tokens", "Tokens generated (every job, finished or not).", ln, registry=reg
        ).labels(*lv)
        self.success = Counter(
            "rose_request_success", "Jobs finished, by finish reason.", [*ln, "finished_reason"], registry=reg
        )
        self._success_children: dict[str, Any] = {}
        self.model = model
        self.lora: Any = None  # rose.worker.adapters.Adapters with --enable-lora: the engine's LoRA counters
        for reason in ("stop", "length"):
            self._success_child(reason)
        self.failure = Counter(
            "rose_request_failure", "Job attempts failed (RQ Retry may run them again).", ln, registry=reg
        ).labels(*lv)
        self.structured_output_errors = Counter(
            "rose_structured_output_errors",
            "Job attempts whose JSON-constrained output broke its schema (failed, never stored as results; RQ "
            "Retry may run them again).",
            ln,
            registry=reg,
        ).labels(*lv)
        deadline_exceeded = Counter(
            "rose_request_deadline_exceeded",
            "Jobs failed for their deadline: passed before they started (when=queued) or while they ran "
            "(when=running, --deadline-policy abort).",
            [*ln, "when"],
            registry=reg,
        )
        self.deadline_exceeded = {
            when: deadline_exceeded.labels(model, when) for when in ("queued", "running")
        }
        self.canceled = Counter(
            "rose_request_canceled", "Jobs canceled, deleted or stopped while running.", ln, registry=reg
        ).labels(*lv)
        self.requeued = Counter(
            "rose_request_requeued",
            "Jobs this worker put back on their queue (its own on shutdown, dead workers' orphans).",
            ln,
            registry=reg,
        ).labels(*lv)
        self.prefix_queries = Counter(
            "rose_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (first admissions).",
            ln,
            registry=reg,
        ).labels(*lv)
        self.prefix_hits = Counter(
            "rose_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (first admissions).",
            ln,
            registry=reg,
        ).labels(*lv)
        self.preemptions = Counter(
            "rose_num_preemptions",
            "Sequences the engine preempted when its KV blocks ran out (recomputed when readmitted).",
            ln,
            registry=reg,
        ).labels(*lv)
        self.reconciliations = Counter(
            "rose_redis_reconciliations",
            "Times the worker compared its jobs and streams with Redis after an outage, or events Redis refused "
            "or lost (a restart, a failover).",
            ln,
            registry=reg,
        ).labels(*lv)
        self.queue_time = Histogram(
            "rose_request_queue_time_seconds",
            "Seconds a job waited on its queue (enqueued to started).",
            ln,
            registry=reg,
            buckets=QUEUE_BUCKETS,
        ).labels(*lv)
        self.ttft = Histogram(
            "rose_time_to_first_token_seconds",
            "Seconds from a job's start on the worker to its first token.",
            ln,
            registry=reg,
            buckets=LATENCY_BUCKETS,
        ).labels(*lv)
        self.itl = WeightedHistogram(
            "rose_inter_token_latency_seconds",
            "Seconds between consecutive tokens of a job.",
            TOKEN_BUCKETS,
            {"model_name": model},
        )
        reg.register(self.itl)  # type: ignore[arg-type]
        self.e2e = Histogram(
            "rose_e2e_request_latency_seconds",
            "Seconds from enqueue to result for finished jobs (start to result when the enqueue time is unknown).",
            ln,
            registry=reg,
            buckets=(*LATENCY_BUCKETS, 1800.0, 3600.0),
        ).labels(*lv)
        self.step_time = Histogram(
            "rose_engine_step_time_seconds",
            "Seconds per engine step (one batched forward).",
            ln,
            registry=reg,
            buckets=STEP_BUCKETS,
        ).labels(*lv)
        self._prefix_seen = (0, 0)
        self._preemptions_seen = 0
        self._next_prefix_read = 0.0
        self._last_step_wall = 0.0
        self._rate_mark = (time.monotonic(), 0)
        self.tokens_per_s = 0.0
        self.generated = 0  # plain int twin of generation_tokens, for the rate

    def _success_child(self, reason: str) -> Any:
        child = self._success_children.get(reason)
        if child is None:
            child = self._success_children[reason] = self.success.labels(self.model, reason)
        return child

    # ---- per step -----------------------------------------------------------------------------------------

    def on_step(self, engine: WorkerEngine, step_s: float, tokens: int, steady: int, now: float) -> None:
        """One engine step: `tokens` generated in all, `steady` of them by jobs that also got one in the
        previous step (their inter-token interval is the time between the two steps)."""
        self.step_time.observe(step_s)
        if tokens:
            self.generation_tokens.inc(tokens)
            self.generated += tokens
        if steady and self._last_step_wall:
            self.itl.observe(now - self._last_step_wall, steady)
        self._last_step_wall = now
        self.gauges(engine)
        if now >= self._next_prefix_read:
            self._next_prefix_read = now + PREFIX_STATS_EVERY_S
            self.read_prefix_stats(engine)

    def gauges(self, engine: WorkerEngine) -> None:
        self.running.set(int(engine.num_running))
        self.waiting.set(int(engine.num_waiting))
        total = int(engine.kv_blocks_total)
        if total:  # a stand-in without a paged store has none
            self.kv_usage.set(int(engine.kv_blocks_used) / total)

    def read_prefix_stats(self, engine: WorkerEngine) -> None:
        stats = engine.get_stats()
        preempted = int(stats.get("num_preemptions", 0))
        if preempted > self._preemptions_seen:
            self.preemptions.inc(preempted - self._preemptions_seen)
            self._preemptions_seen = preempted
        if self.lora is not None:
            self.lora.read_stats(stats)
        if "prefix_cache_query_tokens" not in stats:
            return
        queries, hits = int(stats["prefix_cache_query_tokens"]), int(stats["prefix_cache_hit_tokens"])
        seen_q, seen_h = self._prefix_seen
        if queries > seen_q:
            self.prefix_queries.inc(queries - seen_q)
        if hits > seen_h:
            self.prefix_hits.inc(hits - seen_h)
        self._prefix_seen = (max(queries, seen_q), max(hits, seen_h))

    def rate(self) -> float:
        """Tokens per second generated since the previous call (the info hash's `tokens_per_s`)."""
        t = time.monotonic()
        t0, n0 = self._rate_mark
        if t - t0 >= 0.5:
            self.tokens_per_s = (self.generated - n0) / (t - t0)
            self._rate_mark = (t, self.generated)
        return self.tokens_per_s

    # ---- per job ------------------------------------------------------------------------------------------

    def on_deadline_exceeded(self, started: bool) -> None:
        self.deadline_exceeded["running" if started else "queued"].inc()

    def on_started(self, queue_s: float | None) -> None:
        if queue_s is not None:
            self.queue_time.observe(queue_s)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(max(0.0, ttft_s))

    def on_success(self, result: JobResult) -> None:
        self._success_child(str(result.get("finish_reason") or "stop")).inc()
        self.prompt_tokens.inc(int(result["usage"]["prompt_tokens"]))
        m = result["metrics"]
        self.e2e.observe((m["queue_s"] or 0.0) + m["generation_s"])


class HealthServer:
    """`/metrics` (Prometheus text format), `/health` (200 + JSON while `check()` says ok, else 503) and
    `/health/live` (the same body; 503 only when the body's `loop_alive` is false)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        check: Callable[[], tuple[bool, dict[str, Any]]],
        host: str,
        port: int,
    ) -> None:
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "/").rstrip("/")
            if path in ("/health", "/health/live"):
                ok, body = check()
                if path == "/health/live":  # liveness only: the loop turns (Redis may be down)
                    ok = bool(body.get("loop_alive", ok))
                status = "200 OK" if ok else "503 Service Unavailable"
                start_response(status, [("Content-Type", "application/json")])
                return [json.dumps(body).encode()]
            return metrics_app(environ, start_response)

        self.httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
        self.port = int(self.httpd.server_port)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="rose-metrics", daemon=True)

    def start(self) -> HealthServer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("metrics server: " + format, *args)


def for_worker(worker: Any) -> WorkerMetrics:
    """The metrics of a RoseWorker, labelled from its engine and settings."""
    from rose import __version__

    engine = worker.engine
    return WorkerMetrics(
        name=worker.name,
        model=str(engine.model_name),
        device=str(engine.device),
        dtype=dtype_name(engine),
        queues=worker.queue_names(),
        version=__version__,
    )


def dtype_name(engine: WorkerEngine) -> str:
    """The engine's dtype as written in the info hash and /metrics ("bfloat16"; "" for a stand-in's None)."""
    return str(engine.dtype or "").removeprefix("torch.")


def health(worker: Any) -> tuple[bool, dict[str, Any]]:
    """Healthy while the loop came round within --health-timeout and the last Redis call worked."""
    age = time.monotonic() - worker.loop_beat
    alive = age <= worker.settings.health_timeout and not worker.stopped
    ok = alive and worker.redis_ok
    body = {
        "status": "ok" if ok else "unhealthy",
        "worker": worker.name,
        "loop_age_s": round(age, 3),
        "loop_alive": alive,
        "redis_ok": worker.redis_ok,
        "running_jobs": len(worker.running),
        "draining": worker.draining,
    }
    return ok, body


def serve(worker: Any) -> HealthServer | None:
    """Start the worker's /metrics + /health server when --metrics-port is set (0: any free port)."""
    settings = worker.settings
    if settings.metrics_port is None:
        return None
    server = HealthServer(
        worker.metrics.registry, lambda: health(worker), settings.metrics_host, settings.metrics_port
    )
    log.info("metrics on http://%s:%d/metrics, health on /health", settings.metrics_host, server.port)
    return server.start()
