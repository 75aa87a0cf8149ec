#!/usr/bin/env python
"""What the fair intake costs Redis on a deep queue: a burst indexed, then jobs taken from behind another tenant's
backlog (rose.worker.fair_queue on a real redis-server on a CPU of its own; jobs enqueued with plain RQ).

    python benchmarks/bench_fair_depth.py [--depth 100000 --takes 40 --batch 8]

`indexing`: --depth jobs of one tenant, then takes of one job until the index has read them all (512 a look):
Redis's CPU and the look's `LPOS` (finding the index's mark in the queue). `claims`: --depth / 2 jobs of tenant A,
then as many of tenant B, all indexed, then --takes takes of --batch jobs (A and B in turns): Redis's CPU a job,
and how B's jobs, behind A's backlog, left the list (`LSET`: the head's id moved into their place; `LREM`: removed by
value, a read of every id ahead).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rq import Queue  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from rose.bench import redis_meter  # noqa: E402
from rose.bench.redis_cost import cpu_split  # noqa: E402
from rose.harness.redis_server import RedisServerProcess  # noqa: E402
from rose.jobs import keys  # noqa: E402
from rose.worker import fair_queue  # noqa: E402
from rose.worker.fair_queue import FairQueue  # noqa: E402


class Accounts:
    """A worker's accounts as a take sees them: nothing owed."""

    def typical(self) -> float | None:
        return None

    def take_pending(self) -> dict[str, float]:
        return {}

    def owe(self, charges) -> None:
        pass

    def prepaid(self, job_id: str, tenant: str, tokens: float) -> None:
        pass


def enqueue(queue: Queue, tenant: str, n: int) -> None:
    fields = {"prompt": "x", "max_tokens": 8, "tenant": tenant}
    for start in range(0, n, 5000):
        count = min(5000, n - start)
        queue.enqueue_many([Queue.prepare_data(keys.FUNC_PATH, kwargs=fields) for _ in range(count)])


def index_all(fair: FairQueue, queue: Queue, depth: int) -> int:
    """Takes of one job until every id has been looked at: the jobs taken."""
    return sum(len(fair.take([queue], 1)) for _ in range(depth // fair_queue.LOOK_LIMIT + 2))


def stat(r, name: str) -> dict[str, float]:
    return r.info("commandstats").get(f"cmdstat_{name}", {"calls": 0, "usec": 0.0})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=100_000)
    p.add_argument("--takes", type=int, default=40)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    cpus = cpu_split(True)
    with RedisServerProcess(cpus=cpus["redis"]).start() as server:
        r = server.client()
        queue = Queue("rose", connection=r, serializer=JSONSerializer)
        fair = FairQueue(r, JSONSerializer, {}, Accounts())

        enqueue(queue, "A", args.depth)
        r.config_resetstat()
        before = redis_meter.snapshot(r)
        index_all(fair, queue, args.depth)
        used = redis_meter.usage(before, redis_meter.snapshot(r))
        lpos = stat(r, "lpos")
        print(
            f"indexing {args.depth:,} jobs: Redis CPU {used.cpu_s * 1e3:,.0f} ms ({used.cpu_s * 1e6 / args.depth:.1f} µs "
            f"a job); LPOS {lpos['calls']:.0f} calls, {lpos['usec'] / max(1, lpos['calls']):,.1f} µs each"
        )

        r.flushall()
        enqueue(queue, "A", args.depth // 2)
        enqueue(queue, "B", args.depth // 2)
        index_all(fair, queue, args.depth)
        r.config_resetstat()
        before = redis_meter.snapshot(r)
        taken = sum(len(fair.take([queue], args.batch)) for _ in range(args.takes))
        used = redis_meter.usage(before, redis_meter.snapshot(r))
        lrem, lset = stat(r, "lrem"), stat(r, "lset")
        print(
            f"claims behind a backlog of {args.depth // 2:,}: {taken} jobs taken, Redis CPU {used.cpu_s * 1e6 / taken:,.0f} "
            f"µs a job; LREM {lrem['calls']:.0f} calls, {lrem['usec'] / max(1, lrem['calls']):,.1f} µs each; LSET "
            f"{lset['calls']:.0f} calls, {lset['usec'] / max(1, lset['calls']):,.1f} µs each"
        )


if __name__ == "__main__":
    main()
