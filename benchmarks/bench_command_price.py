#!/usr/bin/env python
"""What a Redis command costs Redis's CPU by how it is sent, and what writing a finished job's two streams at their
size costs: the prices behind `rose bench redis`'s figures, on one real redis-server on a CPU of its own.

    python benchmarks/bench_command_price.py [--jobs 6400 --batch 128 --repeats 5]

1. A job end's shape of writes (HSET of two fields, EXPIRE, ZADD: three commands a job), --batch jobs a round trip,
   sent as a pipeline, as MULTI/EXEC (what the retirement sends, rose.worker.batch_store), and through a script
   that makes each write a `redis.pcall` of its arguments (the retirement's until session 29). Prints Redis's
   main-thread CPU a command.
2. A finished job's two streams (RQ's result, one entry with a 2,500-character return value; rose's, one terminal
   event) written by the retirement's round 2 (`batch_store.store_commands`, --batch jobs a round trip): XADD and
   EXPIRE each, as written (`as written`); then copied at their size (`copied`: COPY, RENAME each, in a second
   MULTI/EXEC); or RESTOREd at their size, their expiry with them (`restored`: rose.worker.stream_dump). Prints
   Redis's CPU and the streams' bytes a job.

Medians of --repeats runs, the ways alternating; each run on a flushed Redis.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rose.bench.redis_cost import cpu_split  # noqa: E402
from rose.harness.redis_server import RedisServerProcess  # noqa: E402
from rose.worker import resp  # noqa: E402
from rose.worker.batch_store import store_commands  # noqa: E402

STREAM_WAYS = ["as written", "copied", "restored"]

# ARGV: the writes, each as its argument count followed by its arguments
_PCALL_EACH = """
local a = 1
while a <= #ARGV do
  local n = tonumber(ARGV[a])
  redis.pcall(unpack(ARGV, a + 1, a + n))
  a = a + n + 1
end
return 0
"""

RESULT = "x" * 2500  # a 128-token job's base64'd return value is ~2,500 characters
DONE = '{"type":"done","seq":0,"finish_reason":"length","usage":{"prompt_tokens":3,"completion_tokens":128}}'


def cpu_s(r) -> float:
    info = r.info("cpu")
    return info["used_cpu_user_main_thread"] + info["used_cpu_sys_main_thread"]


def job_end(i: int) -> list[tuple[str, ...]]:
    job = f"rq:job:{i}"
    return [
        ("HSET", job, "status", "finished", "ended_at", "2026-11-29T16:44:25.730648Z"),
        ("EXPIRE", job, "500"),
        ("ZADD", "rq:finished:rose", str(i), str(i)),
    ]


def send(r, how: str, writes: list[tuple[str, ...]]) -> None:
    if how == "script":
        r.execute_command("EVAL", _PCALL_EACH, 0, *(x for write in writes for x in (len(write), *write)))
        return
    pipe = r.pipeline(transaction=how == "MULTI/EXEC")
    for write in writes:
        pipe.execute_command(*write)
    pipe.execute()


def command_price(r, how: str, jobs: int, batch: int) -> float:
    """Redis CPU µs a command."""
    r.flushall()
    start = cpu_s(r)
    for first in range(0, jobs, batch):
        send(r, how, [w for i in range(first, min(first + batch, jobs)) for w in job_end(i)])
    return (cpu_s(r) - start) * 1e6 / (3 * jobs)


def streams_price(r, way: str, jobs: int, batch: int) -> tuple[float, float]:
    """(Redis CPU µs, bytes) a job: its two streams written `way` (STREAM_WAYS), --batch jobs a round trip; the
    bytes its streams hold then (`MEMORY USAGE`, a hundred jobs)."""
    r.flushall()
    now_ms = int(r.time()[0]) * 1000
    start = cpu_s(r)
    for first in range(0, jobs, batch):
        ids = range(first, min(first + batch, jobs))
        writes: list[tuple[str, ...]] = []
        for i in ids:
            writes += [
                ("XADD", f"rq:results:{i}", "MAXLEN", "~", "10", "*", "type", "1", "return_value", RESULT),
                ("EXPIRE", f"rq:results:{i}", "500"),
                ("XADD", f"rose:stream:{i}", "*", "event", DONE),
                ("EXPIRE", f"rose:stream:{i}", "500"),
            ]
        streams = [key for i in ids for key in (f"rq:results:{i}", f"rose:stream:{i}")]
        commands, _ = store_commands(
            writes,
            streams if way == "copied" else [],
            streams if way == "restored" else [],
            now_ms,
        )
        resp.Pending(r, resp.pack_commands(commands), len(commands)).read()
    used = (cpu_s(r) - start) * 1e6 / jobs
    sample = range(0, jobs, max(1, jobs // 100))
    held = sum(
        r.memory_usage(f"{family}:{i}", samples=0) for i in sample for family in ("rq:results", "rose:stream")
    )
    return used, held / len(sample)


def medians(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in runs.items()}


def alternate(ways: list[str], repeats: int, measure: Callable[[str], float]) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way in ways:
            runs[way].append(measure(way))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=6400)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with RedisServerProcess(cpus=cpu_split(True)["redis"]).start() as server:
        r = server.client()
        ways = ["pipeline", "MULTI/EXEC", "script"]
        prices = alternate(ways, args.repeats, lambda how: command_price(r, how, args.jobs, args.batch))
        for way, price in medians(prices).items():
            runs = " / ".join(f"{v:.2f}" for v in prices[way])
            print(f"{way}: {price:.2f} µs a command (runs {runs})")
        memory: dict[str, list[float]] = {way: [] for way in STREAM_WAYS}

        def streams(way: str) -> float:
            used, nbytes = streams_price(r, way, args.jobs, args.batch)
            memory[way].append(nbytes)
            return used

        cost = alternate(STREAM_WAYS, args.repeats, streams)
        for way, used in medians(cost).items():
            print(
                f"{way}: {used:.2f} µs a job, {statistics.median(memory[way]):,.0f} bytes a job (two streams)"
            )


if __name__ == "__main__":
    main()
