"""The worker loop against a real redis-server, with a fake engine (fast and exact)."""

from __future__ import annotations

import json
import pickle
import re
import time

import pytest
from rq import Queue, Retry, Worker
from rq.command import send_stop_job_command
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, check_stream, enqueue, status, stream_events, wait_for, wait_status

from rose.jobs import keys
from rose.jobs.client import Client, JobCanceled, JobFailed
from rose.worker.running import ORPHAN_GRACE_S

pytestmark = pytest.mark.timeout(60)


def test_batch_of_jobs_finishes_with_results_streams_and_pubsub(run_worker, r, q):
    sub = r.pubsub()
    jobs = [enqueue(q, prompt=f"p {i}", max_tokens=2 + i, metadata={"i": i}) for i in range(6)]
    for j in jobs:
        sub.subscribe(keys.tokens_channel(j.id))
    engine = FakeEngine(max_num_seqs=4)
    run_worker(engine=engine)
    for j in jobs:
        wait_status(r, j, "finished")
    for i, j in enumerate(jobs):
        result = Job.fetch(j.id, connection=r, serializer=JSONSerializer).return_value()
        assert result["text"] == "".join(f"w{k} " for k in range(2 + i))
        assert result["token_ids"] == list(range(2 + i))
        assert result["finish_reason"] == "length"
        assert result["usage"] == {"prompt_tokens": 2, "completion_tokens": 2 + i}
        assert set(result["metrics"]) == {"queue_s", "ttft_s", "generation_s", "tokens_per_s"}
        assert result["metrics"]["queue_s"] >= 0 and result["metrics"]["generation_s"] >= 0
        assert result["metadata"] == {"i": i}
        events = check_stream(r, j.id, "done")
        assert not any("job_id" in e for e in events)  # the stream's key names the job
        assert "".join(e["text"] for e in events if e["type"] == "token") == result["text"]
        assert events[-1]["usage"] == result["usage"]
    # pub/sub carried the same events, in order
    got: dict[str, list[dict]] = {}

    def heard_all() -> bool:
        msg = sub.get_message(timeout=0.1)
        if msg and msg["type"] == "message":
            event = json.loads(msg["data"])
            assert "job_id" not in event  # the channel names the job
            got.setdefault(keys.job_id_of_channel(msg["channel"]), []).append(event)
        return sum(len(v) for v in got.values()) >= sum(len(stream_events(r, j.id)) for j in jobs)

    wait_for(heard_all, 5, "every job's events on pub/sub", interval=0)
    for j in jobs:
        assert got[j.id] == stream_events(r, j.id)
    assert max(len(engine.added) for _ in [0]) == 6


def test_registered_as_an_rq_worker(run_worker, r, q):
    job = enqueue(q, prompt="x", max_tokens=60)
    wt = run_worker(engine=FakeEngine(step_delay=0.06), heartbeat_timeout=10)
    workers = Worker.all(connection=r)
    assert [w.name for w in workers] == [wt.worker.name]
    assert 0 < r.ttl(f"rq:worker:{wt.worker.name}") <= 10
    assert r.hget(keys.worker_info_key(wt.worker.name), "model") == b"fake"
    # the running job's StartedJobRegistry entry is kept alive by heartbeats
    wait_status(r, job, "started")
    member = r.zrange("rq:wip:rose", 0, -1)[0]
    first = r.zscore("rq:wip:rose", member)
    wait_for(lambda: r.zscore("rq:wip:rose", member) > first, 5, what="registry heartbeat")
    assert workers[0].get_state() == "busy" or Worker.find_by_key(f"rq:worker:{wt.worker.name}", connection=r)
    wait_status(r, job, "finished")
    wt.stop()
    assert Worker.all(connection=r) == []
    assert r.hget(f"rq:worker:{wt.worker.name}", "death")


def test_bad_jobs_fail_alone_with_clear_messages(run_worker, r, q):
    unknown = enqueue(q, prompt="x", temprature=0.5)
    too_long = enqueue(q, prompt="a b c", max_tokens=100)  # fake context: 64
    positional = q.enqueue("rose.jobs.generate", args=["hi"])
    other_func = q.enqueue("os.system", args=["echo pwned"])
    pickled = Queue("rose", connection=r).enqueue("rose.jobs.generate", kwargs={"prompt": "x"})
    huge_top_k = enqueue(q, prompt="bad", top_k=2**63)
    # input errors are never retried, whatever Retry says: they would fail the same way
    surrogate = enqueue(q, prompt="abc\ud800def", retry=Retry(max=3))
    good = enqueue(q, prompt="fine")
    run_worker()
    wait_status(r, good, "finished")
    client = Client(r)
    expected = {
        unknown: "unknown field 'temprature'",
        too_long: "exceeds the context",
        positional: "keyword arguments only",
        other_func: "only runs rose.jobs.generate",
        pickled: "not JSON (was it enqueued with RQ's default pickle serializer?)",
        huge_top_k: "top_k must be an integer in [1, 2**63)",
        surrogate: r"prompt[3] ('\ud800') is not valid Unicode text",
    }
    for job, text in expected.items():
        wait_status(r, job, "failed")
        with pytest.raises(JobFailed, match=re.escape(text)):
            client.job(job.id).result(timeout=5)
        assert check_stream(r, job.id, "error")[-1]["message"]
    assert [e["type"] for e in stream_events(r, surrogate.id)] == ["error"]  # one attempt
    assert r.zcard("rq:wip:rose") == 0


