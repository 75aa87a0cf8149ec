"""rose end to end (a real redis-server + a `rose-worker` process) vs rose's engine alone, plus latency under load.

Throughput: the whole workload is submitted at once (`Client.submit_many`, greedy, EOS ignored, the workload's
max_tokens) to a warmed-up worker; the clock runs from the submission to the last result read back. Then the
engine alone (`rose_runner.run_rose`) runs the same workload in this process, with the same thread setting, while
the worker idles (blocked on its queue), so the two never compete for the CPUs. With `repeats` > 1 the two
alternate, pass after pass, and medians are compared: a shared machine's drift hits both alike.

Latency (`rate > 0`): a producer thread submits requests at Poisson arrivals (exponential gaps, mean 1/rate) and
one pub/sub connection (PSUBSCRIBE `rose:tokens:*`) timestamps each event on receipt, as a user would see it:
TTFT = first token event - submit, ITL = gap between successive token events of a job (per event; an event may
carry several tokens, see `tokens_per_event`), TPOT = (E2E - TTFT) / (tokens - 1) per request, E2E = done - submit.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rose.bench.common import RunResult, cpu_busy_fraction, environment, load_model, make_result, set_threads
from rose.bench.rose_runner import RoseConfig, run_rose
from rose.bench.worker_procs import RedisProcess, WorkerProcess
from rose.bench.workload import Workload, make_workload

logger = logging.getLogger(__name__)

WORKER, ENGINE = "rose-worker", "rose-engine"
TARGET_RATIO = 0.9
PERCENTILES = (50, 90, 99)
JOB_TIMEOUT_S = 900


@dataclass
class WorkerBenchConfig:
    model: str = "tiny-llama"
    num_requests: int = 128
    prompt_len_range: tuple[int, int] = (16, 128)
    output_len_range: tuple[int, int] = (16, 128)
    seed: int = 0
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    num_threads: int | None = None
    rate: float = 0.0  # requests/s of the latency run; 0: no latency run
    latency_requests: int = 64
    skip_engine: bool = False
    repeats: int = 1  # worker and engine passes alternate; medians are compared
    warmup_requests: int = 8
    timeout_s: float = 600.0  # per phase


@dataclass
class WorkerBenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    workload: dict[str, Any]
    systems: dict[str, RunResult] = field(default_factory=dict)
    ratio: float | None = None  # median worker tok/s / median engine tok/s
    pass_ratios: list[float] = field(default_factory=list)  # worker / engine of each pair of adjacent passes

    @property
    def paired_ratio(self) -> float | None:
        """Median of the per-pair ratios: each worker pass against the engine pass run next to it, so a machine
        whose speed drifts over the run (shared VMs: ±10% within minutes) skews it less than the ratio of medians."""
        return statistics.median(self.pass_ratios) if self.pass_ratios else None

    agreement: float | None = None  # share of requests with identical greedy outputs, worker vs engine
    latency: dict[str, Any] | None = None
    processes: dict[str, Any] = field(default_factory=dict)
    load_average: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "worker",
            "config": self.config,
            "environment": self.environment,
            "workload": self.workload,
            "systems": {k: v.to_dict() for k, v in self.systems.items()},
            "worker_vs_engine_tokens_per_s": self.ratio,
            "worker_vs_engine_per_pass": self.pass_ratios,
            "worker_vs_engine_paired_median": self.paired_ratio,
            "target_ratio": TARGET_RATIO,
            "greedy_identical_share": self.agreement,
            "latency": self.latency,
            "processes": self.processes,
            "load_average": self.load_average,
        }


def percentiles(values: list[float], qs: tuple[int, ...] = PERCENTILES) -> dict[str, float]:
    """p50/p90/p99 (linear interpolation between order statistics), plus mean, min, max and count."""
    if not values:
        return {"count": 0}
    xs = sorted(values)
    out: dict[str, float] = {"count": len(xs), "mean": sum(xs) / len(xs), "min": xs[0], "max": xs[-1]}
    for q in qs:
        pos = (len(xs) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def model_len_for(workload: Workload) -> int:
    """The context limit rose_runner gives the engine alone: the longest request, rounded up, plus 64."""
    return -(-workload.max_total_len // 64) * 64 + 64


def _job_fields(workload: Workload, prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "prompt_token_ids": list(r.prompt_token_ids),
            "max_tokens": r.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "job_id": f"{prefix}{r.request_id}",
            "job_timeout": JOB_TIMEOUT_S,
        }
        for r in workload.requests
    ]


def _run_all_at_once(
    client: Any, workload: Workload, prefix: str, timeout_s: float
) -> tuple[dict[str, list[int]], float, dict[str, Any]]:
    """Submit every request in one round trip, wait for every result; (outputs by request id, wall seconds)."""
    fields = _job_fields(workload, prefix)
    start = time.perf_counter()
    jobs = client.submit_many(fields)
    outputs: dict[str, list[int]] = {}
    queue_s: list[float] = []
    results = client.results(jobs, timeout=timeout_s)  # as a batch producer waits: all at once
    for req, result in zip(workload.requests, results, strict=True):
        outputs[req.request_id] = list(result["token_ids"])
        queue_s.append(float((result.get("metrics") or {}).get("queue_s", float("nan"))))
    wall = time.perf_counter() - start
    # The worker's own view: how long jobs waited in the queue before the engine took them.
    return outputs, wall, {"queue_s": percentiles(queue_s)}


class _Subscriber(threading.Thread):
    """One PSUBSCRIBE `rose:tokens:*` connection; records (receipt time, type, tokens) per job id."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(name="rose-bench-subscriber", daemon=True)
        import redis

        from rose.jobs import keys

        self._r = redis.Redis.from_url(redis_url)
        self._pubsub = self._r.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(keys.TOKENS_CHANNEL_PREFIX + "*")
        # Wait for the subscription to be confirmed, so that no event of the first job is missed.
        deadline = time.monotonic() + 10
        while not self._pubsub.subscribed and time.monotonic() < deadline:
            self._pubsub.get_message(timeout=0.1)
        while time.monotonic() < deadline:
            msg = self._pubsub.get_message(ignore_subscribe_messages=False, timeout=0.1)
            if msg is None or msg["type"] == "psubscribe":
                break
        self.events: dict[str, list[tuple[float, str, int]]] = {}
        self.ended: set[str] = set()
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._halt.is_set():
            msg = self._pubsub.get_message(timeout=0.2)
            if msg is None or msg["type"] != "pmessage":
                continue
            now = time.perf_counter()
            event = json.loads(msg["data"])
            kind = event.get("type", "")
            job_id = event.get("job_id", "")
            with self._lock:
                if kind == "reset":
                    self.events[job_id] = []
                    continue
                self.events.setdefault(job_id, []).append((now, kind, len(event.get("token_ids") or ())))
                if kind in ("done", "error", "canceled"):
                    self.ended.add(job_id)

    def count_ended(self, ids: set[str]) -> int:
        with self._lock:
            return len(self.ended & ids)

    def close(self) -> None:
        self._halt.set()
        self.join(5)
        self._pubsub.close()
        self._r.close()


