"""Sends job events to Redis from a background thread, so the engine loop never waits on the network.

Each batch handed over (one engine step's events) goes out in one pipeline: PUBLISH on the job's channel and XADD
to its stream, then one EXPIRE per stream. Batches are sent in order; on a connection error the batch is retried
with backoff, never dropped, so a subscriber sees seq without gaps even across a Redis blip.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import redis

from rose.jobs import keys

log = logging.getLogger(__name__)

NO_EXPIRY = -1


@dataclass(frozen=True, slots=True)
class Outgoing:
    job_id: str
    data: str  # event JSON
    stream_ttl: int  # seconds; NO_EXPIRY to persist the stream


class Publisher:
    def __init__(self, connection: redis.Redis, *, max_backoff: float = 5.0):
        self.connection = connection
        self.max_backoff = max_backoff
        self._queue: queue.Queue[list[Outgoing] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._unsent = 0  # batches handed over and not yet written
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rose-publisher", daemon=True)
        self.sent_events = 0

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def send(self, batch: list[Outgoing]) -> None:
        """Hand a batch over; returns at once."""
        if not batch:
            return
        with self._idle:
            self._unsent += 1
        self._queue.put(batch)

    @property
    def backlog(self) -> int:
        return self._unsent

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over so far is written. False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unsent == 0, timeout=timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is pending (up to `timeout` s), then stop the thread."""
        if not self._thread.is_alive():
            return
        if not self.flush(timeout):
            log.warning("publisher: %d event batches not written after %.0f s; dropping them", self._unsent, timeout)
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            # Merge whatever else is waiting: one round trip for several steps when Redis is the bottleneck.
            batches = [first]
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                batches.append(more)
            events = [e for b in batches for e in b]
            self._write(events)
            with self._idle:
                self._unsent -= len(batches)
                self._idle.notify_all()

    def _write(self, events: list[Outgoing]) -> None:
        delay = 0.1
        while True:
            try:
                with self.connection.pipeline(transaction=False) as pipe:
                    ttls: dict[str, int] = {}
                    for e in events:
                        pipe.publish(keys.tokens_channel(e.job_id), e.data)
                        pipe.xadd(keys.stream_key(e.job_id), {keys.STREAM_FIELD: e.data})
                        ttls[e.job_id] = e.stream_ttl
                    for job_id, ttl in ttls.items():
                        if ttl == NO_EXPIRY:
                            pipe.persist(keys.stream_key(job_id))
                        else:
                            pipe.expire(keys.stream_key(job_id), max(1, ttl))
                    pipe.execute()
                self.sent_events += len(events)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._closing.is_set():
                    log.error("publisher: Redis unreachable while closing (%s); %d events lost", exc, len(events))
                    return
                log.warning("publisher: Redis unreachable (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
            except Exception:
                # A bug or a server-side refusal (e.g. OOM): retrying the same batch would loop forever.
                log.exception("publisher: could not write %d events; dropping them", len(events))
                return
