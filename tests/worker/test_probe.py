"""The per-step probe: only jobs that are no longer started by this worker come back, with the queue lengths, and
the in-flight variant (sent before the step, read after it) says the same thing."""

from __future__ import annotations

import pytest
import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from worker_helpers import probe_target, registered_rq_worker, start_jobs

from rose.jobs.client import Client
from rose.worker import probe

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def worker(redis_server):
    w = registered_rq_worker(redis_server, "prober", queues=("rose", "low"))
    yield w
    w.connection.close()


def started_runs(worker, r, n: int):
    client = Client(r, queue="rose")
    for i in range(n):
        client.submit(f"prompt {i}", max_tokens=4)
    return start_jobs(worker, n)


def set_status(r, run, status: str, owner: str | None = None) -> None:
    r.hset(run.job.key, "status", status)
    if owner is not None:
        r.hset(run.job.key, "worker_name", owner)


def describe(found) -> dict[str, tuple[str | None, str]]:
    return {a.run.id: (a.status, a.owner) for a in found}


def test_reports_only_jobs_that_are_not_ours_any_more(worker, r):
    runs = started_runs(worker, r, 5)
    Client(r, queue="low").submit("waiting", max_tokens=1)
    Client(r, queue="low").submit("waiting", max_tokens=1)
    reply = probe.probe(probe_target(worker), runs)
    assert reply.found == [] and reply.lengths == [0, 2] and reply.canceled is None

    Job.fetch(runs[0].id, connection=r, serializer=JSONSerializer).cancel()
    r.delete(runs[1].job.key)
    set_status(r, runs[2], JobStatus.STARTED.value, owner="someone-else")
    set_status(r, runs[3], JobStatus.FINISHED.value)
    reply = probe.probe(probe_target(worker), runs)
    assert describe(reply.found) == {
        runs[0].id: ("canceled", "prober"),
        runs[1].id: (None, ""),
        runs[2].id: ("started", "someone-else"),
        runs[3].id: ("finished", "prober"),
    }
    assert reply.lengths == [0, 2]


def test_signals_are_the_canceled_registries_sizes_whatever_the_number_of_jobs(worker, r):
    """One command a queue: a cancel anywhere changes a size (the watch then reads the statuses)."""
    runs = started_runs(worker, r, 3)
    assert probe.probe(probe_target(worker), [], signals=True).canceled == (0, 0)
    Job.fetch(runs[0].id, connection=r, serializer=JSONSerializer).cancel()
    Client(r, queue="low").cancel(Client(r, queue="low").submit("waiting", max_tokens=1).id)
    reply = probe.probe(probe_target(worker), [], signals=True)
    assert reply.canceled == (1, 1) and reply.found == []
    flight = probe.InFlightProbe(probe_target(worker))
    flight.send(runs, signals=True)
    reply = flight.receive()
    assert reply.canceled == (1, 1) and describe(reply.found) == {runs[0].id: ("canceled", "prober")}


def test_in_flight_probe_matches_the_plain_one_even_after_a_script_flush(worker, r):
    runs = started_runs(worker, r, 3)
    Job.fetch(runs[1].id, connection=r, serializer=JSONSerializer).cancel()
    flight = probe.InFlightProbe(probe_target(worker))
    for flush in (False, True):
        if flush:
            r.script_flush()  # a restarted Redis forgets its scripts: the probe sends its body each time
        flight.send(runs)
        assert flight.pending
        reply = flight.receive()
        assert not flight.pending
        assert describe(reply.found) == {runs[1].id: ("canceled", "prober")}
        assert reply.lengths == [0, 0]
    # the connection went back to the pool in a clean state: the next commands get their own replies
    assert worker.connection.ping() is True
    assert probe.probe(probe_target(worker), []).lengths == [0, 0]


def test_abandoned_probe_leaves_no_stray_reply(worker, r):
    runs = started_runs(worker, r, 2)
    flight = probe.InFlightProbe(probe_target(worker))
    flight.send(runs)
    flight.abandon()
    assert not flight.pending
    assert worker.connection.llen("rq:queue:rose") == 0
    assert worker.connection.get("no-such-key") is None


def test_unreachable_redis_raises_a_connection_error(worker):
    dead = probe.Target(redis.Redis(port=1, socket_connect_timeout=0.2), worker.name, ("rq:queue:rose",))
    with pytest.raises(redis.ConnectionError):
        probe.InFlightProbe(dead).send([])
    with pytest.raises(redis.ConnectionError):
        probe.probe(dead, [])