def run_latency(client: Any, redis_url: str, workload: Workload, rate: float, seed: int, timeout_s: float):
    """Poisson arrivals at `rate` req/s; returns the latency summary (times in ms)."""
    prefix = f"lat-{uuid.uuid4().hex[:6]}-"
    fields = _job_fields(workload, prefix)
    rng = random.Random(seed)
    submit_at: dict[str, float] = {}
    sub = _Subscriber(redis_url)
    sub.start()
    ids = {f["job_id"] for f in fields}
    errors: list[BaseException] = []

    def produce() -> None:
        t = time.perf_counter()
        try:
            for f in fields:
                t += rng.expovariate(rate)
                delay = t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                submit_at[f["job_id"]] = time.perf_counter()
                client.submit(**f)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    start = time.perf_counter()
    producer = threading.Thread(target=produce, name="rose-bench-producer", daemon=True)
    producer.start()
    deadline = time.monotonic() + timeout_s
    try:
        while sub.count_ended(ids) < len(ids) and time.monotonic() < deadline and not errors:
            time.sleep(0.02)
        wall = time.perf_counter() - start
        producer.join(max(0.0, deadline - time.monotonic()))
    finally:
        sub.close()
    if errors:
        raise RuntimeError(f"submitting the latency run failed: {errors[0]!r}") from errors[0]
    return summarize_latency(workload, prefix, submit_at, sub.events, rate, wall)


