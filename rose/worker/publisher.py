"""Sends job events to Redis from a background thread, so the engine loop never waits on the network.

Each batch handed over (one engine step's events) goes out in one round trip: a Lua script that, for each event,
XADDs it to the job's stream, sets the stream's expiry when the event says so (a job's first event and, now and
then, a refresh; terminal events) and PUBLISHes it on the job's channel. Batches are sent in order; on a connection
error the batch is retried with backoff, never dropped. The script is atomic and numbered
(a per-publisher counter key), so a retry of a batch that did reach Redis before the connection broke is a no-op:
subscribers see every seq exactly once, without gaps, even across Redis blips.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import redis

from rose.jobs import keys
from rose.worker import resp

log = logging.getLogger(__name__)

NO_EXPIRY = -1
KEEP_TTL = None  # leave the stream's expiry as an earlier event of the job set it
_COUNTER_TTL_S = 3600
_MAX_EVENTS_PER_CALL = (
    2000  # merged batches per script call, so that a backlog after an outage goes in chunks
)

# KEYS[1]: this publisher's batch counter; KEYS[1 + i]: stream of event i.
# ARGV[1]: batch number; ARGV[2]: counter TTL; ARGV[3]: channel prefix; ARGV[4]: stream key prefix length;
# then per event: data, stream TTL ('' = keep, -1 = persist). The channel is the prefix + the job id.
_SCRIPT = """
local batch = tonumber(ARGV[1])
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if batch <= last then return 0 end
redis.call('SET', KEYS[1], batch, 'EX', ARGV[2])
local channel, skip = ARGV[3], tonumber(ARGV[4])
for i = 2, #KEYS do
  local a = 5 + (i - 2) * 2
  local data, ttl = ARGV[a], ARGV[a + 1]
  redis.call('XADD', KEYS[i], '*', 'event', data)
  if ttl ~= '' then
    ttl = tonumber(ttl)
    if ttl < 0 then redis.call('PERSIST', KEYS[i]) else redis.call('EXPIRE', KEYS[i], ttl) end
  end
  redis.call('PUBLISH', channel .. string.sub(KEYS[i], skip + 1), data)
end
return #KEYS - 1
"""


@dataclass(frozen=True, slots=True)
class Outgoing:
    job_id: str
    data: str  # event JSON
    stream_ttl: int | None  # seconds; NO_EXPIRY to persist the stream; KEEP_TTL to leave it as it is


class Publisher:
    def __init__(self, connection: redis.Redis, *, max_backoff: float = 5.0):
        self.connection = connection
        self.max_backoff = max_backoff
        self._queue: queue.Queue[list[Outgoing] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._unsent = 0  # batches handed over and not yet written
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rose-publisher", daemon=True)
        self._counter_key = f"rose:publisher:{uuid.uuid4().hex}"
        self._batch_no = 0
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
            log.warning(
                "publisher: %d event batches not written after %.0f s; dropping them", self._unsent, timeout
            )
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
            while sum(len(b) for b in batches) < _MAX_EVENTS_PER_CALL:
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
        self._batch_no += 1
        # EVAL, not EVALSHA: Redis caches the script by its hash either way, and never answers NOSCRIPT after a
        # restart. Packed by resp.pack_command: a step's batch has a few hundred arguments.
        items: list[str | int] = ["EVAL", _SCRIPT, len(events) + 1, self._counter_key]
        items += [keys.stream_key(e.job_id) for e in events]
        items += [self._batch_no, _COUNTER_TTL_S, keys.TOKENS_CHANNEL_PREFIX, len(keys.STREAM_PREFIX)]
        for e in events:
            ttl = e.stream_ttl
            items += [e.data, "" if ttl is KEEP_TTL else ttl if ttl == NO_EXPIRY else max(1, ttl)]
        delay = 0.1
        while True:
            try:
                resp.call(self.connection, items)
                self.sent_events += len(events)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._closing.is_set():
                    log.error(
                        "publisher: Redis unreachable while closing (%s); %d events lost", exc, len(events)
                    )
                    return
                log.warning("publisher: Redis unreachable (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
            except Exception:
                # A bug or a server-side refusal (e.g. OOM): retrying the same batch would loop forever.
                log.exception("publisher: could not write %d events; dropping them", len(events))
                return
