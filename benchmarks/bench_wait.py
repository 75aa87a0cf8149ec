#!/usr/bin/env python
"""What WAIT would cost the writes that decide a job's end: a primary and its replica (rose.harness.sentinel), the
worker's retirement transaction for a batch of finished jobs (RQ's success writes + the done event, as
rose.worker.retirer sends it), with and without `WAIT 1 <timeout>` after the EXEC; alternating, many batches.

    python benchmarks/bench_wait.py [--batches 400 --batch 32]

Prints the round trip per batch (median, p99) and the primary's main-thread CPU per job, each way. WAIT makes the
worker know its writes reached the replica; it does not hide them from other clients meanwhile (Redis serves reads
at once), which is why rose does not use it (docs/deploy.md, "What a failover can lose").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import redis  # noqa: E402

from rose.bench import redis_meter  # noqa: E402
from rose.harness.sentinel import SentinelCluster  # noqa: E402
from rose.worker import resp  # noqa: E402


def retirement(batch: int) -> list[list[str | int]]:
    """A retirement transaction's shape for `batch` jobs: ~20 writes a job, as rose.worker.rq_store records them."""
    commands: list[list[str | int]] = [["MULTI"]]
    for _ in range(batch):
        job = uuid.uuid4().hex
        result = '{"text": "' + "x" * 600 + '", "token_ids": [' + ",".join(["12345"] * 128) + "]}"
        commands += [
            ["HINCRBY", "rq:worker:w", "successful_job_count", 1],
            ["HINCRBYFLOAT", "rq:worker:w", "total_working_time", 1.5],
            [
                "HSET",
                f"rq:job:{job}",
                "status",
                "finished",
                "ended_at",
                "2026-01-01T00:00:00",
                "worker_name",
                "w",
            ],
            ["XADD", f"rq:results:{job}", "*", "type", 1, "return_value", result],
            ["EXPIRE", f"rq:results:{job}", 500],
            ["EXPIRE", f"rq:job:{job}", 500],
            ["ZREM", "rq:wip:rose", f"{job}:e"],
            ["ZADD", "rq:finished:rose", time.time() + 500, job],
            ["DEL", f"rq:execution:{job}:e"],
            ["ZREM", f"rq:executions:{job}", "e"],
            ["SREM", "rq:worker:w:executions", f"{job}:e"],
            ["XADD", f"rose:stream:{job}", "*", "event", '{"type":"done","seq":0}'],
            ["EXPIRE", f"rose:stream:{job}", 500],
            ["PUBLISH", f"rose:tokens:{job}", '{"type":"done","seq":0}'],
        ]
    return [*commands, ["EXEC"]]


def run(r: redis.Redis, batches: int, batch: int, wait: bool) -> tuple[list[float], float]:
    conn = r.connection_pool.get_connection()
    times: list[float] = []
    before = redis_meter.snapshot(r)
    for _ in range(batches):
        commands = retirement(batch)
        if wait:
            commands.append(["WAIT", 1, 1000])
        packed = b"".join(resp.pack_command(c) for c in commands)
        t0 = time.perf_counter()
        conn.send_packed_command([packed], check_health=False)
        replies = [conn.read_response() for _ in commands]
        times.append(time.perf_counter() - t0)
        if wait and replies[-1] < 1:
            print("WAIT timed out: the replica did not acknowledge", file=sys.stderr)
    after = redis_meter.snapshot(r)
    r.connection_pool.release(conn)
    return times, (after.cpu_s - before.cpu_s) / (batches * batch)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="jobs retired per transaction")
    args = p.parse_args()
    with SentinelCluster().start() as cluster:
        r = redis.Redis(port=cluster.primary_port())
        results: dict[bool, tuple[list[float], list[float]]] = {False: ([], []), True: ([], [])}
        for rnd in range(6):  # alternate, so the machine's drift hits both alike
            for wait in (False, True) if rnd % 2 == 0 else (True, False):
                times, cpu = run(r, args.batches // 6, args.batch, wait)
                results[wait][0].extend(times)
                results[wait][1].append(cpu)
            r.flushdb()
    for wait in (False, True):
        times, cpus = results[wait]
        s = sorted(times)
        print(
            f"{'with WAIT 1' if wait else 'no WAIT    '}: per batch of {args.batch} jobs median "
            f"{statistics.median(s) * 1e3:.3f} ms, p99 {s[int(0.99 * (len(s) - 1))] * 1e3:.3f} ms; primary CPU "
            f"{statistics.median(cpus) * 1e6:.1f} us per job"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