def summarize_latency(
    workload: Workload,
    prefix: str,
    submit_at: dict[str, float],
    events: dict[str, list[tuple[float, str, int]]],
    rate: float,
    wall_s: float,
) -> dict[str, Any]:
    ttft, itl, tpot, e2e = [], [], [], []
    tokens_total = token_events = done = 0
    short: list[str] = []
    for req in workload.requests:
        job_id = prefix + req.request_id
        evs = events.get(job_id, [])
        t0 = submit_at.get(job_id)
        tok = [(t, n) for t, kind, n in evs if kind == "token"]
        ntok = sum(n for _, n in tok)
        end = [t for t, kind, _ in evs if kind == "done"]
        tokens_total += ntok
        token_events += len(tok)
        if ntok != req.max_tokens or not end or t0 is None:
            short.append(req.request_id)
        if t0 is None or not tok:
            continue
        ttft.append((tok[0][0] - t0) * 1000)
        itl += [(b[0] - a[0]) * 1000 for a, b in zip(tok, tok[1:], strict=False)]
        if end:
            done += 1
            e2e.append((end[0] - t0) * 1000)
            if ntok > 1:
                tpot.append((end[0] - tok[0][0]) * 1000 / (ntok - 1))
    return {
        "rate_req_per_s": rate,
        "num_requests": len(workload),
        "completed": done,
        "requested_tokens": workload.requested_tokens,
        "received_tokens": tokens_total,
        "token_counts_ok": not short,
        "short_requests": short[:20],
        "tokens_per_event": tokens_total / token_events if token_events else float("nan"),
        "wall_s": wall_s,
        "achieved_requests_per_s": done / wall_s if wall_s > 0 else float("nan"),
        "achieved_tokens_per_s": tokens_total / wall_s if wall_s > 0 else float("nan"),
        "ttft_ms": percentiles(ttft),
        "itl_ms_per_event": percentiles(itl),
        "tpot_ms_per_token": percentiles(tpot),
        "e2e_ms": percentiles(e2e),
    }


