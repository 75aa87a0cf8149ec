"""The worker as a Redis client and an RQ worker, against a real redis-server with a fake engine: producers that
write Redis by hand, RQ callbacks / dependents / suspension, connections dropped and Redis going away mid-run."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest
import redis
from rq import Worker
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import (
    FakeEngine,
    WorkerThread,
    check_stream,
    enqueue,
    status,
    stream_events,
    wait_for,
    wait_status,
)

from rose.jobs.client import Client, JobFailed

pytestmark = pytest.mark.timeout(60)


def test_redis_connections_dropping_mid_run(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.01)
    jobs = [enqueue(q, prompt="x", max_tokens=40) for _ in range(6)]
    run_worker(engine=engine)
    wait_status(r, jobs[0], "started")
    stop = threading.Event()

    def killer():
        while not stop.is_set():
            r.client_kill_filter(_type="normal", skipme=True)
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    time.sleep(1.0)
    stop.set()
    t.join()
    for j in jobs:
        wait_status(r, j, "finished", timeout=30)
        result = Job.fetch(j.id, connection=r, serializer=JSONSerializer).return_value()
        events = check_stream(r, j.id, "done")  # published after the result is stored: may come a bit later
        assert "".join(e["text"] for e in events if e["type"] == "token") == result["text"]


def test_producer_in_another_language_raw_redis(run_worker, r):
    """What docs/jobs.md tells non-Python producers to write, with plain Redis commands and plain JSON data."""
    job_id = "raw-1"
    data = json.dumps(
        ["rose.jobs.generate", None, [], {"prompt": "a b", "max_tokens": 2, "metadata": {"x": 1}}]
    )
    with r.pipeline() as pipe:
        pipe.hset(
            f"rq:job:{job_id}",
            mapping={
                "status": "queued",
                "origin": "rose",
                "data": data,
                "created_at": "2026-01-01T00:00:00.000000Z",
                "enqueued_at": "2026-01-01T00:00:00.000000Z",
                "timeout": "60",
            },
        )
        pipe.sadd("rq:queues", "rq:queue:rose")
        pipe.rpush("rq:queue:rose", job_id)
        pipe.execute()
    run_worker()
    result = Client(r).job(job_id).result(timeout=10)
    assert result["text"] == "w0 w1 " and result["metadata"] == {"x": 1}


def test_redis_outage_worker_carries_on(persistent_redis_server):
    """Redis goes away for a few seconds mid-generation: the worker keeps its jobs and finishes them."""
    server = persistent_redis_server
    r = server.client()
    client = Client(r)
    jobs = client.submit_many([{"prompt": "a", "max_tokens": 60} for _ in range(3)])
    wt = WorkerThread(server, ["rose"], FakeEngine(step_delay=0.02)).start()
    try:
        wait_for(lambda: all(len(stream_events(r, j.id)) >= 3 for j in jobs), what="streaming")
        server.stop()
        time.sleep(3)
        server.start()
        for j in jobs:
            result = j.result(timeout=30)
            assert result["usage"]["completion_tokens"] == 60
            check_stream(r, j.id, "done")
            assert (
                "".join(e["text"] for e in stream_events(r, j.id) if e["type"] == "token") == result["text"]
            )
        assert r.zcard("rq:wip:rose") == 0
        assert [w.name for w in Worker.all(connection=r)] == [wt.worker.name]
        reg = wt.worker.metrics.registry
        assert reg.get_sample_value("rose_redis_reconciliations_total", {"model_name": "fake"}) >= 1
    finally:
        wt.stop(force=True)


def refused_for_memory(r: redis.Redis) -> int:
    """The commands Redis has refused for memory since it started (`INFO errorstats`)."""
    return int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


def test_a_full_redis_is_waited_out_and_every_stream_is_whole_after(new_redis_server, caplog):
    """Redis reaches its maxmemory (noeviction) mid-generation: it refuses every write for a while (the heartbeat,
    takes, events, results). The worker waits, generating on, tries again twice a second rather than at each step,
    logs it once in a while rather than each refusal, and once Redis has room stores every job with its whole
    stream."""
    r = new_redis_server.client()
    client = Client(r)
    jobs = client.submit_many([{"prompt": "a", "max_tokens": 60} for _ in range(3)])
    later = client.submit_many([{"prompt": "b", "max_tokens": 5} for _ in range(3)])
    wt = WorkerThread(new_redis_server, ["rose"], FakeEngine(max_num_seqs=3, step_delay=0.02)).start()
    try:
        wait_for(lambda: all(len(stream_events(r, j.id)) >= 3 for j in jobs), what="streaming")
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)  # below what it holds: every write refused
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            r.set("probe", 1)
        refused = refused_for_memory(r)
        time.sleep(2)  # beyond the 60 tokens the jobs have to generate
        refused = refused_for_memory(r) - refused
        assert wt.thread.is_alive() and wt.error is None
        # tried again twice a second (the guard's probe, the streams' restart), not at each step: 53 before
        assert refused <= 20
        assert all(j.status() != "finished" for j in jobs)  # their results waited too
        r.config_set("maxmemory", 0)
        for j in jobs + later:
            result = j.result(timeout=30)
            events = check_stream(r, j.id, "done")
            assert "".join(e["text"] for e in events if e["type"] == "token") == result["text"]
        assert wt.thread.is_alive() and wt.error is None
    finally:
        wt.stop(force=True)
    full = [rec for rec in caplog.records if "full (maxmemory)" in rec.getMessage()]
    assert full and len(full) <= 4, [
        rec.getMessage() for rec in full
    ]  # the guard's and the publisher's first lines
    assert not any(rec.exc_info for rec in caplog.records if rec.levelno >= logging.ERROR)


def test_an_idle_worker_outlives_a_redis_outage(persistent_redis_server):
    """Nothing running: the loop blocks on the queue, and Redis goes away; the worker waits it out and takes the
    next job (its idle path must go through the guard like the busy one)."""
    server = persistent_redis_server
    r = server.client()
    wt = WorkerThread(server, ["rose"], FakeEngine()).start()
    try:
        server.stop()
        time.sleep(2)
        server.start()
        job = Client(r).submit("a", max_tokens=3)
        assert job.result(timeout=15)["usage"]["completion_tokens"] == 3
        assert wt.thread.is_alive() and wt.error is None
    finally:
        wt.stop(force=True)


CALLS: list[tuple[str, str]] = []


def on_success_cb(job, connection, result, *args, **kwargs):
    CALLS.append(("success", result["text"]))


def on_failure_cb(job, connection, typ, value, tb):
    CALLS.append(("failure", str(value)))


def test_rq_callbacks_and_dependents(run_worker, r, q):
    from rq import Callback

    CALLS.clear()
    parent = q.enqueue(
        "rose.jobs.generate",
        kwargs={"prompt": "a", "max_tokens": 2},
        on_success=Callback(f"{__name__}.on_success_cb"),
    )
    child = q.enqueue("rose.jobs.generate", kwargs={"prompt": "b", "max_tokens": 2}, depends_on=parent)
    bad = q.enqueue(
        "rose.jobs.generate",
        kwargs={"prompt": "a", "max_tokens": 999},
        on_failure=Callback(f"{__name__}.on_failure_cb"),
    )
    refused = q.enqueue("os.system", args=["true"], on_failure=Callback(f"{__name__}.on_failure_cb"))
    assert status(r, child) == "deferred"
    run_worker()
    wait_status(r, child, "finished")
    wait_status(r, bad, "failed")
    wait_status(r, refused, "failed")
    assert ("success", "w0 w1 ") in CALLS
    assert any(kind == "failure" and "exceeds the context" in text for kind, text in CALLS)
    assert not any("only runs rose.jobs.generate" in text for _, text in CALLS)  # a refused job's never run


def test_rq_suspend_and_resume(run_worker, r, q):
    from rq.suspension import resume, suspend

    run_worker()
    suspend(r)
    time.sleep(1.5)  # noticed within a second when idle
    job = enqueue(q, prompt="x")
    time.sleep(1.5)
    assert status(r, job) == "queued"
    resume(r)
    wait_status(r, job, "finished")


def test_json_payload_in_the_wrong_layout(run_worker, r):
    with r.pipeline() as pipe:
        pipe.hset(
            "rq:job:raw-bad", mapping={"status": "queued", "origin": "rose", "data": '{"prompt": "hi"}'}
        )
        pipe.rpush("rq:queue:rose", "raw-bad")
        pipe.execute()
    run_worker()
    with pytest.raises(JobFailed, match="payload is JSON but not RQ's"):
        Client(r).job("raw-bad").result(timeout=10)


def test_json_nested_too_deeply_is_named(run_worker, r):
    deep = '["rose.jobs.generate", null, [], {"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}]"
    with r.pipeline() as pipe:
        pipe.hset("rq:job:raw-deep", mapping={"status": "queued", "origin": "rose", "data": deep})
        pipe.rpush("rq:queue:rose", "raw-deep")
        pipe.execute()
    run_worker()
    with pytest.raises(JobFailed, match=re.escape("JSON nested too deeply to decode (RecursionError)")):
        Client(r).job("raw-deep").result(timeout=10)
