"""Fair share and deadlines on one shared queue (issue 28), by a fleet simulation: real rose-worker processes (the real
intake, fair-share index, retirer and RQ bookkeeping) whose engine is rose.bench.sim_engine's stand-in generating at a
GPU's pace, against one real redis-server; jobs put on the queue by plain RQ.

Runs, each on a fresh Redis with the same jobs (lengths uniform in --min-tokens..--max-tokens, both tenants alike):
  fcfs        tenant "big" enqueues --big jobs, then tenant "small" --small (10x fewer): --intake-policy fcfs
  fair        the same, --intake-policy fair, equal weights: Jain's index of the tokens served while both wait
  weighted    the same with --tenant-weight small=2: small's share of those tokens (target 2/3 within 10 %)
  deadline    --big jobs, then (the fleet busy) --urgent jobs with a deadline --deadline-s ahead: fair vs fcfs, how
              many finish in time, and the throughput of each
Tokens served while both wait: each job's tokens spread evenly between its start and its end (the stand-in makes one
token a step), counted inside the window from the first start to the moment one tenant has nothing left waiting.
Throughput: tokens of the jobs that finished / (last end - first start), against the fcfs run of the same jobs (under
fcfs, deadline jobs reached after their deadline fail unstarted).

    python benchmarks/bench_fairness.py [--workers 2] [--seqs 32] [--big 1000] [--small 100] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, FinishedJobRegistry
from rq.serializers import JSONSerializer

from rose.harness.redis_server import RedisServerProcess
from rose.harness.worker_process import WorkerProcess, wait_for
from rose.jobs import keys


@dataclass
class Run:
    name: str
    tokens: dict[str, int] = field(default_factory=dict)  # served while both tenants waited, by tenant
    window_s: float = 0.0
    throughput: float = 0.0  # tokens / s over the whole run
    in_time: str = ""  # deadline run: urgent jobs finished before their deadline / all
    late_s: float = 0.0  # the worst urgent job's end past its deadline (negative: ahead)


def jobs(n: int, tenant: str, rng: random.Random, lo: int, hi: int, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "prompt": f"{tenant} {i}",
            "max_tokens": rng.randint(lo, hi),
            "ignore_eos": True,
            "stream": False,
            "tenant": tenant,
            **extra,
        }
        for i in range(n)
    ]


def enqueue(q: Queue, specs: list[dict[str, Any]], prefix: str) -> list[str]:
    data = [Queue.prepare_data(keys.FUNC_PATH, kwargs=k, job_id=f"{prefix}-{i}") for i, k in enumerate(specs)]
    for i in range(0, len(data), 1000):
        q.enqueue_many(data[i : i + 1000])
    return [d.job_id for d in data]


def run(args: argparse.Namespace, name: str, policy: list[str], urgent: bool) -> Run:
    rng = random.Random(7)
    big = jobs(args.big, "big", rng, args.min_tokens, args.max_tokens)
    small = [] if urgent else jobs(args.small, "small", rng, args.min_tokens, args.max_tokens)
    with RedisServerProcess().start() as server:
        r = server.client()
        q = Queue(keys.DEFAULT_QUEUE, connection=r, serializer=JSONSerializer)
        lengths = {}
        ids = enqueue(q, big, "big") + enqueue(q, small, "small")
        lengths.update({i: k["max_tokens"] for i, k in zip(ids, big + small, strict=True)})
        program = [sys.executable, "-m", "rose.bench.fleet", "worker"]
        flags = [
            "--sim-seqs",
            str(args.seqs),
            "--steps-per-s",
            str(args.steps_per_s),
            "--log-level",
            "WARNING",
            *policy,
        ]
        procs = [WorkerProcess(server.url, f"sim{i}", flags, program=program) for i in range(args.workers)]
        try:
            urgent_ids: list[str] = []
            deadline = 0.0
            if urgent:
                wait_for(lambda: q.count < len(ids) - args.workers * args.seqs, 60, what="the fleet busy")
                time.sleep(1.0)
                deadline = time.time() + args.deadline_s
                specs = jobs(
                    args.urgent, "urgent", rng, args.urgent_tokens, args.urgent_tokens, deadline=deadline
                )
                urgent_ids = enqueue(q, specs, "urgent")
                lengths.update({i: k["max_tokens"] for i, k in zip(urgent_ids, specs, strict=True)})
            finished = FinishedJobRegistry(keys.DEFAULT_QUEUE, connection=r, serializer=JSONSerializer)
            failed = FailedJobRegistry(keys.DEFAULT_QUEUE, connection=r, serializer=JSONSerializer)
            total = len(lengths)

            def ended() -> bool:  # a deadline job not started in time fails
                return finished.get_job_count(cleanup=False) + failed.get_job_count(cleanup=False) >= total

            wait_for(ended, 600, what="every job ended")
        finally:
            for p in procs:
                p.stop()
        fetched = Job.fetch_many(list(lengths), connection=r, serializer=JSONSerializer)
        done = {j.id for j in fetched if j.get_status(refresh=False) == "finished"}
        spans = {j.id: (j.started_at.timestamp(), j.ended_at.timestamp()) for j in fetched if j.id in done}
    first = min(s for s, _ in spans.values())
    last = max(e for _, e in spans.values())
    result = Run(name, throughput=sum(lengths[i] for i in spans) / (last - first))
    if urgent:  # those that failed (their deadline passed before they started) are late
        ends = [spans[i][1] for i in urgent_ids if i in spans]
        result.in_time = f"{sum(e <= deadline for e in ends)}/{len(urgent_ids)}"
        result.late_s = round(max(ends) - deadline, 2) if ends else float("inf")
        return result
    # both wait until the first moment one tenant has no job left to start
    window_end = min(max(spans[i][0] for i in ids if i.startswith(t)) for t in ("big", "small"))
    result.window_s = round(window_end - first, 2)
    for tenant in ("big", "small"):
        served = 0.0
        for i in ids:
            if i.startswith(tenant):
                s, e = spans[i]
                overlap = max(0.0, min(e, window_end) - max(s, first))
                served += lengths[i] * overlap / (e - s) if e > s else 0.0
        result.tokens[tenant] = round(served)
    return result


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seqs", type=int, default=32, help="sequences a simulated worker runs at once")
    p.add_argument("--steps-per-s", type=float, default=20.0)
    p.add_argument("--big", type=int, default=1000)
    p.add_argument("--small", type=int, default=100)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--urgent", type=int, default=10)
    p.add_argument("--urgent-tokens", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=6.0)
    p.add_argument("--json-out", default="")
    args = p.parse_args(argv)

    fcfs = run(args, "fcfs", ["--intake-policy", "fcfs"], urgent=False)
    fair = run(args, "fair", ["--intake-policy", "fair"], urgent=False)
    weighted = run(args, "weighted", ["--intake-policy", "fair", "--tenant-weight", "small=2"], urgent=False)
    late_fcfs = run(args, "deadline-fcfs", ["--intake-policy", "fcfs"], urgent=True)
    late_fair = run(args, "deadline-fair", ["--intake-policy", "fair"], urgent=True)

    print(
        f"{args.workers} simulated workers x {args.seqs} sequences x {args.steps_per_s:g} steps/s; big {args.big} "
        f"jobs then small {args.small}, {args.min_tokens}-{args.max_tokens} tokens each"
    )
    print(
        "| run | served while both wait (big / small) | window s | Jain | small's share | tok/s | vs fcfs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for res in (fcfs, fair, weighted):
        b, s = res.tokens["big"], res.tokens["small"]
        weights = (1.0, 2.0) if res is weighted else (1.0, 1.0)
        j = jain([b / weights[0], s / weights[1]])
        share = s / (b + s) if b + s else 0.0
        print(
            f"| {res.name} | {b:,} / {s:,} | {res.window_s} | {j:.3f} | {share:.3f} | {res.throughput:,.0f} | "
            f"{res.throughput / fcfs.throughput:.3f} |"
        )
    print(
        f"deadline jobs ({args.urgent} x {args.urgent_tokens} tokens, due {args.deadline_s:g} s after they are "
        f"queued behind {args.big} jobs):"
    )
    for res in (late_fcfs, late_fair):
        ended = (
            "none finished" if res.late_s == float("inf") else f"the last ended {res.late_s:+.2f} s from it"
        )
        print(
            f"  {res.name}: {res.in_time} in time ({ended}), "
            f"{res.throughput:,.0f} tok/s ({res.throughput / late_fcfs.throughput:.3f} x fcfs)"
        )
    j_fair = jain([fair.tokens["big"], fair.tokens["small"]])
    share = weighted.tokens["small"] / max(1, weighted.tokens["big"] + weighted.tokens["small"])
    checks = {
        "jain >= 0.95 (fair, equal weights)": j_fair >= 0.95,
        "weighted share within 10% of 2:1": abs(share / (2 / 3) - 1) <= 0.10,
        "fair throughput >= 95% of fcfs": fair.throughput >= 0.95 * fcfs.throughput,
        "deadline jobs in time (fair)": late_fair.in_time == f"{args.urgent}/{args.urgent}",
        "deadline run throughput >= 95% of fcfs": late_fair.throughput >= 0.95 * late_fcfs.throughput,
    }
    for what, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {what}")
    if args.json_out:
        runs = [asdict(x) for x in (fcfs, fair, weighted, late_fcfs, late_fair)]
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "checks": checks}, f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
