"""rose.worker.seal: a job's terminal event is written by exactly one of its worker (while the job's marker holds)
and a repair (once the worker is dead), and a repair makes the stream end as the stored end says."""

from __future__ import annotations

import pytest
from worker_helpers import enqueue, registered_rq_worker, stream_events, wait_status

from rose.harness.job_audit import audit
from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import seal
from rose.worker.publisher import KEEP_TTL, Outgoing, Publisher

pytestmark = pytest.mark.timeout(60)

DEAD = lambda owner: False  # noqa: E731 - a liveness oracle for which every other worker is dead
NOT_HELD = lambda job_id: False  # noqa: E731 - this worker holds none of the marked jobs


@pytest.fixture
def rq(redis_server):
    worker = registered_rq_worker(redis_server, "repairer")
    yield worker
    worker.connection.close()


def test_a_sealing_event_is_written_only_while_its_marker_holds(r):
    r.hset(keys.SEALS_KEY, "held", "w")
    publisher = Publisher(r)
    publisher.send(
        [
            Outgoing("held", '{"type":"done","seq":0}', KEEP_TTL, seals=True),
            Outgoing("claimed", '{"type":"token","seq":0}', KEEP_TTL),
            Outgoing(
                "claimed", '{"type":"done","seq":1}', KEEP_TTL, seals=True
            ),  # no marker: a repair has it
        ]
    )
    assert publisher.flush(timeout=5)
    assert [e["type"] for e in stream_events(r, "held")] == ["done"]
    assert [e["type"] for e in stream_events(r, "claimed")] == ["token"]
    assert not r.exists(keys.SEALS_KEY)
    publisher.close()


def lose_the_end(r, job_id: str, keep: int, marked: bool = True) -> None:
    """What a kill -9 between storing the job's end and streaming it leaves: the stream cut after `keep` entries,
    the job marked by a worker that is gone (`marked=False`: the marker already claimed by a repair)."""
    for entry_id, _ in r.xrange(keys.stream_key(job_id))[keep:]:
        r.xdel(keys.stream_key(job_id), entry_id)
    if marked:
        r.hset(keys.SEALS_KEY, job_id, "ghost")


def finished_job(run_worker, r, q, max_tokens: int, **fields):
    """A job run to its end by a worker that then stops (one token event per token: every step publishes)."""
    job = enqueue(q, prompt="x", max_tokens=max_tokens, **fields)
    worker = run_worker(stream_interval=0)
    wait_status(r, job, "finished")
    worker.stop()
    return job


def test_a_dead_workers_finished_job_is_repaired_from_its_result(run_worker, r, q, rq):
    job = finished_job(run_worker, r, q, 6)
    lose_the_end(r, job.id, keep=2)
    watch = seal.SealWatch()
    assert (
        watch.scan(rq, DEAD, held=NOT_HELD) == 0
    )  # seen dead once: its worker may only have lapsed in an outage
    assert watch.scan(rq, DEAD, held=NOT_HELD) == 1
    assert audit(r, job.id) == [] and not r.exists(keys.SEALS_KEY)
    assert [e["type"] for e in stream_events(r, job.id)] == ["token", "token", "token", "done"]
    assert watch.scan(rq, DEAD, held=NOT_HELD) == 0 and seal.repair(r, rq, job.id) is False  # sealed once


def test_a_repaired_stream_carries_the_logprobs_of_the_tokens_it_lacked(run_worker, r, q, rq):
    job = finished_job(run_worker, r, q, 5, logprobs=2)
    stored = Client(r).job(job.id).result(timeout=5)["logprobs"]
    assert [e["logprob"] for e in stored] == [0.0, -0.1, -0.2, -0.3, -0.4]
    lose_the_end(r, job.id, keep=2, marked=False)
    assert seal.repair(r, rq, job.id, "ghost")
    assert audit(r, job.id) == []
    events = stream_events(r, job.id)
    assert [e["type"] for e in events] == ["token", "token", "token", "done"]
    assert [x for e in events[:-1] for x in e["logprobs"]] == stored
    assert len(events[2]["logprobs"]) == 3


def test_failed_and_canceled_jobs_get_their_terminal_events(run_worker, r, q, rq):
    bad = enqueue(q, prompt="x", max_tokens=6, temperature=-1)
    canceled = enqueue(q, prompt="x", max_tokens=6)
    Client(r).cancel(canceled.id)
    worker = run_worker()
    wait_status(r, bad, "failed")
    worker.stop()
    for job_id in (bad.id, canceled.id):
        lose_the_end(r, job_id, keep=0, marked=False)
        assert seal.repair(r, rq, job_id, "ghost")
    (error,) = stream_events(r, bad.id)
    assert (
        error["type"] == "error"
        and "temperature" in error["message"]
        and "RoseJobError" not in error["message"]
    )
    assert [(e["type"], e["reason"]) for e in stream_events(r, canceled.id)] == [("canceled", "canceled")]