def test_pickled_payload_is_never_unpickled(run_worker, r, q, monkeypatch):
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled!",))

    job = Queue("rose", connection=r).enqueue("rose.jobs.generate", kwargs={"prompt": Boom()})
    calls = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: calls.append(a))
    run_worker()
    wait_status(r, job, "failed")
    assert calls == []


def test_cancel_running_job_frees_its_slot(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=2, step_delay=0.02)
    long = enqueue(q, prompt="x", max_tokens=60)
    other = enqueue(q, prompt="y", max_tokens=10)
    waiting = enqueue(q, prompt="z", max_tokens=3)
    run_worker(engine=engine)
    wait_status(r, long, "started")
    wait_for(lambda: len(stream_events(r, long.id)) >= 2, what="tokens")
    Job.fetch(long.id, connection=r, serializer=JSONSerializer).cancel()
    wait_for(lambda: stream_events(r, long.id)[-1]["type"] == "canceled", what="canceled event")
    assert long.id in engine.aborted
    check_stream(r, long.id, "canceled")
    for j in (other, waiting):
        wait_status(r, j, "finished")
    assert status(r, long) == "canceled"
    assert r.zcard("rq:wip:rose") == 0


def test_client_cancel_and_stop_job_command(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.02)
    a = enqueue(q, prompt="x", max_tokens=60)
    b = enqueue(q, prompt="x", max_tokens=60)
    run_worker(engine=engine)
    wait_status(r, a, "started")
    wait_status(r, b, "started")
    client = Client(r)
    assert client.job(a.id).cancel()
    send_stop_job_command(r, b.id, serializer=JSONSerializer)
    with pytest.raises(JobCanceled):
        client.job(a.id).result(timeout=5)
    wait_status(r, b, "stopped")
    assert check_stream(r, b.id, "canceled")[-1]["reason"] == "stopped"
    # the cancel is read by the probe answered during a step: the engine lets the job go a step or so later
    wait_for(lambda: {a.id, b.id} <= set(engine.aborted), timeout=2, what="both jobs aborted")


def test_streams_expire_while_running_and_after_the_job(run_worker, r, q):
    # the first event sets the running expiry (result TTL + timeout + grace), later tokens leave it alone, the
    # terminal event sets the result TTL
    job = enqueue(q, prompt="x", max_tokens=40, result_ttl=100, job_timeout=50)
    run_worker(engine=FakeEngine(step_delay=0.02))
    wait_for(lambda: len(stream_events(r, job.id)) >= 5, what="tokens")
    assert 100 + 50 < r.ttl(keys.stream_key(job.id)) <= 100 + 50 + ORPHAN_GRACE_S
    wait_status(r, job, "finished")
    check_stream(r, job.id, "done")
    assert 0 < r.ttl(keys.stream_key(job.id)) <= 100


def test_job_timeout_is_enforced(run_worker, r, q):
    engine = FakeEngine(step_delay=0.05)
    job = enqueue(q, prompt="x", max_tokens=60, job_timeout=1)
    run_worker(engine=engine)
    wait_status(r, job, "failed", timeout=10)
    with pytest.raises(JobFailed, match=r"timeout value \(1 seconds\)"):
        Client(r).job(job.id).result(timeout=1)
    assert job.id in engine.aborted


def test_a_step_error_fails_only_the_job_that_causes_it_and_rq_retry_applies(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.01)
    engine.poison = {"bad"}  # every step with this request in the batch raises, as top_k=2**63 did
    good = [enqueue(q, prompt=f"good {i}", max_tokens=6) for i in range(3)]
    bad = enqueue(q, prompt="bad", max_tokens=6, retry=Retry(max=1))
    run_worker(engine=engine)
    wait_status(r, bad, "failed")
    with pytest.raises(JobFailed, match=r"engine error: ValueError\('Overflow when unpacking long long"):
        Client(r).job(bad.id).result(timeout=1)
    assert engine.added.count(bad.id) >= 2  # RQ's Retry requeued it once; it failed the same way again
    for job in good:  # the full batch it was in goes on
        wait_status(r, job, "finished")
        result = Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()
        assert result["text"] == "".join(f"w{k} " for k in range(6))
        assert "".join(e["text"] for e in stream_events(r, job.id) if e["type"] == "token") == result["text"]


