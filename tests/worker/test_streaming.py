"""What a token costs Redis (rose.worker.outbox): jobs with `stream: false` publish only their end; streamed jobs'
tokens are coalesced, one event per job at most every --stream-interval, the first at once; a result is stored only
once its tokens are in the stream; events Redis refused or lost start the job's stream over. The stream contract
holds throughout: gap-free seqs, one terminal event after the last reset, streamed text = stored text."""

from __future__ import annotations

import time

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, check_stream, enqueue, status, stream_events, wait_for, wait_status

from rose.harness.job_audit import audit
from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import publisher as publisher_mod
from rose.worker import resp
from rose.worker import worker as worker_mod

pytestmark = pytest.mark.timeout(60)


def tokens_of(events: list[dict]) -> list[int]:
    return [i for e in events if e["type"] == "token" for i in e["token_ids"]]


def test_a_job_sent_with_stream_false_publishes_only_its_end(run_worker, r, q):
    sub = r.pubsub()
    quiet = enqueue(q, prompt="x", max_tokens=30, stream=False)
    loud = enqueue(q, prompt="y", max_tokens=30)
    sub.subscribe(keys.tokens_channel(quiet.id))
    sub.get_message(timeout=1)
    run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.005), stream_interval=0)
    for job in (quiet, loud):
        wait_status(r, job, "finished")
    (done,) = check_stream(r, quiet.id, "done")
    assert done["seq"] == 0 and done["usage"]["completion_tokens"] == 30
    assert Job.fetch(quiet.id, connection=r, serializer=JSONSerializer).return_value()["token_ids"] == list(
        range(30)
    )
    heard = [sub.get_message(timeout=1) for _ in range(2)]
    assert [m["type"] for m in heard if m] == ["message"]  # subscribers see the end, and only it
    assert len(check_stream(r, loud.id, "done")) == 31  # the streamed one: a token event per step here
    assert list(Client(r).job(quiet.id).stream(timeout=5)) == []  # Job.stream() ends without text


def test_streamed_tokens_are_coalesced_first_at_once_then_every_interval(run_worker, r, q):
    job = enqueue(q, prompt="x", max_tokens=80)
    t0 = time.monotonic()
    run_worker(engine=FakeEngine(max_num_seqs=4, max_model_len=512, step_delay=0.01), stream_interval=0.2)
    wait_status(r, job, "finished", timeout=20)
    elapsed = time.monotonic() - t0
    events = check_stream(r, job.id, "done")
    assert audit(r, job.id) == []
    tokens = [e for e in events if e["type"] == "token"]
    assert len(tokens[0]["token_ids"]) == 1  # the first token is not held
    assert tokens_of(events) == list(range(80))
    # 80 steps of >= 10 ms: at most one event per 0.2 s after the first (and the last, released at the end)
    assert 3 <= len(tokens) <= 2 + elapsed / 0.2, (len(tokens), elapsed)


def test_held_tokens_go_out_before_a_cancel_or_a_stop(run_worker, r, q):
    from rq.command import send_stop_job_command

    canceled = enqueue(q, prompt="x", max_tokens=200)
    stopped = enqueue(q, prompt="y", max_tokens=200)
    engine = FakeEngine(max_num_seqs=4, max_model_len=512, step_delay=0.01)
    run_worker(engine=engine, stream_interval=5)  # nothing released by the clock during the test
    wait_for(lambda: len(stream_events(r, stopped.id)) >= 1, what="first tokens")
    wait_for(lambda: engine.steps >= 20, what="more tokens held")
    Client(r).cancel(canceled.id)
    send_stop_job_command(r, stopped.id, serializer=JSONSerializer)
    for job, terminal in ((canceled, "canceled"), (stopped, "canceled")):
        events = check_stream(r, job.id, terminal)
        ids = tokens_of(events)
        assert ids == list(range(len(ids))) and len(ids) >= 20  # every generated token, held ones included
        assert len(events) == 3  # the first token, the held ones in one event, the end


