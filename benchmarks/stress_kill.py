"""kill -9 a rose-worker at random instants, many times, and count the jobs a producer or a subscriber would find wrong.

    python benchmarks/stress_kill.py [--runs 10 --jobs 200 --seed 0]

Each run: a fresh redis-server, two rose-workers (tiny-llama on CPU, `--max-num-seqs 32`), `--jobs` jobs (8 to 64
tokens each, EOS ignored); one worker is killed with SIGKILL at a random instant while jobs run, and restarted under
the same name; once every job has finished, each is audited (rose.harness.job_audit: finished exactly once, its
stream ends with exactly one terminal event after its last reset, streamed text equals stored text). Half the runs
kill from outside (a random delay), half at a random pass of a fault point inside the worker (rose.worker.faults:
right after a result was stored, or right after the last tokens were sent), the instants issue 17 is about.
Prints one line per run and the totals; the goal is 0 bad jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from rq.job import Job
from rq.serializers import JSONSerializer

from rose.harness.job_audit import audit
from rose.harness.redis_server import RedisServerProcess
from rose.harness.worker_process import WorkerProcess, wait_for
from rose.jobs import keys
from rose.jobs.client import Client

WORKER_ARGS = ["--model", "tiny-llama", "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "32"]
WORKER_ARGS += ["--recovery-interval", "1", "--heartbeat-timeout", "10"]


def one_run(run: int, rng: random.Random, n_jobs: int, logs: Path) -> dict:
    fault = None
    if run % 2:
        fault = f"{rng.choice(['result_stored', 'events_sent'])}:{rng.randint(1, max(1, n_jobs // 2))}"
    with RedisServerProcess().start() as server:
        r = server.client()
        jobs = Client(r).submit_many(
            [
                {"prompt": f"run {run} job {i}", "max_tokens": rng.randint(8, 64), "ignore_eos": True}
                for i in range(n_jobs)
            ]
        )
        ids = [j.id for j in jobs]
        env = {**os.environ, "ROSE_FAULT_POINT": fault} if fault else None
        victim = WorkerProcess(
            server.url, "victim", WORKER_ARGS, log_path=logs / f"run{run}-victim.log", env=env
        )
        other = WorkerProcess(server.url, "other", WORKER_ARGS, log_path=logs / f"run{run}-other.log")
        restarted = None
        try:
            finished = lambda: sum(r.hget(Job.key_for(i), "status") == b"finished" for i in ids)  # noqa: E731
            if fault is None:
                wait_for(lambda: finished() >= 1 or victim.proc.poll() is not None, 300, "the first job")
                time.sleep(rng.uniform(0.0, 3.0))
                victim.proc.send_signal(signal.SIGKILL)
            wait_for(lambda: victim.proc.poll() is not None or finished() == n_jobs, 300, "the kill")
            killed = victim.proc.returncode == -signal.SIGKILL
            done_at_kill = finished()
            marked = r.hlen(keys.SEALS_KEY)
            restarted = WorkerProcess(
                server.url, "victim", WORKER_ARGS, log_path=logs / f"run{run}-restart.log"
            )
            wait_for(lambda: finished() == n_jobs, 600, "every job finished", interval=0.2)
            time.sleep(0.5)  # the last done events' batch is acknowledged a step later
            bad = [p for i in ids for p in audit(r, i)]
            requeued = sum(
                bool(Job.fetch(i, connection=r, serializer=JSONSerializer).meta.get(keys.META_REQUEUES))
                for i in ids
            )
        finally:
            for proc in (victim, other, restarted):
                if proc is not None:
                    proc.stop(timeout=10)
            r.close()
    return {
        "run": run,
        "kill": fault or "outside",
        "killed": killed,
        "finished_at_kill": done_at_kill,
        "marked_at_kill": marked,
        "requeued": requeued,
        "bad": len(bad),
        "problems": bad[:5],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    logs = Path(tempfile.mkdtemp(prefix="rose-stress-kill-"))
    results = []
    for run in range(args.runs):
        res = one_run(run, rng, args.jobs, logs)
        results.append(res)
        print(
            f"run {run}: kill {res['kill']:<18} killed={res['killed']!s:<5} finished at kill {res['finished_at_kill']:>3}"
            f"  sealed-at-kill {res['marked_at_kill']}  requeued {res['requeued']:>3}  bad {res['bad']}",
            flush=True,
        )
        for problem in res["problems"]:
            print(f"    {problem}")
    killed = sum(r["killed"] for r in results)
    bad = sum(r["bad"] for r in results)
    print(
        f"\n{args.runs} runs, {killed} kills, {args.runs * args.jobs} jobs: {bad} bad (goal 0); logs in {logs}"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
