"""What the worker served each tenant: the fair-share charges it owes the fleet's counters, and the per-tenant figures
on /metrics, in the info hash and in `rose status`.

`on_taken` (a job started: its queue wait), `on_tokens` (generated), `on_ended` (its prompt tokens, once the engine
has counted them) feed `pending`: tokens / weight by tenant, which the next take adds to the counters in Redis
(rose.worker.fair_queue, `take_pending`), or `flush` (rose.worker.fair_queue.charge) at most every `flush_every`
seconds when no take came first, one round trip for every tenant. `estimate()`
is the mean tokens a job of this worker has cost so far, what a take counts for each job it hands a tenant before
the job's tokens are known.
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

from rose.worker import fair_queue

if TYPE_CHECKING:
    from redis import Redis

    from rose.worker.metrics import WorkerMetrics
    from rose.worker.running import Running

WAITS_KEPT = 1000  # queue waits kept per tenant, for the info hash's p50 / p99
FIRST_ESTIMATE = 256.0  # tokens a job is expected to cost before any has ended here
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 86400)


def tenant_of(run: Running) -> str:
    request = run.request
    tenant = request.tenant if request is not None else None
    return tenant or fair_queue.DEFAULT_TENANT


class Tenants:
    """The worker's per-tenant accounts. `weights`: --tenant-weight (1 unless named)."""

    def __init__(
        self, weights: Mapping[str, float], metrics: WorkerMetrics, flush_every: float = 0.25
    ) -> None:
        self.weights = dict(weights)
        self.flush_every = flush_every
        self.tokens: dict[str, int] = collections.Counter()  # served here: prompt + generated
        self.pending: dict[str, float] = collections.Counter()  # owed to the counters: tokens / weight
        self.waits: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=WAITS_KEPT)
        )
        self._jobs_ended = 0
        self._tokens_ended = 0
        self._next_flush = 0.0
        reg, model = metrics.registry, metrics.model
        labels = ["model_name", "tenant"]
        self._tokens = Counter(
            "rose_tenant_tokens", "Tokens served to each tenant: prompt and generated.", labels, registry=reg
        )
        self._wait = Histogram(
            "rose_tenant_queue_wait_seconds",
            "Seconds each tenant's jobs waited on the queue before a worker took them.",
            labels,
            buckets=WAIT_BUCKETS,
            registry=reg,
        )
        self._running = Gauge(
            "rose_tenant_running", "Jobs of each tenant running here.", labels, registry=reg
        )
        self._queued = Gauge(
            "rose_tenant_queued", "Jobs of each tenant waiting in this worker's queues.", labels, registry=reg
        )
        self._model = model

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    # ---- what jobs did ---------------------------------------------------------------------------------------

    def on_taken(self, tenant: str, queue_s: float | None) -> None:
        if queue_s is not None:
            self.waits[tenant].append(queue_s)
            self._wait.labels(self._model, tenant).observe(queue_s)

    def on_tokens(self, tenant: str, n: int) -> None:
        self._serve(tenant, n)

    def on_ended(self, tenant: str, prompt_tokens: int, generated: int) -> None:
        self._serve(tenant, prompt_tokens)
        self._jobs_ended += 1
        self._tokens_ended += prompt_tokens + generated

    def _serve(self, tenant: str, n: int) -> None:
        if n:
            self.tokens[tenant] += n
            self.pending[tenant] += n / self.weight(tenant)
            self._tokens.labels(self._model, tenant).inc(n)

    def estimate(self) -> float:
        return self._tokens_ended / self._jobs_ended if self._jobs_ended else FIRST_ESTIMATE

    def take_pending(self) -> dict[str, float]:
        pending = dict(self.pending)
        self.pending.clear()
        return pending

    def put_back(self, charges: Mapping[str, float]) -> None:
        for tenant, amount in charges.items():
            self.pending[tenant] += amount

    # ---- Redis -----------------------------------------------------------------------------------------------

    def flush(self, conn: Redis, now: float | None = None, force: bool = False) -> None:
        """The pending charges to the fleet's counters, if `flush_every` has passed (or `force`). A Redis error
        keeps them pending."""
        now = time.monotonic() if now is None else now
        if not self.pending or (now < self._next_flush and not force):
            return
        fair_queue.charge(conn, self.pending)
        self.pending.clear()
        self._next_flush = now + self.flush_every

    def read_queued(self, conn: Redis, queue_names: Iterable[str]) -> None:
        """/metrics' rose_tenant_queued from the queues' fair-share indexes."""
        queued: dict[str, int] = collections.Counter()
        for name in queue_names:
            for tenant, n in fair_queue.waiting(conn, name).items():
                queued[tenant] += n
        for tenant, n in queued.items():
            self._queued.labels(self._model, tenant).set(n)

    # ---- reports ---------------------------------------------------------------------------------------------

    def info(self, running: Iterable[Running]) -> dict[str, Any]:
        """The info hash's `tenants` field (JSON by tenant: running, tokens, wait_p50, wait_p99); also sets the
        running gauge."""
        counts = collections.Counter(tenant_of(run) for run in running)
        report: dict[str, dict[str, float | int]] = {}
        for tenant in sorted(set(counts) | set(self.tokens) | set(self.waits)):
            self._running.labels(self._model, tenant).set(counts[tenant])
            row: dict[str, float | int] = {"running": counts[tenant], "tokens": self.tokens[tenant]}
            waits = self.waits.get(tenant)
            if waits:
                row["wait_p50"], row["wait_p99"] = quantiles(waits)
            report[tenant] = row
        return {"tenants": json.dumps(report)} if report else {}


def quantiles(values: Iterable[float]) -> tuple[float, float]:
    """(p50, p99) of `values` (nearest rank), rounded to the millisecond."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return round(ordered[0], 3), round(ordered[0], 3)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return round(p50, 3), round(p99, 3)
