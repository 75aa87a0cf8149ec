"""asyncio twins of `Client` and `Job` for web applications: streams and waits use redis.asyncio; enqueue and
cancel (one short round trip each) run RQ's synchronous code in a thread.

Also importable as `rose.AsyncClient`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from rq.job import Job as RQJob

from rose.jobs import keys
from rose.jobs.client import Client, Job, JobFailed
from rose.jobs.connection import connect_async
from rose.jobs.stream_reader import POLL_S, Cursor, TextDeltas

__all__ = ["AsyncClient", "AsyncJob"]


class AsyncJob:
    """asyncio twin of `Job`."""

    def __init__(self, client: AsyncClient, job_id: str):
        self.client = client
        self.id = job_id
        self._sync = Job(client._sync, job_id)

    async def events(self, timeout: float | None = None) -> AsyncIterator[Any]:
        r = self.client.redis
        stream = keys.stream_key(self.id)
        cursor = Cursor(self.id, timeout)
        events: Iterable[Any] | None = cursor.stored(await r.xrange(stream))
        while True:
            for event in events or ():
                yield event
            if cursor.ended:
                return
            events = cursor.read(
                await r.xread({stream: cursor.last_id}, block=int(POLL_S * 1000), count=1000)
            )
            if events is None:
                await asyncio.to_thread(self._sync.raise_if_ended_silently, cursor.quiet_polls)
                cursor.check_timeout()

    async def stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        deltas = TextDeltas(self.id)
        async for event in self.events(timeout=timeout):
            if (text := deltas.delta(event)) is not None:
                yield text

    async def result(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.05
        while True:
            raw = await self.client.redis.hget(RQJob.key_for(self.id), "status")
            if raw is None:
                raise JobFailed(self.id, "job does not exist (expired or deleted)")
            if raw.decode() in ("finished", "failed", "canceled", "stopped"):
                # Decoding results is RQ's business; it is quick once the job has ended.
                return await asyncio.to_thread(self._sync.result, 0)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} still {raw.decode()} after {timeout} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def cancel(self) -> bool:
        return await self.client.cancel(self.id)


class AsyncClient:
    """asyncio twin of `Client` for web applications (streams and waits use redis.asyncio)."""

    def __init__(
        self,
        redis_url: str = "redis://localhost:6379/0",
        queue: str = keys.DEFAULT_QUEUE,
        tenant: str | None = None,
    ):
        self.redis = connect_async(redis_url)
        # RQ is synchronous: enqueue/cancel (short, one round trip) run in a thread with their own connection.
        self._sync = Client(redis_url, queue=queue, tenant=tenant)

    async def submit(self, prompt: str | list[int] | None = None, **options: Any) -> AsyncJob:
        """Enqueue one job (see `Client.submit`): invalid arguments raise InvalidRequest (a ValueError, with the
        worker's message) before anything is enqueued."""
        job = await asyncio.to_thread(self._sync.submit, prompt, **options)
        return AsyncJob(self, job.id)

    async def submit_many(self, requests: Iterable[Any], **common: Any) -> list[AsyncJob]:
        jobs = await asyncio.to_thread(self._sync.submit_many, list(requests), **common)
        return [AsyncJob(self, j.id) for j in jobs]

    async def chat(self, messages: list[dict[str, Any]], **options: Any) -> AsyncJob:
        """Enqueue one chat job (see `Client.chat`)."""
        return await self.submit(messages=messages, **options)

    def job(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, job_id)

    async def cancel(self, job_id: str) -> bool:
        return await asyncio.to_thread(self._sync.cancel, job_id)

    async def aclose(self) -> None:
        await self.redis.aclose()
        self._sync.redis.close()
