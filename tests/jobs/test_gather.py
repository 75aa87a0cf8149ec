"""Client.results / Client.as_completed: many jobs waited for at once, each outcome as Job.result() gives it."""

from __future__ import annotations

import threading
import time

import pytest
from rq.job import Job as RQJob
from rq.job import JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from rose.jobs import gather
from rose.jobs.client import Client, JobCanceled, JobFailed

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def client(r):
    return Client(r, queue="rose")


def end(r, job_id: str, value=None, error: str | None = None, pipeline=None) -> None:
    """What a worker stores when a job ends (RQ's Result and status, in one transaction)."""
    job = RQJob.fetch(job_id, connection=r, serializer=JSONSerializer)
    pipe = pipeline if pipeline is not None else r.pipeline()
    if error is None:
        Result.create(job, Result.Type.SUCCESSFUL, ttl=100, return_value=value, pipeline=pipe)
        job.set_status(JobStatus.FINISHED, pipeline=pipe)
    else:
        Result.create(job, Result.Type.FAILED, ttl=100, exc_string=error, pipeline=pipe)
        job.set_status(JobStatus.FAILED, pipeline=pipe)
    if pipeline is None:
        pipe.execute()


def later(delay: float, fn, *args) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn(*args)), daemon=True)
    t.start()
    return t


def test_results_come_in_the_order_given_and_as_completed_in_the_order_they_end(client, r):
    jobs = client.submit_many([{"prompt": f"p{i}"} for i in range(4)])
    end(r, jobs[2].id, {"text": "two"})  # before anyone waits
    for delay, i in ((0.3, 0), (0.1, 3), (0.5, 1)):
        later(delay, end, r, jobs[i].id, {"text": f"job {i}"})
    order = [job.id for job, _ in client.as_completed(jobs, timeout=10)]
    assert order == [jobs[i].id for i in (2, 3, 0, 1)]
    values = client.results(jobs, timeout=10)
    assert [v["text"] for v in values] == ["job 0", "job 1", "two", "job 3"]


def test_failed_and_canceled_jobs(client, r):
    ok, bad, dropped = client.submit_many([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    end(r, ok.id, {"text": "fine"})
    end(r, bad.id, error="ValueError: no good\n")
    dropped.cancel()
    values = client.results([ok, bad, dropped], timeout=10, return_exceptions=True)
    assert values[0] == {"text": "fine"}
    assert isinstance(values[1], JobFailed) and "no good" in str(values[1])
    assert isinstance(values[2], JobCanceled)
    with pytest.raises(JobFailed, match="no good"):
        client.results([ok, bad], timeout=10)


def test_a_deleted_job_fails_and_a_late_one_times_out(client, r):
    gone, slow = client.submit_many([{"prompt": "a"}, {"prompt": "b"}])
    r.delete(f"rq:job:{gone.id}")
    (value,) = client.results([gone], timeout=5, return_exceptions=True)
    assert isinstance(value, JobFailed) and "does not exist" in str(value)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="1 jobs still pending"):
        client.results([slow], timeout=0.3)
    assert time.monotonic() - t < 2


def test_blocks_until_a_result_instead_of_polling(client, r, monkeypatch):
    jobs = client.submit_many([{"prompt": f"p{i}"} for i in range(20)])
    reads = []
    real = r.xread
    monkeypatch.setattr(client.redis, "xread", lambda *a, **k: reads.append(real(*a, **k)) or reads[-1])

    def end_all():  # the jobs of one engine step, retired in one transaction
        pipe = r.pipeline()
        for job in jobs:
            end(r, job.id, {"text": "x"}, pipeline=pipe)
        pipe.execute()

    later(0.4, end_all)
    t = time.monotonic()
    assert len(client.results(jobs, timeout=10)) == 20
    assert time.monotonic() - t < gather.POLL_S + 0.5
    # woken by the results (Redis may serve a blocked read after the first of them), not by a timer nor per job
    assert len(reads) <= 3, [len(x or []) for x in reads]
