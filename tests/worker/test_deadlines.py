"""Deadlines (issue 28): the job field `deadline` (Unix time) reaches the engine (earliest deadline first among
waiting requests of one priority: tests/engine/test_scheduling.py); a job whose deadline passed before it started (this attempt)
fails at once with "deadline exceeded", without tokens or retry; one whose deadline passes while it runs goes on,
or fails so with --deadline-policy abort. Counted on /metrics by when."""

from __future__ import annotations

import time

import pytest
from rq import Retry
from rq.job import Job
from rq.serializers import JSONSerializer
from test_metrics import scrape, value
from worker_helpers import FakeEngine, check_stream, enqueue, stream_events, wait_for, wait_status

from rose.jobs.client import Client
from rose.jobs.errors import InvalidRequest

pytestmark = pytest.mark.timeout(120)


def failure(r, job) -> str:
    return Job.fetch(job.id, connection=r, serializer=JSONSerializer).latest_result().exc_string


def test_a_job_past_its_deadline_fails_before_it_starts_without_tokens_or_retry(run_worker, r, q):
    engine = FakeEngine()
    wt = run_worker(engine=engine, metrics_port=0)
    due = time.time() + 60
    late = enqueue(q, prompt="a b", deadline=time.time() - 5, retry=Retry(max=3))
    on_time = enqueue(q, prompt="a b", deadline=due)
    wait_status(r, late, "failed")  # at once, for good: Retry does not apply
    wait_status(r, on_time, "finished")
    assert failure(r, late).startswith("DeadlineExceeded")  # rose.worker.endings.DeadlineExceeded
    assert "deadline exceeded: the job's deadline " in failure(
        r, late
    ) and "passed before this attempt started" in failure(r, late)
    assert late.id not in engine.added  # never reached the engine: no tokens
    events = check_stream(r, late.id, "error")  # published right after the failure is stored
    assert [e["type"] for e in stream_events(r, late.id)] == ["error"] and "deadline exceeded" in events[0][
        "message"
    ]
    assert engine.deadlines[on_time.id] == pytest.approx(due)  # the engine orders by it
    samples = scrape(wt.worker.metrics_server.port)
    assert value(samples, "rose_request_deadline_exceeded_total", when="queued") == 1
    assert value(samples, "rose_request_deadline_exceeded_total", when="running") == 0


@pytest.mark.parametrize("policy", ["continue", "abort"])
def test_a_deadline_passing_while_the_job_runs(run_worker, r, q, policy):
    engine = FakeEngine(max_model_len=512, step_delay=0.02)
    wt = run_worker(engine=engine, metrics_port=0, deadline_policy=policy, check_interval=0.05)
    job = enqueue(q, prompt="a b", max_tokens=150, deadline=time.time() + 1.5, retry=Retry(max=3))
    if policy == "continue":  # 150 steps of 20 ms: it runs past its deadline and finishes
        wait_status(r, job, "finished", timeout=30)
        assert (
            len(Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()["token_ids"]) == 150
        )
        return
    wait_status(r, job, "failed", timeout=30)
    assert "passed while it ran (rose-worker --deadline-policy abort)" in failure(r, job)
    events = check_stream(r, job.id, "error")  # published right after the failure is stored
    assert any(e["type"] == "token" for e in events)  # it had run
    assert job.id in engine.aborted and job.id not in engine.requests  # aborted in the engine
    wait_for(
        lambda: (
            value(
                scrape(wt.worker.metrics_server.port), "rose_request_deadline_exceeded_total", when="running"
            )
            == 1
        ),
        10,
        what="the counter",
    )


def test_tenant_and_deadline_are_checked_where_the_job_is_made(r):
    with pytest.raises(ValueError, match="tenant must be a non-empty string"):
        Client(r, tenant=" ")
    client = Client(r, tenant="team-a")
    with pytest.raises(InvalidRequest, match="'tenant' is empty"):
        client.submit("hi", tenant=" ")
    with pytest.raises(InvalidRequest, match=r"'deadline' must be a Unix time in seconds \(> 0\), got -1.0"):
        client.submit("hi", deadline=-1)
    job = client.submit("hi", deadline=1e10, max_tokens=2)
    assert job.rq_job.kwargs == {"prompt": "hi", "deadline": 1e10, "max_tokens": 2, "tenant": "team-a"}
    assert client.submit("hi", tenant="team-b").rq_job.kwargs["tenant"] == "team-b"  # a job's own wins
    (many,) = client.submit_many(["x"])
    assert many.rq_job.kwargs["tenant"] == "team-a"


@pytest.mark.parametrize(
    ("deadline", "why"),
    [
        (600, "looks like a duration"),
        (1.8e12, "looks like milliseconds"),
        (float("nan"), "must be a Unix time"),
    ],
)
def test_a_deadline_in_other_units_is_refused(r, deadline, why):
    with pytest.raises(InvalidRequest, match=why):
        Client(r).submit("hi", deadline=deadline)
