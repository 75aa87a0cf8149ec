"""rose.worker.rq_start / rose.worker.intake: a take's starts go out as one coalesced transaction (one write a take
for the keys its jobs share) and leave Redis as RQ's own start writes sent one by one; a job restarted is seen; a
job canceled or deleted while its id waits on the queue is dropped, not started."""

from __future__ import annotations

import pytest
import redis
from rq.executions import Execution
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from worker_helpers import registered_rq_worker

from rose.jobs.client import Client
from rose.worker import rq_start
from rose.worker.fair_queue import FairQueue
from rose.worker.intake import Intake
from rose.worker.running import Running

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rq(redis_server, r):
    worker = registered_rq_worker(redis_server, "starter")
    yield worker
    worker.connection.close()


def submit(r, n: int, **fields) -> list[str]:
    client = Client(r, queue="rose")
    return [client.submit(f"prompt {i}", max_tokens=2, **fields).id for i in range(n)]


def start_state(r, run) -> dict:
    """What RQ's start leaves in Redis for one job, minus ids and instants (TTLs to the second, scores as TTLs)."""
    now = r.time()[0]
    job = Job.fetch(run.id, connection=r, serializer=JSONSerializer)
    execution = Execution.fetch(run.execution.id, run.id, connection=r)
    registry = StartedJobRegistry("rose", connection=r)
    score = r.zscore(registry.key, run.composite_key)
    executions_key = f"rq:executions:{run.id}"
    return {
        "status": job.get_status(),
        "worker_name": job.worker_name,
        "job_fields": sorted(r.hkeys(job.key)),
        "job_ttl": r.ttl(job.key),
        "execution_fields": sorted(r.hkeys(execution.key)),
        "execution_worker": execution.worker_name,
        "execution_ttl": round(r.ttl(execution.key), -1),
        "executions_ttl": round(r.ttl(executions_key), -1),
        "executions_score": round(r.zscore(executions_key, run.execution.id) - now, -1),
        "started_score": round(score - now, -1),
        "worker_index": run.composite_key.encode() in r.smembers("rq:worker:starter:executions"),
        "intermediate": r.lrange("rq:queue:rose:intermediate", 0, -1),
        "started_at_matches_execution": abs(job.started_at.timestamp() - execution.created_at.timestamp())
        < 1,
    }


def rqs_own_start(rq, n: int) -> list[Running]:
    """Start `n` queued jobs with RQ's start writes sent one by one in a transaction (no coalescing)."""
    conn = rq.connection
    taken = rq_start.dequeue(conn, rq.queues, n, rq.serializer)
    runs = []
    with conn.pipeline() as pipe:
        for job_id, queue, job in taken:
            rq_start.settle_dequeued(pipe, queue, job_id)
            run = Running(job=job, queue=queue, execution=None, started_wall=0, started_mono=0, timeout=180)
            run.execution = rq_start.record_start(pipe, rq, job, run.registry_ttl())
            runs.append(run)
        pipe.execute()
    return runs


def test_a_coalesced_start_leaves_redis_as_rqs_start_writes_one_by_one(rq, r, monkeypatch):
    sent = []
    real_coalesced = rq_start.coalesced

    def coalesced(commands):
        sent.append(real_coalesced(commands))
        return sent[-1]

    monkeypatch.setattr(rq_start, "coalesced", coalesced)
    submit(r, 3)
    by_rq = rqs_own_start(rq, 3)
    submit(r, 3)
    by_intake = Intake(rq).take(3, None)
    assert len(by_intake) == 3
    expected = start_state(r, by_rq[0])
    assert expected["status"] == "started" and expected["job_ttl"] == -1 and expected["worker_index"]
    for run in by_rq + by_intake:
        assert start_state(r, run) == expected
    for run in by_intake:  # in memory as RQ's start leaves them
        assert run.job.get_status(refresh=False) == "started" and run.job.worker_name == "starter"
        assert run.execution.id in rq.executions and not run.restarted
    assert rq.get_state() == "busy" and r.hget(rq.key, "state") == b"busy"
    # RQ writes the StartedJobRegistry and the worker's execution index once a job: coalesced, once a take
    (written,) = sent
    shared = [c[:2] for c in written if c[1] in ("rq:wip:rose", "rq:worker:starter:executions")]
    assert sorted(shared) == [
        ("EXPIRE", "rq:worker:starter:executions"),
        ("SADD", "rq:worker:starter:executions"),
        ("ZADD", "rq:wip:rose"),
    ]


