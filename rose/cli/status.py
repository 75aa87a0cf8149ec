"""`rose status`: queues and workers, from what RQ and the rose-workers keep in Redis."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC
from typing import Any

from rose.cli.common import add_redis_args, connect

_WORKER_INT_FIELDS = (
    "max_num_seqs",
    "max_model_len",
    "running_jobs",
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
)
_WORKER_FLOAT_FIELDS = ("tokens_per_s", "started_at", "updated_at")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="show queues (queued / running / finished / failed) and workers",
        description=(
            "Queues: queued, running (RQ's started registry), finished, failed and canceled job counts. "
            "Workers: every RQ worker, with the engine counters rose-workers publish in rose:worker:<name>."
        ),
    )
    add_redis_args(p, queue=False)
    p.add_argument(
        "--queue", action="append", default=None, help="show only this queue (repeatable; default: all)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    p.set_defaults(func=run)


def _decode(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def collect(conn: Any, only: list[str] | None = None) -> dict[str, Any]:
    """{"queues": [...], "workers": [...]}; worker fields missing from a (older) worker are left out."""
    from rq import Queue, Worker
    from rq.serializers import JSONSerializer

    queues = []
    every = sorted(Queue.all(connection=conn, serializer=JSONSerializer), key=lambda q: q.name)
    running = _running_by_worker(conn, every)
    for q in every:
        if only and q.name not in only:
            continue
        queues.append(
            {
                "name": q.name,
                "queued": q.count,
                # counts without RQ's cleanup (which would fail expired entries as a side effect)
                "running": q.started_job_registry.get_job_count(cleanup=False),
                "finished": q.finished_job_registry.get_job_count(cleanup=False),
                "failed": q.failed_job_registry.get_job_count(cleanup=False),
                "canceled": q.canceled_job_registry.get_job_count(cleanup=False),
            }
        )
    for name in only or []:
        if name not in {q["name"] for q in queues}:
            queues.append(
                {"name": name, "queued": 0, "running": 0, "finished": 0, "failed": 0, "canceled": 0}
            )

    now = time.time()
    workers = []
    for w in sorted(Worker.all(connection=conn, serializer=JSONSerializer), key=lambda w: w.name):
        raw = {_decode(k): _decode(v) for k, v in conn.hgetall(f"rose:worker:{w.name}").items()}
        info: dict[str, Any] = {
            "name": w.name,
            "state": _decode(w.get_state()),
            "queues": [q.name for q in w.queues],
            "rose": bool(raw),
        }
        for key, value in raw.items():
            info[key] = _number(key, value)
        # now, from RQ's started registries: the worker's own count is as old as its last heartbeat
        info["running_jobs"] = running.get(w.name, 0)
        if isinstance(info.get("queues"), str):
            info["queues"] = [q for q in info["queues"].replace(",", " ").split() if q]
        started = info.get("started_at")
        if not isinstance(started, float) and w.birth_date is not None:
            birth = w.birth_date if w.birth_date.tzinfo else w.birth_date.replace(tzinfo=UTC)
            started = birth.timestamp()
        if isinstance(started, float):
            info["uptime_s"] = round(max(0.0, now - started), 1)
        if only and not set(info["queues"]) & set(only):
            continue
        workers.append(info)
    return {
        "queues": queues,
        "workers": workers,
        "tenants": _tenants(conn, [q["name"] for q in queues], workers),
    }


def _tenants(conn: Any, queue_names: list[str], workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per tenant: waiting in the queues' fair-share indexes, the fleet's counter (service in tokens /
    weight), and from the workers' info: running, tokens served, the worst worker's p50 / p99 queue wait."""
    from rose.worker import fair_queue

    rows: dict[str, dict[str, Any]] = {}

    def row(tenant: str) -> dict[str, Any]:
        return rows.setdefault(tenant, {"tenant": tenant, "queued": 0, "running": 0, "tokens": 0})

    for name in queue_names:
        for tenant, n in fair_queue.waiting(conn, name).items():
            row(tenant)["queued"] += n
    for tenant, service in fair_queue.counters(conn).items():
        row(tenant)["service"] = round(service, 1)
    for w in workers:
        for tenant, report in (w.get("tenants") if isinstance(w.get("tenants"), dict) else {}).items():
            r = row(tenant)
            r["running"] += int(report.get("running", 0))
            r["tokens"] += int(report.get("tokens", 0))
            for key in ("wait_p50", "wait_p99"):
                if key in report:
                    r[key] = max(r.get(key, 0.0), float(report[key]))
    return sorted(rows.values(), key=lambda r: r["tenant"])


