#!/usr/bin/env python
"""What one round trip costs Redis's main thread, by load: client processes each sending one cheap command at a time
(`LLEN`, or with `--command script` the worker's dequeue script on an empty queue), paced or flat out, against a
redis-server on a CPU of its own; Redis's own accounting (CPU net of its idle rate, and the command's own time in
commandstats) per round trip.

    python benchmarks/bench_roundtrip.py [--seconds 4] [--command llen|script]

Why: `rose bench fleet` extrapolates the fleet size at which Redis saturates from its CPU per worker measured at a
few percent of load. Much of that CPU is per round trip (a wake-up, a read, a write), and a round trip costs an idle
Redis more than a busy one, which serves several clients per wake-up: the extrapolation is an upper bound on the
cost, this table says by how much.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import redis  # noqa: E402
from rq import Queue  # noqa: E402

from rose.bench import redis_meter  # noqa: E402
from rose.bench.redis_cost import cpu_split  # noqa: E402
from rose.harness.redis_server import RedisServerProcess  # noqa: E402
from rose.worker import rq_start  # noqa: E402

# (client processes, pause between a client's commands in seconds): from a few round trips a second to flat out
LOADS = [(1, 0.02), (1, 0.002), (1, 0.0), (2, 0.0), (4, 0.0), (8, 0.0)]


def client(port: int, pause: float, until: float, cpus: str | None, command: str) -> int:
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    r = redis.Redis(port=port)
    n = 0
    while time.time() < until:
        if command == "script":
            rq_start.dequeue(r, [Queue("empty", connection=r)], 8, None)
        else:
            r.llen("q")
        n += 1
        if pause:
            time.sleep(pause)
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per load")
    parser.add_argument("--command", choices=("llen", "script"), default="llen")
    args = parser.parse_args()
    cpus = cpu_split(True)
    with RedisServerProcess(cpus=cpus["redis"]).start() as server:
        r = server.client()
        port = r.connection_pool.connection_kwargs["port"]
        idle = redis_meter.idle(r, 2.0)
        print(f"Redis on CPU {cpus['redis']}, clients on {cpus['worker']}; idle: {idle * 1e3:.2f} ms CPU/s")
        print(
            "| clients | pause ms | round trips/s | Redis CPU % | CPU µs / round trip (net of idle) | command µs |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for n, pause in LOADS:
            with mp.Pool(n) as pool:
                before = redis_meter.snapshot(r)
                until = time.time() + args.seconds
                counts = pool.starmap(client, [(port, pause, until, cpus["worker"], args.command)] * n)
                after = redis_meter.snapshot(r)
            used = redis_meter.usage(before, after, idle)
            trips = sum(counts)
            stats = used.commandstats.get("eval" if args.command == "script" else "llen", {"usec": 0.0})
            print(
                f"| {n} | {pause * 1e3:g} | {trips / used.wall_s:,.0f} | {used.cpu_s / used.wall_s * 100:.1f} | "
                f"{used.net_cpu_s * 1e6 / trips:.1f} | {stats['usec'] / trips:.1f} |"
            )


if __name__ == "__main__":
    main()
