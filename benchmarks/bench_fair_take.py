#!/usr/bin/env python
"""What a take costs Redis a job: the fair intake (rose.worker.fair_queue: a look, then a take that indexes and
claims) against first come, first served (rose.worker.rq_start.dequeue: one LMOVE a job, `--intake-policy fcfs`),
alternating on one real redis-server on a CPU of its own.

    python benchmarks/bench_fair_take.py [--jobs 400 --first 64 --batch 5 --tenants 1 --repeats 10]

Each run enqueues --jobs jobs with plain RQ (--tenants tenants in turn), takes --first, then --batch at a time until
none is left (a worker's takes as its sequences end), and reads Redis's main-thread CPU and commands (scripted ones
included) around the takes. Prints the medians a job and the fair / fcfs ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench_fair_depth import Accounts  # noqa: E402  (this script's folder is on sys.path)
from rq import Queue  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from rose.bench.redis_cost import cpu_split  # noqa: E402
from rose.harness.redis_server import RedisServerProcess  # noqa: E402
from rose.jobs import keys  # noqa: E402
from rose.worker import rq_start  # noqa: E402
from rose.worker.fair_queue import FairQueue  # noqa: E402


def redis_cost(r) -> tuple[float, int]:
    """Redis's main-thread CPU seconds and commands so far."""
    info = r.info("everything")
    return info["used_cpu_sys_main_thread"] + info["used_cpu_user_main_thread"], info[
        "total_commands_processed"
    ]


def run(r, policy: str, args: argparse.Namespace) -> tuple[float, float]:
    """One run: (Redis CPU µs, commands) a job taken."""
    r.flushall()
    queue = Queue("rose", connection=r, serializer=JSONSerializer)
    fair = FairQueue(r, JSONSerializer, {}, Accounts())
    fields = {"max_tokens": 128, "ignore_eos": True, "temperature": 0, "stream": False}
    queue.enqueue_many(
        [
            Queue.prepare_data(
                keys.FUNC_PATH, kwargs={"prompt": f"job {i}", "tenant": f"t{i % args.tenants}", **fields}
            )
            for i in range(args.jobs)
        ]
    )
    cpu, commands = redis_cost(r)
    taken, room = 0, args.first
    while taken < args.jobs:
        if policy == "fair":
            got = fair.take([queue], room)
        else:
            got = rq_start.dequeue(r, [queue], room, JSONSerializer)
        if not got:
            raise RuntimeError(f"{policy}: {args.jobs - taken} jobs left untaken")
        taken, room = taken + len(got), args.batch
    cpu_after, commands_after = redis_cost(r)
    return (cpu_after - cpu) * 1e6 / args.jobs, (commands_after - commands - 1) / args.jobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--first", type=int, default=64, help="the first take's room")
    p.add_argument("--batch", type=int, default=5, help="each later take's room")
    p.add_argument("--tenants", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"fair": [], "fcfs": []}
    with RedisServerProcess(cpus=cpu_split(True)["redis"]).start() as server:
        r = server.client()
        for i in range(args.repeats):
            for policy in ("fair", "fcfs") if i % 2 == 0 else ("fcfs", "fair"):
                results[policy].append(run(r, policy, args))
    medians = {policy: statistics.median(cpu for cpu, _ in runs) for policy, runs in results.items()}
    for policy, runs in results.items():
        cpus = " / ".join(f"{cpu:.1f}" for cpu, _ in runs)
        commands = statistics.median(n for _, n in runs)  # the first run's include loading the scripts
        print(
            f"{policy}: Redis CPU {medians[policy]:.1f} µs a job (runs {cpus}), {commands:.1f} commands a job"
        )
    print(f"fair / fcfs: {medians['fair'] / medians['fcfs']:.2f}")


if __name__ == "__main__":
    main()
