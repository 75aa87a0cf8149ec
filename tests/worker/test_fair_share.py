"""Fair share between tenants through the worker (issue 28): plain RQ producers put two tenants' jobs on one queue,
a big backlog first; the worker (--intake-policy fair, the default) serves them in turn by tokens, in the ratio of
--tenant-weight; a job with a deadline passes the backlog; fcfs keeps the queue's order. Per-tenant figures on
/metrics, in the info hash and in `rose status`."""

from __future__ import annotations

import json
import time

import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from test_metrics import scrape, value
from worker_helpers import FakeEngine, TinyWorker, enqueue, wait_for, wait_status

from rose.cli import status as status_cmd
from rose.jobs import keys
from rose.worker import fair_queue

pytestmark = pytest.mark.timeout(120)


def backlog(q, big: int, small: int, **small_fields) -> tuple[list, list]:
    """`big` jobs of tenant "big" first, then `small` of tenant "small", every job the same size."""
    bigs = [enqueue(q, prompt="a b c d", max_tokens=8, tenant="big") for _ in range(big)]
    smalls = [
        enqueue(q, prompt="a b c d", max_tokens=8, tenant="small", **small_fields) for _ in range(small)
    ]
    return bigs, smalls


def start_order(engine: FakeEngine, r, jobs: list) -> list[str]:
    wait_for(lambda: all(j.id in engine.added for j in jobs), 60, what="every job added to the engine")
    for job in jobs:
        wait_status(r, job, "finished", timeout=30)
    return [i for i in engine.added if i in {j.id for j in jobs}]


def test_a_small_tenant_behind_a_backlog_is_served_in_turn(run_worker, r, q):
    bigs, smalls = backlog(q, 30, 6)
    engine = FakeEngine(max_num_seqs=2, max_model_len=128)
    run_worker(engine=engine)
    order = start_order(engine, r, bigs + smalls)
    small_ids = {j.id for j in smalls}
    positions = [i for i, job_id in enumerate(order) if job_id in small_ids]
    # two jobs at a time, each tenant's jobs the same size: turns, so the six small jobs start among the first ~14
    assert positions[-1] < 16, positions
    assert [i for i in order if i not in small_ids] == [j.id for j in bigs]  # each tenant's own jobs in order


def test_fcfs_keeps_the_queues_order(run_worker, r, q):
    bigs, smalls = backlog(q, 12, 3)
    engine = FakeEngine(max_num_seqs=2, max_model_len=128)
    run_worker(engine=engine, intake_policy="fcfs")
    assert start_order(engine, r, bigs + smalls) == [j.id for j in bigs + smalls]


def test_weights_share_the_worker_in_their_ratio(run_worker, r, q):
    a = [enqueue(q, prompt="a b c d", max_tokens=8, tenant="a") for _ in range(40)]
    b = [enqueue(q, prompt="a b c d", max_tokens=8, tenant="b") for _ in range(40)]
    engine = FakeEngine(max_num_seqs=2, max_model_len=128)
    run_worker(engine=engine, tenant_weights={"a": 2.0})
    order = start_order(engine, r, a + b)
    first = order[:30]  # both backlogged throughout
    share_a = sum(1 for i in first if i in {j.id for j in a}) / len(first)
    assert share_a == pytest.approx(2 / 3, abs=0.1), share_a


def test_a_deadline_job_passes_the_backlog_and_finishes_in_time(run_worker, r, q):
    deadline = time.time() + 20
    bigs, urgent = backlog(q, 30, 1, deadline=deadline)
    engine = FakeEngine(max_num_seqs=2, max_model_len=128, step_delay=0.005)
    run_worker(engine=engine)
    order = start_order(engine, r, bigs + urgent)
    assert order.index(urgent[0].id) < 2  # among the first jobs taken, ahead of 30 queued before it
    assert urgent[0].latest_result().created_at.timestamp() < deadline


def test_per_tenant_figures_on_metrics_info_and_status(run_worker, r, q):
    bigs, smalls = backlog(q, 4, 2)
    engine = FakeEngine(max_num_seqs=2, max_model_len=128)
    wt = run_worker(engine=engine, metrics_port=0, heartbeat_timeout=10)  # the info hash every ~2 s
    start_order(engine, r, bigs + smalls)
    samples = scrape(wt.worker.metrics_server.port)
    # FakeEngine: a prompt of 4 words is 4 tokens; 8 generated: 12 tokens served a job
    assert value(samples, "rose_tenant_tokens_total", tenant="big") == 4 * 12
    assert value(samples, "rose_tenant_tokens_total", tenant="small") == 2 * 12
    assert value(samples, "rose_tenant_queue_wait_seconds_count", tenant="small") == 2
    wait_for(
        lambda: (
            {"big", "small"}
            <= set(json.loads(r.hget(keys.worker_info_key(wt.worker.name), "tenants") or b"{}"))
        ),
        15,
        what="the info hash's tenants",
    )
    # each job charged an estimate when taken, settled to its 12 tokens: both lifted to 0, then served
    wait_for(
        lambda: fair_queue.counters(r) == pytest.approx({"big": 48.0, "small": 24.0}),
        5,
        what=f"the counters settled (are {fair_queue.counters(r)})",
    )
    rows = {t["tenant"]: t for t in status_cmd.collect(r)["tenants"]}
    assert rows["big"]["tokens"] == 48 and rows["small"]["tokens"] == 24 and rows["small"]["queued"] == 0
    assert rows["big"]["wait_p99"] >= rows["big"]["wait_p50"] >= 0


def test_the_real_worker_serves_plain_rq_tenants_in_turn(new_redis_server, tmp_path):
    """rose-worker (tiny-llama, two jobs at a time) on a queue where plain RQ put 24 jobs of one tenant, then 4 of
    another: the second tenant's jobs start among the first dozen, not after the backlog."""
    r = new_redis_server.client()
    q = Queue("rose", connection=r, serializer=JSONSerializer)
    fields = {"prompt": "one two three", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    bigs = [q.enqueue("rose.jobs.generate", kwargs={**fields, "tenant": "big"}) for _ in range(24)]
    smalls = [q.enqueue("rose.jobs.generate", kwargs={**fields, "tenant": "small"}) for _ in range(4)]
    with TinyWorker(new_redis_server, tmp_path / "worker.log", "fair", "--max-num-seqs", "2") as worker:
        for job in bigs + smalls:
            wait_for(
                lambda job=job: job.get_status(refresh=True) == "finished", 120, what=f"{job.id} finished"
            )
        assert "tenants in fair share (equal weights), deadlines first" in worker.output()
    started = sorted(
        bigs + smalls, key=lambda job: Job.fetch(job.id, connection=r, serializer=JSONSerializer).started_at
    )
    positions = [i for i, job in enumerate(started) if job in smalls]
    assert positions[-1] < 12, positions