def _running_by_worker(conn: Any, queues: list[Any]) -> dict[str, int]:
    """How many jobs each worker runs now: the jobs in the queues' started registries, by their `worker_name`
    (that one field of each job, pipelined: not the whole job, prompt included)."""
    from rq.job import Job

    ids = [job_id for q in queues for job_id in q.started_job_registry.get_job_ids(cleanup=False)]
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(Job.key_for(job_id), "worker_name")
        names = pipe.execute()
    counts: dict[str, int] = {}
    for name in names:
        if name:
            key = _decode(name)
            counts[key] = counts.get(key, 0) + 1
    return counts


def _number(key: str, value: str) -> Any:
    try:
        if key in _WORKER_INT_FIELDS:
            return int(float(value))
        if key in _WORKER_FLOAT_FIELDS:
            return float(value)
    except ValueError:
        pass
    if value.startswith(("[", "{")):  # queues; lora_tokens / _loads / _evictions (by adapter); tenants
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s"


def _cell(info: dict[str, Any], key: str, fmt: str = "{}") -> str:
    value = info.get(key)
    return "-" if value is None or value == "" else fmt.format(value)


def render(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # piped (not a terminal): wide enough that names are never cut
    console = Console(width=None if sys.stdout.isatty() else 200)
    qt = Table(title="queues")
    for col in ("queue", "queued", "running", "finished", "failed", "canceled"):
        qt.add_column(col, justify="left" if col == "queue" else "right", overflow="fold")
    for q in data["queues"]:
        qt.add_row(q["name"], *(str(q[k]) for k in ("queued", "running", "finished", "failed", "canceled")))
    if not data["queues"]:
        qt.add_row("(no queues)", "", "", "", "", "")
    console.print(qt)

    wt = Table(title="workers")
    for col in ("worker", "state", "queues", "model", "device", "running", "waiting", "tok/s", "uptime"):
        right = col in ("running", "waiting", "tok/s", "uptime")
        wt.add_column(col, justify="right" if right else "left", overflow="fold")
    for w in data["workers"]:
        device = _cell(w, "device") + (f" {w['dtype']}" if w.get("dtype") else "")
        running = _cell(w, "running_jobs")
        wt.add_row(
            w["name"],
            w["state"],
            ",".join(w["queues"]),
            _cell(w, "model") if w["rose"] else "(not a rose-worker)",
            device,
            running,
            _cell(w, "num_waiting"),
            _cell(w, "tokens_per_s", "{:.1f}"),
            _duration(w.get("uptime_s")),
        )
    if not data["workers"]:
        wt.add_row("(no workers)", "", "", "", "", "", "", "", "")
    console.print(wt)
    lora = [w for w in data["workers"] if isinstance(w.get("lora_tokens"), dict)]
    if lora:  # workers started with --enable-lora: a row per adapter
        lt = Table(title="LoRA adapters")
        for col in ("worker", "adapter", "tokens", "loads", "evictions"):
            lt.add_column(col, justify="left" if col in ("worker", "adapter") else "right")
        for w in lora:
            if not w["lora_tokens"]:
                lt.add_row(w["name"], "(no adapters)", "", "", "")
            for name, tokens in w["lora_tokens"].items():
                counts = [_count(w, key, name) for key in ("lora_loads", "lora_evictions")]
                lt.add_row(w["name"], name, str(tokens), *counts)
        console.print(lt)
    if data.get("tenants"):  # the fair-share policy's accounts
        tt = Table(title="tenants")
        for col in ("tenant", "queued", "running", "tokens", "service", "wait p50", "wait p99"):
            tt.add_column(col, justify="left" if col == "tenant" else "right")
        for t in data["tenants"]:
            counts = (str(t[k]) for k in ("queued", "running", "tokens"))
            waits = (_cell(t, k, "{:.2f}s") for k in ("wait_p50", "wait_p99"))
            tt.add_row(t["tenant"], *counts, _cell(t, "service", "{:,.0f}"), *waits)
        console.print(tt)


def _count(worker: dict[str, Any], key: str, adapter: str) -> str:
    """An adapter's count in a worker's `key` (a JSON object by adapter)."""
    counts = worker.get(key)
    return str(counts.get(adapter, "")) if isinstance(counts, dict) else ""


def run(args: argparse.Namespace) -> int:
    data = collect(connect(args), args.queue)
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(data)
    return 0
