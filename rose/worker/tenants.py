"""What the worker served each tenant: the fair-share charges it owes the fleet's counters, and the per-tenant figures
on /metrics, in the info hash and in `rose status`.

A take charges each job's tenant its prompt's expected tokens at once (rose.worker.fair_queue: `prepaid`), so that
workers taking at the same moment see each other's picks. Then each job is settled as it is served: `on_tokens`
(generated) and `on_ended` (its prompt tokens, once the engine has counted them) charge what goes beyond the advance,
and `release` (the job ended, or left this worker) refunds what the advance overcharged. The charges, tokens / weight
by tenant, wait in `pending` until the next take adds them to the counters in Redis (`take_pending`), or `flush`
does (one round trip) when no take came for `flush_every` seconds. `typical()` is the mean tokens a job of this
worker generated so far.

Labels: the first `MAX_LABELS` tenants seen get their own series on /metrics and row in the info hash; the others
share `(other)` (a tenant per end user would otherwise grow them without bound). The counters in Redis are exact
for every tenant.
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

from rose.worker import fair_queue

if TYPE_CHECKING:
    from redis import Redis

    from rose.worker.metrics import WorkerMetrics
    from rose.worker.running import Running

WAITS_KEPT = 1000  # queue waits kept per tenant, for the info hash's p50 / p99
MAX_LABELS = 100  # tenants with series of their own on /metrics
OTHER = "(other)"
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 86400)


def tenant_of(run: Running) -> str:
    request = run.request
    tenant = request.tenant if request is not None else None
    return tenant or fair_queue.DEFAULT_TENANT


@dataclass(slots=True)
class JobAccount:
    """One job's account: its tenant, the tokens charged in advance, the tokens served so far."""

    tenant: str
    prepaid: float = 0.0
    served: int = 0


class Tenants:
    """The worker's per-tenant accounts. `weights`: --tenant-weight (1 unless named)."""

    def __init__(
        self, weights: Mapping[str, float], metrics: WorkerMetrics, flush_every: float = 0.25
    ) -> None:
        self.weights = dict(weights)
        self.flush_every = flush_every
        self.tokens: dict[str, int] = collections.Counter()  # served here: prompt + generated, by label
        self.pending: dict[str, float] = collections.Counter()  # owed to the counters: tokens / weight
        self.waits: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=WAITS_KEPT)
        )
        self._jobs: dict[str, JobAccount] = {}
        self._labels: set[str] = set()
        self._queued: set[str] = set()  # labels the queued gauge was set for
        self._jobs_ended = 0
        self._generated_ended = 0
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
        self._queued_gauge = Gauge(
            "rose_tenant_queued", "Jobs of each tenant waiting in this worker's queues.", labels, registry=reg
        )
        self._model = model
        self._token_children: dict[str, Any] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def label(self, tenant: str) -> str:
        """The tenant's name on /metrics and in the info hash: its own for the first MAX_LABELS, else OTHER."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < MAX_LABELS:
            self._labels.add(tenant)
            return tenant
        return OTHER

    # ---- what jobs did ---------------------------------------------------------------------------------------

    def prepaid(self, job_id: str, tenant: str, tokens: float) -> None:
        self.release(job_id)  # taken again (requeued behind our back): the earlier advance settles first
        self._jobs[job_id] = JobAccount(tenant, tokens)

    def on_taken(self, run: Running) -> None:
        tenant = tenant_of(run)
        account = self._jobs.setdefault(run.id, JobAccount(tenant))
        account.tenant = tenant  # as the contract read it (a take read the same field)
        if run.queue_s is not None:
            label = self.label(tenant)
            self.waits[label].append(run.queue_s)
            self._wait.labels(self._model, label).observe(run.queue_s)

    def on_tokens(self, run: Running, n: int) -> None:
        self._serve(run, n)

    def on_ended(self, run: Running, prompt_tokens: int, generated: int) -> None:
        self._serve(run, prompt_tokens)
        self._jobs_ended += 1
        self._generated_ended += generated
        self.release(run.id)

    def release(self, job_id: str) -> None:
        """The job ended or left this worker: refund what its advance charged beyond what it was served."""
        account = self._jobs.pop(job_id, None)
        if account is not None and account.served < account.prepaid:
            self.pending[account.tenant] -= (account.prepaid - account.served) / self.weight(account.tenant)

    def _serve(self, run: Running, n: int) -> None:
        if not n:
            return
        account = self._jobs.setdefault(run.id, JobAccount(tenant_of(run)))
        beyond = max(0.0, account.served + n - max(account.prepaid, account.served))
        account.served += n
        label = self.label(account.tenant)
        self.tokens[label] += n
        child = self._token_children.get(label)
        if child is None:  # labels() per job and step would cost the loop a lock and a lookup each
            child = self._token_children[label] = self._tokens.labels(self._model, label)
        child.inc(n)
        if beyond:
            self.pending[account.tenant] += beyond / self.weight(account.tenant)

    def typical(self) -> float | None:
        return self._generated_ended / self._jobs_ended if self._jobs_ended else None

    def take_pending(self) -> dict[str, float]:
        pending = {tenant: amount for tenant, amount in self.pending.items() if amount}
        self.pending.clear()
        return pending

    def owe(self, charges: Mapping[str, float]) -> None:
        for tenant, amount in charges.items():
            self.pending[tenant] += amount

    # ---- Redis -----------------------------------------------------------------------------------------------

    def flush(self, conn: Redis, now: float | None = None) -> None:
        """The pending charges to the fleet's counters (one round trip), if `flush_every` has passed since the last
        flush (None `now`: at once). A Redis error keeps them pending."""
        if not self.pending or (now is not None and now < self._next_flush):
            return
        fair_queue.charge(conn, {tenant: amount for tenant, amount in self.pending.items() if amount})
        self.pending.clear()
        self._next_flush = (time.monotonic() if now is None else now) + self.flush_every

    def read_queued(self, conn: Redis, queue_names: Iterable[str]) -> None:
        """/metrics' rose_tenant_queued from the queues' fair-share indexes (0 for a tenant no longer waiting)."""
        queued: dict[str, int] = collections.Counter()
        for name in queue_names:
            for tenant, n in fair_queue.waiting(conn, name).items():
                queued[self.label(tenant)] += n
        for label in self._queued | set(queued):
            self._queued_gauge.labels(self._model, label).set(queued.get(label, 0))
        self._queued = set(queued) | self._queued

    # ---- reports ---------------------------------------------------------------------------------------------

    def info(self, running: Iterable[Running]) -> dict[str, Any]:
        """The info hash's `tenants` field (JSON by tenant: running, tokens, wait_p50, wait_p99); also sets the
        running gauge."""
        counts = collections.Counter(self.label(tenant_of(run)) for run in running)
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
