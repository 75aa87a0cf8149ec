#!/usr/bin/env python
"""What a take's starts and a retirement's writes cost Redis per job, by batch size: rose-worker's own functions
(rose.worker.rq_start, rose.worker.rq_store, rose.worker.coalesce, the outbox's done events) against a real
redis-server on a CPU of its own, RQ's writes as recorded (`raw`) against what rose-worker sends (`sent`: less the
writes that change nothing, coalesced) and that with the job's two streams (its result, its events) stored at their
size, copied after their XADD (`copied`, a Redis without RESTORE) or RESTOREd instead (`restored`, what rose-worker
sends: rose.worker.stream_dump), alternating chunk by chunk on one Redis.

    python benchmarks/bench_batch_writes.py [--jobs 1536 --batches 2,8,64]

A take: the dequeue script (ids moved, each job's status and timeout read), then the starts in one transaction, which
reads each job's hash last. A retirement: the retirer's two rounds (WATCH and reads, then MULTI/EXEC) with RQ's
success writes and each job's done event (a not-streamed job: 128 generated tokens).
Prints Redis's main-thread CPU per job (its commands, round trips and all; net of nothing: Redis is busy throughout)
and the commands a job costs; for the retirement, the bytes its two streams keep a job (`MEMORY USAGE`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rq import Queue  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from rose.bench import redis_meter  # noqa: E402
from rose.bench.redis_cost import cpu_split  # noqa: E402
from rose.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from rose.harness.redis_server import RedisServerProcess  # noqa: E402
from rose.jobs import keys  # noqa: E402
from rose.jobs.contract import parse  # noqa: E402
from rose.worker import batch_store, resp, rq_start, rq_store  # noqa: E402
from rose.worker.coalesce import coalesced  # noqa: E402
from rose.worker.outbox import Outbox  # noqa: E402
from rose.worker.publisher import Publisher  # noqa: E402
from rose.worker.rq_worker import RQWorker  # noqa: E402
from rose.worker.running import Choice, Running, job_timeout  # noqa: E402

VARIANTS = ("raw", "sent", "copied", "restored")
CHUNK = 8  # batches per variant before switching (fewer where the jobs would not make two chunks a variant)


def start(rq: RQWorker, n: int, sent: bool) -> list[Running]:
    """Take up to `n` jobs and start them as intake does (`sent`) or with RQ's writes as recorded."""
    taken = rq_start.dequeue(rq.connection, rq.queues, n, rq.serializer)
    recorder = rq_start.Recorder(rq.connection)
    runs = []
    for job_id, queue, job in taken:
        rq_start.settle_dequeued(recorder.pipe, queue, job_id)
        run = Running(job=job, queue=queue, execution=None, started_wall=time.time(), started_mono=0.0,
                      timeout=job_timeout(job))  # fmt: skip
        run.execution = rq_start.record_start(recorder.pipe, rq, job, run.registry_ttl())
        runs.append(run)
    rq_start.mark_busy(recorder.pipe, rq)
    commands = [args for args, _ in recorder.pipe.command_stack]
    recorder.pipe.reset()
    with rq.connection.pipeline() as pipe:
        for command in coalesced(commands) if sent else commands:
            pipe.execute_command(*command)
        for run in runs:
            pipe.execute_command(*rq_start.start_read(run.job))
        replies = pipe.execute()
    for run, fields in zip(runs, replies[len(replies) - len(runs) :], strict=True):
        assert rq_start.restore(run.job, fields)
    rq_store.hold(rq, [run.execution for run in runs])
    return runs


def finish(rq: RQWorker, runs: list[Running]) -> None:
    """The engine's part: 128 tokens each."""
    tokens = list(range(5, 133))
    for run in runs:
        run.request = parse(run.job, run.queue.name, rq.queue_names(), trust_chat_template=False)
        run.choices = [Choice(["a"] * len(tokens), tokens)]
        run.output = RequestOutput(
            request_id=run.id,
            prompt=None,
            prompt_token_ids=[1, 2, 3, 4],
            outputs=[CompletionOutput(0, "a" * len(tokens), tokens, "length")],
            metrics=RequestMetrics(arrival_time=time.time(), num_prompt_tokens=4),
        )
        run.result = run.build_result(rq.name)


def streams(run: Running) -> list[str]:
    return [keys.rq_results_key(run.id), keys.stream_key(run.id)]


def retire(rq: RQWorker, outbox: Outbox, runs: list[Running], variant: str) -> None:
    sent = variant != "raw"
    writes = [
        *rq_store.success_commands(rq, runs, slim=sent),
        *(command for run in runs for command in outbox.done_commands(run)),
    ]
    at_size = [key for run in runs for key in streams(run)] if variant in ("copied", "restored") else []
    if sent:
        writes = coalesced(writes)
    # the retirer's two rounds (rose.worker.retirer), on one connection: WATCH and reads, then MULTI/EXEC
    asks = batch_store.Asks(clock=variant == "restored")
    check = batch_store.check_commands(runs, at_size, asks)
    pending = resp.Pending(rq.connection, resp.pack_commands(check), len(check))
    found = batch_store.checked(rq.name, runs, at_size, writes, pending.read(keep=True), asks)
    assert found.ours and len(found.compact) + len(found.restore) == len(at_size), found
    store, sent = batch_store.store_commands(writes, found.compact, found.restore, found.now_ms)
    pending.send(resp.pack_commands(store), len(store))
    assert batch_store.stored(pending.read(), sent) == batch_store.Outcome(batch_store.Stored.STORED)
    for run in runs:
        rq_store.after_success(rq, run)


