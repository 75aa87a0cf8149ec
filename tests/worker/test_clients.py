"""rose.Client / AsyncClient against a running worker (fake engine, real redis-server)."""

from __future__ import annotations

import asyncio

import pytest
from worker_helpers import FakeEngine, stream_events, wait_for

from rose.jobs.async_client import AsyncClient
from rose.jobs.client import Client, JobCanceled, JobFailed

pytestmark = pytest.mark.timeout(60)


def test_client_submit_stream_result(run_worker, r, redis_server):
    run_worker(engine=FakeEngine(step_delay=0.01))
    client = Client(redis_server.url)
    job = client.submit("a b c", max_tokens=5, metadata={"req": 7})
    text = "".join(job.stream(timeout=10))
    result = job.result(timeout=10)
    assert text == result["text"] == "w0 w1 w2 w3 w4 "
    assert result["metadata"] == {"req": 7}
    with pytest.raises(JobFailed, match="unknown field"):
        # bypass local validation: a plain-RQ producer sending a typo
        client.job(client.queue.enqueue("rose.jobs.generate", kwargs={"prompt": "x", "mx": 1}).id).result(10)


def test_canceled_queued_job_never_starts(run_worker, r, redis_server):
    engine = FakeEngine(max_num_seqs=1, step_delay=0.02)
    client = Client(redis_server.url)
    busy = client.submit("x", max_tokens=40)
    queued = client.submit("y", max_tokens=2)
    run_worker(engine=engine)
    wait_for(lambda: busy.status() == "started", what="busy started")
    assert queued.cancel()
    with pytest.raises(JobCanceled):
        list(queued.stream(timeout=10))
    assert busy.result(timeout=20)["finish_reason"] == "length"
    assert queued.id not in engine.added


def test_async_client(run_worker, redis_server):
    run_worker(engine=FakeEngine(step_delay=0.01))

    async def main():
        client = AsyncClient(redis_server.url)
        try:
            job = await client.submit("a b", max_tokens=4)
            deltas = [d async for d in job.stream(timeout=10)]
            result = await job.result(timeout=10)
            assert "".join(deltas) == result["text"]
            many = await client.submit_many(["x", "y"], max_tokens=2)
            results = await asyncio.gather(*(j.result(timeout=10) for j in many))
            assert [res["usage"]["completion_tokens"] for res in results] == [2, 2]
            long = await client.submit("z", max_tokens=60)
            async for _ in long.stream(timeout=10):
                assert await long.cancel()
                break
            with pytest.raises(JobCanceled):
                await long.result(timeout=10)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_stream_false_job_streams_no_text_and_ends_cleanly(run_worker, r, redis_server):
    """A job sent with stream=False: Job.stream() / AsyncJob.stream(), started while it is queued, yield no text and
    end when it finishes (its stream holds only the done event, seq 0); result() has the whole text."""
    client = Client(redis_server.url)
    job = client.submit("a b c", max_tokens=30, stream=False)  # queued: no worker yet
    run_worker(engine=FakeEngine(step_delay=0.02))
    assert list(job.stream(timeout=10)) == []
    result = job.result(timeout=10)
    assert result["text"] == "".join(f"w{k} " for k in range(30))
    assert result["usage"]["completion_tokens"] == 30
    events = stream_events(r, job.id)
    assert [(e["type"], e["seq"]) for e in events] == [("done", 0)]
    assert events[0]["usage"]["completion_tokens"] == 30
    assert [e.type for e in job.events(timeout=10)] == ["done"]  # replayed after the end: the same

    async def main():
        aclient = AsyncClient(redis_server.url)
        try:
            ajob = await aclient.submit("x y", max_tokens=20, stream=False)
            deltas = [d async for d in ajob.stream(timeout=10)]
            result = await ajob.result(timeout=10)
            return ajob.id, deltas, result
        finally:
            await aclient.aclose()

    job_id, deltas, result = asyncio.run(main())
    assert deltas == [] and result["text"] == "".join(f"w{k} " for k in range(20))
    assert [e["type"] for e in stream_events(r, job_id)] == ["done"]