def test_a_transient_step_error_fails_nobody(run_worker, r, q):
    engine = FakeEngine(step_delay=0.01)
    jobs = [enqueue(q, prompt="x", max_tokens=30) for _ in range(2)]
    run_worker(engine=engine)
    wait_status(r, jobs[0], "started")
    wait_for(lambda: engine.steps > 3, what="a few steps")
    engine.fail_next_step = RuntimeError("CUDA out of memory (simulated)")
    for job in jobs:
        wait_status(r, job, "finished")
        assert Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()["text"] == "".join(
            f"w{k} " for k in range(30)
        )
    after = enqueue(q, prompt="z")
    wait_status(r, after, "finished")  # the worker goes on


def test_a_step_error_that_stays_fails_the_jobs_in_the_batch(run_worker, r, q):
    engine = FakeEngine(step_delay=0.01)
    plain = enqueue(q, prompt="x", max_tokens=30)
    retried = enqueue(q, prompt="y", max_tokens=30, retry=Retry(max=1))
    run_worker(engine=engine)
    # both must have streamed a token (a status of "started" comes before any step)
    wait_for(lambda: all(r.xlen(keys.stream_key(j.id)) > 1 for j in (plain, retried)), what="tokens for both")
    # both already have tokens, so neither can be set aside without losing them: the batch fails, as it did
    engine.poison = {plain.id}
    wait_status(r, plain, "failed")
    with pytest.raises(JobFailed, match="engine error: ValueError"):
        Client(r).job(plain.id).result(timeout=1)
    wait_status(r, retried, "finished")  # requeued by RQ's Retry, then done
    events = stream_events(r, retried.id)
    assert any(e["type"] == "reset" for e in events)
    last_reset = max(i for i, e in enumerate(events) if e["type"] == "reset")
    text = "".join(e["text"] for e in events[last_reset:] if e["type"] == "token")
    assert text == Job.fetch(retried.id, connection=r, serializer=JSONSerializer).return_value()["text"]


def test_with_scheduler_runs_scheduled_jobs_and_retry_intervals(run_worker, r, q):
    from datetime import timedelta

    engine = FakeEngine(step_delay=0.01)
    retried = enqueue(q, prompt="y", max_tokens=30, retry=Retry(max=1, interval=1))
    worker = run_worker(engine=engine, with_scheduler=True)
    wait_status(r, retried, "started")
    engine.poison = {retried.id}
    wait_for(lambda: status(r, retried) in ("scheduled", "queued"), 10, what="retry scheduled by RQ's Retry")
    engine.poison = set()
    # scheduled only now: due earlier, on a slow machine it could be in the batch the simulated failure fails
    later = q.enqueue_in(
        timedelta(seconds=1), "rose.jobs.generate", kwargs={"prompt": "later", "max_tokens": 3}
    )
    assert status(r, later) == "scheduled"
    wait_status(r, retried, "finished", timeout=30)  # moved back to the queue by RQ's scheduler, then run
    wait_status(r, later, "finished", timeout=30)
    assert worker.worker.rq.scheduler is not None
    worker.stop()
    assert worker.worker.rq.scheduler._process is None or not worker.worker.rq.scheduler._process.is_alive()


def test_drain_requeues_unfinished_jobs_in_order(run_worker, r, q):
    engine = FakeEngine(max_num_seqs=3, step_delay=0.02)
    quick = enqueue(q, prompt="x", max_tokens=2)
    slow = [enqueue(q, prompt="x", max_tokens=60) for _ in range(2)]
    queued = enqueue(q, prompt="x", max_tokens=2)
    wt = run_worker(engine=engine, drain_timeout=0.5)
    wait_for(lambda: len(engine.added) >= 3, what="jobs in the engine")
    wt.stop()
    assert status(r, quick) == "finished"
    assert [status(r, j) for j in slow] == ["queued", "queued"]
    # unfinished jobs are back at the front, in their start order, ahead of the never-started one
    assert r.lrange("rq:queue:rose", 0, -1) == [slow[0].id.encode(), slow[1].id.encode(), queued.id.encode()]
    assert r.zcard("rq:wip:rose") == 0
    assert StartedJobRegistry("rose", connection=r).get_job_ids() == []


