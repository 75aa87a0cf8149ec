"""Latency under load as a user sees it: Poisson arrivals, and one subscriber timestamping every event on receipt.

A producer thread submits requests at exponential gaps (mean 1/rate) and one pub/sub connection (PSUBSCRIBE
`rose:tokens:*`) timestamps each event: TTFT = first token event - submit, ITL = gap between successive token events
of a job (per event; an event may carry several tokens, see `tokens_per_event`), TPOT = (E2E - TTFT) / (tokens - 1)
per request, E2E = done - submit.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

from rose.bench.workload import Workload

PERCENTILES = (50, 90, 99)


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


class _Subscriber(threading.Thread):
    """One PSUBSCRIBE `rose:tokens:*` connection; records (receipt time, type, tokens) per job id."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(name="rose-bench-subscriber", daemon=True)
        from rose.jobs import keys
        from rose.jobs.connection import connect

        self._r = connect(redis_url)
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
        from rose.jobs import keys

        while not self._halt.is_set():
            msg = self._pubsub.get_message(timeout=0.2)
            if msg is None or msg["type"] != "pmessage":
                continue
            now = time.perf_counter()
            event = json.loads(msg["data"])
            kind = event.get("type", "")
            job_id = keys.job_id_of_channel(msg["channel"])  # events name no job: their channel does
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


def run_latency(
    client: Any,
    redis_url: str,
    workload: Workload,
    fields: list[dict[str, Any]],
    prefix: str,
    rate: float,
    seed: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Submit `fields` (the workload's jobs, ids `prefix` + request id) at Poisson arrivals of `rate` req/s; returns
    the latency summary (times in ms)."""
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