def _load() -> list[float]:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_worker_bench(
    cfg: WorkerBenchConfig, progress: Callable[[str], None] | None = None
) -> WorkerBenchReport:
    from rose.jobs.client import Client

    say = progress or (lambda m: logger.info("%s", m))
    threads = set_threads(cfg.num_threads)
    workload = make_workload(cfg.num_requests, cfg.prompt_len_range, cfg.output_len_range, seed=cfg.seed)
    lat_wl = None
    if cfg.rate > 0:
        lat_wl = make_workload(
            cfg.latency_requests, cfg.prompt_len_range, cfg.output_len_range, seed=cfg.seed + 1
        )
    max_len = max(model_len_for(workload), model_len_for(lat_wl) if lat_wl else 0)
    report = WorkerBenchReport(config=asdict(cfg), environment=environment(), workload=workload.describe())
    report.load_average["before"] = _load()
    report.processes["cpu_busy_before"] = cpu_busy_fraction()
    queue = f"rose-bench-{uuid.uuid4().hex[:8]}"
    say(f"starting redis-server and rose-worker (queue {queue}, {threads} torch threads)")
    with RedisProcess() as server:
        report.processes["redis_pid"] = server.pid
        with WorkerProcess(
            server.url,
            queue,
            f"bench-{uuid.uuid4().hex[:6]}",
            model=cfg.model,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_threads=threads,
        ) as worker:
            report.processes["worker_pid"] = worker.pid
            report.processes["worker_command"] = worker.command
            client = Client(server.url, queue=queue)
            try:
                if cfg.warmup_requests > 0:
                    say(f"warming the worker up ({cfg.warmup_requests} requests)")
                    _run_all_at_once(client, workload.head(cfg.warmup_requests), "warmup-", cfg.timeout_s)
                worker_runs, engine_runs = [], []
                for rep in range(cfg.repeats):
                    tag = f"[{rep + 1}/{cfg.repeats}] " if cfg.repeats > 1 else ""
                    # each pair in turn starts with the worker and with the engine: a machine speeding up or
                    # slowing down over the run favours neither
                    engine_first = rep % 2 == 1 and not cfg.skip_engine
                    if engine_first:
                        say(f"{tag}engine alone: {len(workload)} requests in this process (the worker idles)")
                        engine_runs.append(_engine_pass(cfg, workload, max_len))
                    say(f"{tag}worker: {len(workload)} requests at once")
                    outputs, wall, extra = _run_all_at_once(client, workload, f"tp{rep}-", cfg.timeout_s)
                    worker_runs.append(
                        make_result(
                            WORKER,
                            workload,
                            outputs,
                            wall,
                            settings={"queue": queue, "max_model_len": max_len},
                            extra=extra,
                        )
                    )
                    if not cfg.skip_engine and not engine_first:
                        say(f"{tag}engine alone: {len(workload)} requests in this process (the worker idles)")
                        engine_runs.append(_engine_pass(cfg, workload, max_len))
                if lat_wl is not None:
                    say(f"latency: {len(lat_wl)} requests, Poisson arrivals at {cfg.rate} req/s")
                    report.latency = run_latency(
                        client, server.url, lat_wl, cfg.rate, cfg.seed, cfg.timeout_s
                    )
            finally:
                client.redis.close()
    say("worker and redis-server stopped")
    report.systems[WORKER] = _median_run(worker_runs)
    if engine_runs:
        report.systems[ENGINE] = _median_run(engine_runs)
        w, e = report.systems[WORKER], report.systems[ENGINE]
        report.ratio = w.tokens_per_s / e.tokens_per_s
        report.pass_ratios = [
            a.tokens_per_s / b.tokens_per_s for a, b in zip(worker_runs, engine_runs, strict=True)
        ]
        same = sum(w.outputs.get(r.request_id) == e.outputs.get(r.request_id) for r in workload.requests)
        report.agreement = same / len(workload)
    report.load_average["after"] = _load()
    return report


def _engine_pass(cfg: WorkerBenchConfig, workload: Workload, max_len: int) -> RunResult:
    model, tokenizer = load_model(cfg.model, seed=0)
    rose_cfg = RoseConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=max_len,
        warmup_requests=cfg.warmup_requests,
        detokenize=True,  # the same work the worker does: it publishes and stores text
    )
    result = run_rose(model, tokenizer, workload, rose_cfg)
    result.name = ENGINE
    return result


def _median_run(runs: list[RunResult]) -> RunResult:
    """The pass with the median wall time (the lower middle one for an even count); every wall time in extra."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    median = ordered[(len(ordered) - 1) // 2]
    median.extra["pass_wall_s"] = [r.wall_s for r in runs]
    return median


def throughput_rows(report: WorkerBenchReport) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "system",
        "requests/s",
        "generated tok/s",
        "wall s",
        "tokens credited",
        "counts ok",
        "vs engine",
    ]
    engine = report.systems.get(ENGINE)
    rows = []
    for name, s in report.systems.items():
        ratio = s.tokens_per_s / engine.tokens_per_s if engine is not None else float("nan")
        rows.append(
            [
                name,
                s.requests_per_s,
                s.tokens_per_s,
                s.wall_s,
                s.generated_tokens,
                "yes" if s.token_counts_ok else "NO",
                ratio,
            ]
        )
    return headers, rows


def latency_rows(latency: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["metric (ms)", "p50", "p90", "p99", "mean", "max", "samples"]
    rows = []
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("itl_ms_per_event", "ITL (per event)"),
        ("tpot_ms_per_token", "TPOT (per token)"),
        ("e2e_ms", "E2E"),
    ):
        p = latency[key]
        nan = float("nan")
        rows.append(
            [label, *(float(p.get(k, nan)) for k in ("p50", "p90", "p99", "mean", "max")), p.get("count", 0)]
        )
    return headers, rows