def test_second_stop_skips_the_wait(run_worker, r, q):
    engine = FakeEngine(step_delay=0.02)
    job = enqueue(q, prompt="x", max_tokens=60)
    wt = run_worker(engine=engine, drain_timeout=60)
    wait_status(r, job, "started")
    t = time.monotonic()
    wt.stop(force=True)
    assert time.monotonic() - t < 5
    assert status(r, job) == "queued"


def test_queue_priority_order(run_worker, r):
    high = Queue("high", connection=r, serializer=JSONSerializer)
    low = Queue("low", connection=r, serializer=JSONSerializer)
    lows = [enqueue(low, prompt="l") for _ in range(2)]
    highs = [enqueue(high, prompt="h") for _ in range(2)]
    engine = FakeEngine(max_num_seqs=2)
    run_worker(queues=("high", "low"), engine=engine)
    for j in lows + highs:
        wait_status(r, j, "finished")
    assert engine.added[:2] == [h.id for h in highs]


def test_idle_worker_on_several_queues_takes_jobs_from_each_without_losing_any(run_worker, r, monkeypatch):
    from rose.worker import intake

    waits = []
    real_blmove = r.__class__.blmove

    def spy(self, src, dst, timeout, *args, **kwargs):  # the idle wait must move ids, never pop them
        waits.append((src, dst, timeout))
        return real_blmove(self, src, dst, timeout, *args, **kwargs)

    monkeypatch.setattr(r.__class__, "blmove", spy)
    monkeypatch.setattr(
        r.__class__, "blpop", lambda *a, **k: pytest.fail("BLPOP can lose a job id on a crash")
    )
    high = Queue("high", connection=r, serializer=JSONSerializer)
    low = Queue("low", connection=r, serializer=JSONSerializer)
    run_worker(queues=("high", "low"), engine=FakeEngine(max_num_seqs=2))
    wait_for(lambda: waits, 10, what="the worker idling")
    jobs = []
    for queue in (low, high, low):
        jobs.append(enqueue(queue, prompt="x"))
        wait_status(r, jobs[-1], "finished", timeout=5)
    assert all(src == "rq:queue:high" and dst == "rq:queue:high:intermediate" for src, dst, _ in waits)
    assert max(t for _, _, t in waits) <= intake.MULTI_QUEUE_BLOCK_S


def test_a_busy_loop_asks_empty_queues_nothing_until_a_probe_sees_jobs(run_worker, r, q, monkeypatch):
    """While jobs run and the queues are empty, the intake sends no dequeue (the last one came back short, and the
    probes read zero lengths); a job arriving mid-run is seen by the next probe and starts."""
    from rose.worker import fair_queue, rq_start

    dequeues = []

    def spying(real):  # either policy's dequeue (fair, the default; fcfs)
        def dequeue(*args, **kwargs):
            dequeues.append(time.monotonic())
            return real(*args, **kwargs)

        return dequeue

    monkeypatch.setattr(rq_start, "dequeue", spying(rq_start.dequeue))
    monkeypatch.setattr(fair_queue.FairQueue, "take", spying(fair_queue.FairQueue.take))
    engine = FakeEngine(max_num_seqs=4, max_model_len=512, step_delay=0.01)
    first = enqueue(q, prompt="x", max_tokens=400)
    run_worker(engine=engine, check_interval=0.05)
    wait_status(r, first, "started")
    time.sleep(0.3)
    steps, dequeues[:] = engine.steps, []
    time.sleep(0.2)
    assert engine.steps - steps >= 10 and dequeues == []  # steps ran, no dequeue was sent
    second = enqueue(q, prompt="y", max_tokens=2)
    wait_status(r, second, "finished")
    assert status(r, first) == "started" and len(dequeues) >= 1  # the second job started while the first ran
    wait_status(r, first, "finished", timeout=20)


def test_intake_takes_only_what_the_engines_free_blocks_admit(run_worker, r, q):
    """An engine that says how many more requests its KV blocks admit (Engine.num_admittable) is never given more,
    whatever its batch cap: the other jobs stay on the queue for other workers."""

    class Paged(FakeEngine):
        most = 0

        def add_request(self, *args, **kwargs):
            super().add_request(*args, **kwargs)
            self.most = max(self.most, len(self.requests))

        def num_admittable(self):
            return max(0, 2 - len(self.requests))  # blocks for two jobs at a time

    engine = Paged(max_num_seqs=8, step_delay=0.01)
    jobs = [enqueue(q, prompt="x", max_tokens=4) for _ in range(6)]
    run_worker(engine=engine)
    for job in jobs:
        wait_status(r, job, "finished")
    assert engine.most == 2 and len(engine.added) == 6
