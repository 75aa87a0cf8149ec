"""No job is lost when a worker dies: orphans are requeued (at once for a same-name restart), poison jobs fail."""

from __future__ import annotations

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import FakeEngine, registered_rq_worker, start_jobs, stream_events, wait_for

from rose.config import WorkerSettings
from rose.jobs import keys
from rose.jobs.client import Client, JobFailed
from rose.worker import NameInUse, RoseWorker
from rose.worker.rq_worker import RQWorker

pytestmark = pytest.mark.timeout(60)


def ghost_takes_jobs(redis_server, n: int, name: str = "ghost") -> RQWorker:
    """A worker that registers, starts `n` jobs and emits a token for each, then 'dies' (connections dropped)."""
    ghost = registered_rq_worker(redis_server, name)
    conn = ghost.connection
    runs = start_jobs(ghost, n)
    for run in runs:
        conn.xadd(
            keys.stream_key(run.id),
            {
                keys.STREAM_FIELD: f'{{"job_id":"{run.id}","type":"token","seq":0,'
                f'"text":"lost","token_ids":[9]}}'
            },
        )
    conn.connection_pool.disconnect()  # kill -9: the kernel closes its sockets
    return ghost


def finished_text(r, job_id: str) -> str:
    wait_for(lambda: r.hget(Job.key_for(job_id), "status") == b"finished", 20, what=f"{job_id} finished")
    return Job.fetch(job_id, connection=r, serializer=JSONSerializer).return_value()["text"]


def assert_replay_consistent(r, job_id: str) -> None:
    text = finished_text(r, job_id)
    wait_for(lambda: stream_events(r, job_id)[-1]["type"] == "done", 5, what="done event")
    events = stream_events(r, job_id)
    last_reset = max(i for i, e in enumerate(events) if e["type"] == "reset")
    current = events[last_reset + 1 :]
    assert [e.get("seq") for e in current] == list(range(len(current)))
    assert "".join(e["text"] for e in current if e["type"] == "token") == text
    assert list(Client(r).job(job_id).stream(timeout=5)) == [
        e["text"] for e in current if e["type"] == "token"
    ]


def test_dead_workers_jobs_are_requeued_by_a_live_worker(redis_server, r, run_worker):
    client = Client(r)
    jobs = client.submit_many([{"prompt": "a b", "max_tokens": 3} for _ in range(3)])
    ghost_takes_jobs(redis_server, 3)
    r.delete("rq:worker:ghost")  # its heartbeat lapsed
    run_worker(name="alive")
    for j in jobs:
        assert_replay_consistent(r, j.id)
        job = Job.fetch(j.id, connection=r, serializer=JSONSerializer)
        assert job.meta[keys.META_REQUEUES] == 1
        assert job.meta[keys.META_LAST_WORKER] == "ghost"
    assert r.zcard("rq:wip:rose") == 0


def test_live_workers_jobs_are_left_alone(redis_server, r, run_worker):
    job = Client(r).submit("a b", max_tokens=3)
    other = registered_rq_worker(redis_server, "busy")
    other.heartbeat()
    start_jobs(other, 1)
    wt = run_worker(name="scanner", recovery_interval=0.2)
    import time

    time.sleep(1.0)
    assert r.hget(Job.key_for(job.id), "status") == b"started"
    assert r.hget(Job.key_for(job.id), "worker_name") == b"busy"
    wt.stop()


def test_same_name_restart_requeues_at_once(redis_server, r, run_worker):
    jobs = Client(r).submit_many(["a b", "c d"], max_tokens=3)
    ghost_takes_jobs(redis_server, 2, name="stable")
    assert r.exists("rq:worker:stable")  # the killed worker's key is still there
    run_worker(name="stable", recovery_interval=3600)  # no periodic scan: only the start-up takeover
    for j in jobs:
        assert_replay_consistent(r, j.id)


def test_a_live_worker_name_cannot_be_taken(redis_server, run_worker):
    run_worker(name="unique")
    with pytest.raises(NameInUse, match="unique"):
        RoseWorker(
            ["rose"],
            engine=FakeEngine(),
            connection=redis_server.client(),
            name="unique",
            settings=WorkerSettings(redis_url=redis_server.url),
        )


def test_poison_job_fails_after_max_requeues(redis_server, r, run_worker):
    job = Client(r).submit("a b", max_tokens=3, meta={keys.META_REQUEUES: 3})
    ghost_takes_jobs(redis_server, 1)
    r.delete("rq:worker:ghost")
    run_worker(max_requeues=3)
    wait_for(lambda: r.hget(Job.key_for(job.id), "status") == b"failed", 10, what="poison job failed")
    with pytest.raises(JobFailed, match="requeued 3 times after its worker died"):
        Client(r).job(job.id).result(timeout=1)
    wait_for(
        lambda: [e["type"] for e in stream_events(r, job.id)][-2:] == ["reset", "error"], 5, what="events"
    )


def test_job_stuck_between_dequeue_and_start_is_requeued(redis_server, r, run_worker):
    job = Client(r).submit("a b", max_tokens=2)
    r.lmove("rq:queue:rose", "rq:queue:rose:intermediate", "LEFT", "RIGHT")  # a worker died right after LMOVE
    run_worker(recovery_interval=0.2)
    assert finished_text(r, job.id)
    assert r.llen("rq:queue:rose:intermediate") == 0