def test_a_job_that_runs_again_or_is_held_is_left_alone(r, q, rq):
    queued = enqueue(q, prompt="x", max_tokens=6)
    assert seal.repair(r, rq, queued.id) is False and stream_events(r, queued.id) == []
    r.hset(keys.SEALS_KEY, queued.id, "someone")  # a live worker holds its end: nothing is written under it
    r.hset(queued.key, "status", "finished")
    assert seal.repair(r, rq, queued.id) is False and stream_events(r, queued.id) == []


def test_a_live_workers_marker_and_this_workers_own_held_are_not_repaired(r, rq):
    r.hset(keys.SEALS_KEY, mapping={"a": "alive", "b": rq.name})
    watch = seal.SealWatch()
    for _ in range(3):  # our own, held or with events in flight
        assert watch.scan(rq, lambda owner: owner == "alive", held=lambda job_id: job_id == "b") == 0
    assert r.hgetall(keys.SEALS_KEY) == {b"a": b"alive", b"b": rq.name.encode()}
    assert (
        watch.scan(rq, DEAD, held=NOT_HELD, predecessor=True) == 0
    )  # a predecessor's marker of a job gone: claimed, no event
    assert r.hgetall(keys.SEALS_KEY) == {b"a": b"alive"}


def test_this_workers_own_marker_is_repaired_at_once_when_nothing_of_it_is_in_flight(run_worker, r, q, rq):
    """Its done event was refused by Redis: the worker knows it owes nothing more, so the first scan repairs it,
    busy or not (other jobs' events in flight do not matter)."""
    job = finished_job(run_worker, r, q, 4)
    lose_the_end(r, job.id, keep=4, marked=False)  # its done event dropped (Redis refused the batch)
    r.hset(keys.SEALS_KEY, job.id, rq.name)
    watch = seal.SealWatch()
    assert watch.scan(rq, DEAD, held=lambda job_id: job_id == job.id) == 0  # still ours: in progress
    assert watch.scan(rq, DEAD, held=lambda job_id: job_id == "another") == 1
    assert audit(r, job.id) == []


def test_a_stream_with_a_gap_starts_over_from_the_stored_result(run_worker, r, q, rq):
    """Redis lost a token event in the middle (a failover): the repair cannot append to a gap, so the stream starts
    over after a reset with the stored text, then ends."""
    job = finished_job(run_worker, r, q, 6)
    lose_the_end(r, job.id, keep=6)  # the done event lost...
    r.xdel(keys.stream_key(job.id), r.xrange(keys.stream_key(job.id))[2][0])  # ...and token 2
    assert seal.SealWatch().scan(rq, DEAD, held=NOT_HELD) == 0  # a dead worker's marker: seen once first
    watch = seal.SealWatch()
    watch.scan(rq, DEAD, held=NOT_HELD)
    assert watch.scan(rq, DEAD, held=NOT_HELD) == 1
    assert audit(r, job.id) == []
    types = [e["type"] for e in stream_events(r, job.id)]
    assert types == ["token"] * 5 + ["reset", "token", "done"]


def test_a_stream_that_disagrees_with_the_result_starts_over(run_worker, r, q, rq):
    job = finished_job(run_worker, r, q, 3)
    lose_the_end(r, job.id, keep=3, marked=False)
    first = r.xrange(keys.stream_key(job.id))[0][0]
    r.xdel(keys.stream_key(job.id), first)
    r.xadd(
        keys.stream_key(job.id),
        {"event": '{"job_id":"x","type":"token","seq":2,"text":"no","token_ids":[9]}'},
    )
    assert seal.repair(r, rq, job.id, "ghost")
    assert audit(r, job.id) == []


def test_a_job_that_cannot_be_read_does_not_stop_the_others_repair(run_worker, r, q, rq):
    job = finished_job(run_worker, r, q, 4)
    lose_the_end(r, job.id, keep=1)
    r.xadd(keys.stream_key("broken"), {"not-event": "x"})  # a stream entry without the event field
    r.hset("rq:job:broken", mapping={"status": "finished"})
    r.hset(keys.SEALS_KEY, "broken", "ghost")
    watch = seal.SealWatch()
    watch.scan(rq, DEAD, held=NOT_HELD)
    assert watch.scan(rq, DEAD, held=NOT_HELD) == 1 and audit(r, job.id) == []