def test_a_restarted_job_is_seen(rq, r):
    (job_id,) = submit(r, 1)
    r.xadd(f"rose:stream:{job_id}", {"event": "{}"})  # an earlier attempt's events
    (run,) = Intake(rq).take(1, None)
    assert run.id == job_id and run.restarted


def test_a_job_canceled_or_deleted_on_the_queue_is_dropped_not_started(rq, r):
    ids = submit(r, 3)
    r.hset(Job.key_for(ids[1]), "status", "canceled")  # a cancel racing the dequeue
    r.delete(Job.key_for(ids[2]))  # and one vanished
    runs = Intake(rq).take(3, None)
    assert [run.id for run in runs] == [ids[0]]
    assert r.hget(Job.key_for(ids[1]), "status") == b"canceled"
    assert r.lrange("rq:queue:rose:intermediate", 0, -1) == []


class NoAccounts:
    """A fair take's accounts with nothing owed (rose.worker.fair_queue.Accounts)."""

    def typical(self):
        return None

    def take_pending(self):
        return {}

    def owe(self, charges) -> None:
        pass

    def prepaid(self, job_id, tenant, tokens) -> None:
        pass


def assert_left_nothing(r, rq, job_id: str) -> None:
    assert not r.exists(Job.key_for(job_id)) and not r.keys(f"rq:execution:{job_id}:*")
    assert not r.exists(f"rq:executions:{job_id}")
    started = StartedJobRegistry("rose", connection=r)
    assert job_id not in [i for i, _ in started.get_job_and_execution_ids()]
    assert all(execution.job_id != job_id for execution in rq.executions.values())
    assert r.lrange("rq:queue:rose:intermediate", 0, -1) == []


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_job_deleted_between_its_take_and_its_start_is_not_started_and_leaves_nothing(
    rq, r, monkeypatch, policy
):
    """The take's script reads a job's status and timeout only; the start reads its hash after its writes. A job
    deleted in between finds a hash the start's writes made: that start is taken back (the hash and its execution
    deleted), the others stand."""
    ids = submit(r, 2)
    real_execute = rq_start.Recorder.execute

    def delete_first(recorder, reads=()):
        r.delete(Job.key_for(ids[1]))
        return real_execute(recorder, reads)

    monkeypatch.setattr(rq_start.Recorder, "execute", delete_first)
    fair = FairQueue(r, JSONSerializer, {}, NoAccounts()) if policy == "fair" else None
    runs = Intake(rq, fair).take(2, None)
    assert [run.id for run in runs] == ids[:1]
    assert runs[0].job.kwargs["prompt"] == "prompt 0" and runs[0].job.get_status(refresh=False) == "started"
    assert_left_nothing(r, rq, ids[1])
    assert set(rq.executions) == {runs[0].execution.id}


def test_a_start_whose_reply_was_lost_takes_back_a_job_deleted_before_it(rq, r, monkeypatch):
    """The start went through, its reply did not, and one of its jobs had been deleted before it: the next take
    carries on with the job it did start and takes the other's start back."""
    ids = submit(r, 2)
    real_execute = rq_start.Recorder.execute

    def delete_first_lose_reply(recorder, reads=()):
        r.delete(Job.key_for(ids[1]))
        real_execute(recorder, reads)
        raise redis.ConnectionError("reply lost")

    monkeypatch.setattr(rq_start.Recorder, "execute", delete_first_lose_reply)
    intake = Intake(rq)
    with pytest.raises(redis.ConnectionError):
        intake.take(2, None)
    monkeypatch.undo()
    runs = intake.take(2, None)  # the limbo's: adopted
    assert [run.id for run in runs] == ids[:1] and runs[0].job.kwargs["prompt"] == "prompt 0"
    assert_left_nothing(r, rq, ids[1])