def measure(r, phase, per_variant: dict[str, list[float]], chunk: int) -> None:
    """Run `phase(variant)` in chunks of `chunk` calls, alternating variants, until it returns 0 jobs; add CPU s,
    jobs and commands to `per_variant`."""
    k = 0
    while True:
        variant = VARIANTS[k % len(VARIANTS)]
        before = redis_meter.snapshot(r)
        jobs = sum(phase(variant) for _ in range(chunk))
        after = redis_meter.snapshot(r)
        if not jobs:
            return
        used = redis_meter.usage(before, after)
        totals = per_variant[variant]
        totals[0] += used.cpu_s
        totals[1] += jobs
        totals[2] += used.commands
        k += 1


def one_batch_size(
    r, rq: RQWorker, outbox: Outbox, batch: int, jobs: int
) -> tuple[dict[str, dict[str, list[float]]], dict[str, float]]:
    """`jobs` jobs taken and retired `batch` at a time, each variant in turn: CPU s, jobs, commands per phase; the
    bytes a retired job's streams keep, by variant."""
    queue = Queue(keys.DEFAULT_QUEUE, connection=r, serializer=JSONSerializer)
    fields = {"max_tokens": 128, "ignore_eos": True, "temperature": 0, "stream": False}
    queue.enqueue_many(
        [Queue.prepare_data(keys.FUNC_PATH, kwargs={"prompt": f"job {i}", **fields}) for i in range(jobs)]
    )
    started: dict[str, list[Running]] = {v: [] for v in VARIANTS}
    totals: dict[str, dict[str, list[float]]] = {
        p: {v: [0.0, 0, 0] for v in VARIANTS} for p in ("start", "retire")
    }

    def take(variant: str) -> int:
        runs = start(rq, batch, variant != "raw")
        started[variant] += runs
        return len(runs)

    def retirement(variant: str) -> int:
        runs, started[variant][:batch] = started[variant][:batch], []
        if runs:
            retire(rq, outbox, runs, variant)
            retired[variant] += runs
        return len(runs)

    retired: dict[str, list[Running]] = {v: [] for v in VARIANTS}
    chunk = max(1, min(CHUNK, jobs // (batch * 2 * len(VARIANTS))))  # at least two chunks a variant
    measure(r, take, totals["start"], chunk)
    for variant in VARIANTS:
        finish(rq, started[variant])
    measure(r, retirement, totals["retire"], chunk)
    kept = {
        v: sum(r.memory_usage(key) or 0 for run in runs for key in streams(run)) / max(1, len(runs))
        for v, runs in retired.items()
    }
    return totals, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1536, help="jobs per batch size")
    parser.add_argument("--batches", default="2,8,64", help="batch sizes")
    args = parser.parse_args()
    cpus = cpu_split(True)
    print(f"Redis on CPU {cpus['redis']}; CPU µs (commands) per job, raw = RQ's writes as recorded")
    print(
        "| batch | phase | raw | sent | sent / raw | copied | copied / sent | restored | restored / sent "
        "| streams' bytes a job, sent → copied → restored |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    with RedisServerProcess(cpus=cpus["redis"]).start() as server:
        r = server.client()
        rq = RQWorker(
            ["rose"], name="bench", connection=server.client(), on_command=lambda c: None, socket_timeout=10
        )
        rq.register_birth()
        outbox = Outbox(Publisher(rq.connection), rq.default_result_ttl)
        for batch in [int(b) for b in args.batches.split(",")]:
            phases, kept = one_batch_size(r, rq, outbox, batch, args.jobs)
            for phase, totals in phases.items():
                if not all(totals[v][1] for v in VARIANTS):
                    print(f"| {batch} | {phase} | too few jobs for every variant: raise --jobs |")
                    continue
                us = {v: totals[v][0] * 1e6 / totals[v][1] for v in VARIANTS}
                cmds = {v: totals[v][2] / totals[v][1] for v in VARIANTS}
                cells = " | ".join(f"{us[v]:.1f} ({cmds[v]:.1f})" for v in VARIANTS[:2])
                at_size = " | ".join(
                    f"{us[v]:.1f} ({cmds[v]:.1f}) | {us[v] / us['sent']:.2f}" for v in ("copied", "restored")
                )
                size = " → ".join(f"{kept[v]:,.0f}" for v in ("sent", "copied", "restored"))
                size = size if phase == "retire" else ""
                print(f"| {batch} | {phase} | {cells} | {us['sent'] / us['raw']:.2f} | {at_size} | {size} |")
        outbox.publisher.close(timeout=1)


if __name__ == "__main__":
    main()
