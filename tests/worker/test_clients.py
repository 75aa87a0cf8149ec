"""rose.Client / AsyncClient against a running worker (fake engine, real redis-server)."""

from __future__ import annotations

import asyncio

import pytest
from worker_helpers import FakeEngine, wait_for

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
