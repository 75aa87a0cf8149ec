"""A Redis that fills up under a busy rose-worker: what the worker sends it while it is full, and whether any job is
wrong after.

    python benchmarks/stress_full.py [--jobs 600 --full-s 20 --margin 0]

A fresh redis-server (`maxmemory-policy noeviction`), one rose-worker (tiny-llama on CPU, `--max-num-seqs 64`), `--jobs`
streamed jobs of 256 tokens (EOS ignored). Once 64 have finished, Redis's `maxmemory` is set to `--margin` bytes above
what it holds (0: to 1 byte, so that it refuses every write), for `--full-s` seconds; then lifted. Prints what Redis
refused for memory and received while full (`INFO errorstats`, `total_net_input_bytes`, `INFO commandstats`), how
long the jobs took after, and the audit of every job (rose.harness.job_audit: finished exactly once, its stream whole
and ending with one terminal event after its last reset, streamed text equal to stored text). The goal: 0 bad jobs,
a worker alive, and little sent to a Redis that refuses it.
"""

from __future__ import annotations

import argparse
import sys
import time

from rq import Queue
from rq.serializers import JSONSerializer

from rose.harness.job_audit import audit
from rose.harness.redis_server import RedisServerProcess
from rose.harness.worker_process import WorkerProcess, wait_for
from rose.jobs import keys

WORKER_ARGS = ["--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--log-level", "WARNING"]
WORKER_ARGS += ["--max-num-seqs", "64", "--max-model-len", "320"]
RUNNING = 64  # jobs finished before Redis fills up


def counters(r) -> tuple[int, int, dict[str, dict[str, int]]]:
    """(commands refused for memory, bytes received, commandstats) since Redis started."""
    refused = int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))
    return refused, int(r.info("stats")["total_net_input_bytes"]), r.info("commandstats")


def _by_command(before: dict, after: dict, top: int = 5) -> tuple[str, str]:
    """The commands called most, and refused most (for memory, or failed: a script whose write was refused), between
    two `INFO commandstats`."""

    def delta(name: str, *fields: str) -> int:
        return sum(after[name].get(f, 0) - before.get(name, {}).get(f, 0) for f in fields)

    def most(counts: dict[str, int]) -> str:
        ranked = sorted(((c, n) for n, c in counts.items() if c), reverse=True)[:top]
        return ", ".join(f"{n.removeprefix('cmdstat_')} {c}" for c, n in ranked) or "none"

    calls = {name: delta(name, "calls") for name in after}
    refused = {name: delta(name, "rejected_calls", "failed_calls") for name in after}
    return most(calls), most(refused)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=600)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--full-s", type=float, default=20.0)
    p.add_argument(
        "--margin", type=int, default=0, help="bytes above what Redis holds (0: every write refused)"
    )
    args = p.parse_args(argv)
    with RedisServerProcess(args=["--maxmemory-policy", "noeviction"]).start() as server:
        r = server.client()
        with WorkerProcess(server.url, "full", WORKER_ARGS) as worker:
            worker.wait_ready(engine_info=True)
            q = Queue(keys.DEFAULT_QUEUE, connection=r, serializer=JSONSerializer)
            fields = {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 0}
            jobs = q.enqueue_many(
                [
                    Queue.prepare_data(keys.FUNC_PATH, kwargs={"prompt": f"job {i}", **fields})
                    for i in range(args.jobs)
                ]
            )
            finished = lambda: r.zcard(q.finished_job_registry.key)  # noqa: E731
            wait_for(lambda: finished() >= min(RUNNING, args.jobs), 600, f"{RUNNING} jobs", interval=0.2)
            r.config_set("maxmemory", r.info("memory")["used_memory"] + args.margin if args.margin else 1)
            before, t0 = counters(r), time.monotonic()
            time.sleep(args.full_s)
            after, done_full = counters(r), finished()
            r.config_set("maxmemory", 0)
            roomy = time.monotonic()
            full_s = roomy - t0
            wait_for(lambda: finished() >= args.jobs, 1800, "every job", interval=0.5)
            rest_s = time.monotonic() - roomy
            bad = {job.id: problems for job in jobs if (problems := audit(r, job.id))}
            alive = worker.proc.poll() is None
    calls, refusals = _by_command(before[2], after[2])
    print(
        f"full {full_s:.0f} s ({'every write refused' if not args.margin else f'{args.margin:,} bytes of room'}): "
        f"{after[0] - before[0]} commands refused for memory, {(after[1] - before[1]) / 1e6:.2f} MB received; "
        f"most called: {calls}; most refused: {refusals}"
    )
    print(
        f"{done_full - RUNNING} jobs finished while full; the other {args.jobs - done_full} in {rest_s:.1f} s after"
    )
    print(f"{args.jobs} jobs, {len(bad)} bad; worker alive: {alive}")
    for job_id, problems in list(bad.items())[:5]:
        print(f"  {job_id}: {problems}")
    return 0 if not bad and alive else 1


if __name__ == "__main__":
    sys.exit(main())