def test_a_result_is_stored_only_once_its_tokens_are_in_the_stream(run_worker, r, q, monkeypatch):
    """The publisher's connection is cut off (its batches kept, unacknowledged): finished jobs wait in the worker,
    and are stored as soon as their events are written, never before."""
    paused = True
    real_pump = publisher_mod.Publisher._pump

    def pump(self, wait_s: float = 0.0):
        if not paused:
            real_pump(self, wait_s)

    monkeypatch.setattr(publisher_mod.Publisher, "_pump", pump)
    jobs = [enqueue(q, prompt=f"x{i}", max_tokens=5) for i in range(3)]
    engine = FakeEngine(max_num_seqs=4, step_delay=0.01)
    run_worker(engine=engine)
    wait_for(lambda: not engine.has_unfinished() and len(engine.added) == 3, what="generation done")
    time.sleep(0.3)
    assert [status(r, job) for job in jobs] == ["started"] * 3 and all(
        stream_events(r, job.id) == [] for job in jobs
    )
    paused = False
    for job in jobs:
        wait_status(r, job, "finished")
        assert audit(r, job.id) == []


class RefusingPublisher(publisher_mod.Publisher):
    """Redis refuses the REFUSE-th batch (as an out-of-memory server would): the real script is replaced by one
    that fails, so the real reply path drops it."""

    REFUSE = 3

    def _pack(self, events):
        batch = super()._pack(events)
        if batch.number == self.REFUSE:
            batch.packed = resp.pack_command(
                ["EVAL", "return redis.error_reply('OOM refused for the test')", 0]
            )
        return batch


def test_events_redis_refused_start_the_streams_over_before_anything_is_stored(run_worker, r, q, monkeypatch):
    monkeypatch.setattr(worker_mod, "Publisher", RefusingPublisher)
    jobs = [enqueue(q, prompt=f"x{i}", max_tokens=12) for i in range(3)]
    run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.01), stream_interval=0)
    for job in jobs:
        wait_status(r, job, "finished")
        check_stream(r, job.id, "done")
        assert audit(r, job.id) == []
        types = [e["type"] for e in stream_events(r, job.id)]
        assert "reset" in types, types  # batch 3 held a token of each: each started over


def test_events_redis_lost_start_the_streams_over(run_worker, r, q):
    """A failover to a replica that missed the last writes, as the worker sees it: its batch counter is behind what
    Redis acknowledged, and token events are gone from the stream. The jobs' streams start over (a reset, the text
    so far), and end whole."""
    jobs = [enqueue(q, prompt=f"x{i}", max_tokens=60) for i in range(2)]
    run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.02), stream_interval=0)
    wait_for(lambda: all(len(stream_events(r, j.id)) >= 10 for j in jobs), what="tokens")
    for key in r.keys("rose:publisher:*"):
        r.delete(key)
    for job in jobs:
        r.xdel(keys.stream_key(job.id), r.xrange(keys.stream_key(job.id))[3][0])
    for job in jobs:
        wait_status(r, job, "finished", timeout=20)
        check_stream(r, job.id, "done")
        assert audit(r, job.id) == []
        assert [e["type"] for e in stream_events(r, job.id)].count("reset") == 1


def test_a_job_whose_events_redis_keeps_refusing_is_stored_all_the_same(run_worker, r, q):
    """Its stream key holds something else: every XADD of its events is refused. The job's stream is started over
    once, then it goes on without one; the other jobs of the same batches are not held up, and it is stored."""
    bad = enqueue(q, prompt="x", max_tokens=20)
    good = enqueue(q, prompt="y", max_tokens=20)
    r.set(keys.stream_key(bad.id), "not a stream")
    run_worker(engine=FakeEngine(max_num_seqs=4, step_delay=0.01), stream_interval=0)
    for job in (bad, good):
        wait_status(r, job, "finished")
    assert audit(r, good.id) == []
    assert Job.fetch(bad.id, connection=r, serializer=JSONSerializer).return_value()["token_ids"] == list(
        range(20)
    )
