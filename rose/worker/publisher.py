"""Writes job events to Redis without waiting for Redis.

Each batch handed over (one engine step's events) is one atomic command: a Lua script that, for each event, XADDs it
to the job's stream (a plain token event as its own fields, any other as its JSON: rose.jobs.events), sets the
stream's expiry when the event says so (a job's first event and, now and then, a refresh; terminal events) and
PUBLISHes its JSON on the job's channel. The batch is sent at once, on the publisher's own connection, and its reply
is read later: at the next `send` or `poll`, one engine step on, when Redis has long answered. So the loop pays a
socket write per step, never a round trip, and no publishing thread competes with it for the GIL (measured with a
thread doing the same: -4% tokens/s on a busy 2-core host).

Batches are applied in order: on a connection error every batch not yet acknowledged is sent again, with a short
backoff (at most MAX_BACKOFF_S, so events go out within a second of Redis answering again), at a later `send` /
`poll`. The script is numbered (a per-publisher counter key), so a batch that did reach Redis before the connection
broke is a no-op the second time: subscribers see every seq exactly once, without gaps, even across Redis blips.
`acked` is the number of the last batch Redis answered: everything handed over up to it is written or reported
refused; `settled` is `acked` as the last `take_dropped()` saw it (the loop stores a job's result only once its
token events are settled, its refusals handled first: rose.worker.loop).

Two things make the publisher's view of Redis wrong, and it reports both rather than hide them:
- events Redis refused (a key of the wrong type; a whole batch, a bug) are dropped, not retried forever:
  `take_dropped()` names their jobs, for the loop to repair their streams at once;
- writes Redis acknowledged and then lost (a failover to a replica that had not received them, a restart without
  persistence): a batch comes after a gap in the counter. It is applied all the same and `lost` is set, for the
  loop to restart the streams of the jobs it holds (rose.worker.outbox `resync`).
A batch a full Redis refused (`maxmemory`) wrote nothing (a script's first write is refused): `take_dropped()` names
its jobs apart, whose streams start over as often as it takes (a refusal for good gives up on a job's stream), and
the gap it leaves in the counter is not a loss; nor is an empty batch's (`verify`), whatever refused it.

Used by the engine loop's thread only (not thread-safe).

A terminal event of a job whose end is stored in RQ `seals` the job (rose.worker.seal): it is written only if the
job's seal marker is still there, and removes it in the same script, so the worker and a repair after its death
never both write it.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rose.jobs import keys
from rose.worker import resp
from rose.worker.redis_guard import is_oom

log = logging.getLogger(__name__)

NO_EXPIRY = -1
KEEP_TTL = None  # leave the stream's expiry as an earlier event of the job set it
# The counter outlives a day without events; an idle worker whose counter lapsed reports `lost` once (harmless: it
# holds no jobs to resync).
_COUNTER_TTL_S = 86400
MAX_IN_FLIGHT = (
    1024  # batches sent and unanswered before `send` waits for Redis (a live but overloaded server)
)
MAX_BACKOFF_S = 0.5  # reconnecting costs nothing while Redis is down; events must flow soon after it is back
LOG_EVERY_S = 10.0  # while an outage lasts, one log line this often
_REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
CONNECT_TIMEOUT_S = 1.0  # longest a (re)connect may hold the engine loop; Redis is local or on the LAN
APPLIED, DUPLICATE = 1, 0  # the script's replies; below 0: applied after that many batches are missing

# KEYS[1]: this publisher's batch counter; KEYS[2]: the seal markers (job id -> worker); KEYS[2 + i]: stream of
# event i. ARGV[1]: batch number; ARGV[2]: counter TTL; ARGV[3]: where the job id starts in a channel name (1-based);
# then per event: data (its JSON), channel, spec, and for a token event stored as its fields (rose.jobs.events
# `token_entry`, TOKEN_ENTRY_FIELDS) their three values. spec: '' for most token events; 'j' first for an event
# stored as its JSON (field `event`); 's' if sealed (written only if the job's seal marker is there, which it
# removes); 't' and the stream's TTL to set (-1: persist) last; e.g. 't3600', 'j', 'jst600'. Returns {code, the first
# refusal's message, the ids of the jobs whose events Redis refused...}; code APPLIED, DUPLICATE (applied before, its
# reply lost) or, applied after a gap, minus the number of batches missing. A refused event (XADD on a key of
# another type, ...) does not stop the batch, so the counter always says which batches were applied. Batches are sent, and sent again, in order from the first one
# unacknowledged, so a batch number beyond the counter's next means batches Redis had applied, and acknowledged, are
# gone (a failover to a replica that had not received them, a restart without persistence), or a whole batch was
# refused before it ran (out of memory). Six arguments a token event, most with an empty spec: the script's cost is
# mostly its arguments (sending the JSON beside the fields costs Redis less than building it in Lua: benchmarks/
# README.md, session 24).
_SCRIPT = """
local batch = tonumber(ARGV[1])
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if batch <= last then return {0, ''} end
redis.call('SET', KEYS[1], batch, 'EX', ARGV[2])
local out = {1, ''}
if batch > last + 1 then out[1] = last + 1 - batch end
local skip, a = tonumber(ARGV[3]), 4
for i = 3, #KEYS do
  local data, channel, spec = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local token = string.byte(spec) ~= 106  -- not 'j': a token event, its fields in the next three arguments
  local f = a + 3
  a = token and a + 6 or a + 3
  local sealed = spec ~= '' and string.find(spec, 's', 1, true) ~= nil
  if not sealed or redis.call('HEXISTS', KEYS[2], string.sub(channel, skip)) == 1 then
    local added
    if token then
      added = redis.pcall('XADD', KEYS[i], '*', 'seq', ARGV[f], 'text', ARGV[f + 1], 'token_ids', ARGV[f + 2])
    else
      added = redis.pcall('XADD', KEYS[i], '*', 'event', data)
    end
    if type(added) == 'table' and added.err then  -- refused: a sealed job keeps its marker, for the repair
      if out[2] == '' then out[2] = added.err end
      out[#out + 1] = string.sub(channel, skip)
    else
      if spec ~= '' then
        if sealed then redis.call('HDEL', KEYS[2], string.sub(channel, skip)) end
        local t = string.find(spec, 't', 1, true)
        if t then
          local ttl = tonumber(string.sub(spec, t + 1))
          if ttl < 0 then redis.call('PERSIST', KEYS[i]) else redis.call('EXPIRE', KEYS[i], ttl) end
        end
      end
      redis.call('PUBLISH', channel, data)
    end
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Outgoing:
    job_id: str
    data: str  # event JSON
    stream_ttl: int | None  # seconds; NO_EXPIRY to persist the stream; KEEP_TTL to leave it as it is
    seals: bool = False  # the job's terminal event, its end stored in RQ: written only by the seal's holder
    # a token event's values, stored as its entry's fields (events.token_entry); None: the event stored as its JSON
    token: tuple[int, str, str] | None = None


@dataclass(slots=True)
class _Batch:
    number: int
    packed: bytes  # the numbered EVAL, ready to send (the same bytes when sent again)
    job_ids: tuple[str, ...]  # of its events, in order


class Publisher:
    def __init__(self, connection: redis.Redis, *, max_backoff: float = MAX_BACKOFF_S):
        self.connection = connection
        self.max_backoff = max_backoff
        self._conn: Any = None  # the publisher's own connection, made on first use
        self._unacked: collections.deque[_Batch] = collections.deque()  # in order; the first `_sent` are sent
        self._sent = 0
        self._retry_at = 0.0  # after a connection error: when to reconnect and send the unacknowledged again
        self._backoff = 0.05
        self._down_since: float | None = None  # monotonic time of the first failure of an outage
        self._logged_at = 0.0
        # refusals for memory ("full"), of empty batches ("empty"): each logged now and then
        self._refusal_logged_at: dict[str, float] = {}
        self._refused_unwritten = 0  # batches refused, written nothing, since the last written: the next gap
        self._counter_key = f"rose:publisher:{uuid.uuid4().hex}"
        self._batch_no = 0
        self._dropped: set[str] = set()
        self._full: set[str] = set()  # in batches a full Redis refused
        self.acked = 0  # number of the last batch Redis answered (applied, or refused and dropped)
        self.written = 0  # number of the last batch Redis applied
        self.settled = 0  # `acked` as the last `take_dropped` saw it: the refusals up to it are handed on
        self.sent_events = 0  # events acknowledged by Redis
        self.lost = False  # Redis lost writes it had acknowledged (set here, cleared by the reader)

    def send(self, batch: list[Outgoing]) -> int:
        """Send a batch (and collect the replies Redis has given since the last call); its number (0 for none).
        Never waits for Redis, except with MAX_IN_FLIGHT batches unanswered; while Redis is unreachable batches
        are kept, in order."""
        number = 0
        if batch:
            self._unacked.append(self._pack(batch))
            number = self._batch_no
        self._pump()
        return number

    def verify(self) -> None:
        """Send an empty batch: its reply says whether Redis lost acknowledged writes (`lost`), e.g. after a
        reconnection to a promoted replica, even when no job has events to send."""
        self._unacked.append(self._pack([]))
        self._pump()

    def take_dropped(self) -> tuple[set[str], set[str]]:
        """The jobs whose events were in batches Redis refused since the last call: (for good, for memory). What
        was acknowledged up to now is `settled`: the caller has the refusals among it."""
        dropped, full = self._dropped, self._full
        self._dropped, self._full = set(), set()
        self.settled = self.acked
        return dropped, full

    def poll(self) -> None:
        """Collect replies; after a connection error, send the unacknowledged batches again once the backoff ends."""
        if self._unacked:
            self.send([])

    def unacked_jobs(self) -> set[str]:
        """The jobs with events in batches Redis has not answered yet."""
        return {job_id for batch in self._unacked for job_id in batch.job_ids}

    @property
    def last_batch(self) -> int:
        """The number of the last batch handed over (0: none yet)."""
        return self._batch_no

    @property
    def backlog(self) -> int:
        """Batches not acknowledged by Redis yet."""
        return len(self._unacked)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over so far is written. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._unacked:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                time.sleep(wait if left is None else min(wait, left))
                continue
            self._pump(wait_s=0.1 if left is None else min(0.1, left))
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Write what is pending (up to `timeout` s), then let the connection go."""
        if not self.flush(timeout):
            events = sum(len(b.job_ids) for b in self._unacked)
            log.warning(
                "publisher: %d event batches (%d events) not written after %.0f s; dropping them",
                len(self._unacked),
                events,
                timeout,
            )
        if self._conn is not None:
            self._conn.disconnect()
        self._sent = 0
        self._unacked.clear()

    def _pack(self, events: list[Outgoing]) -> _Batch:
        self._batch_no += 1
        # EVAL, not EVALSHA: Redis caches the script by its hash either way, and never answers NOSCRIPT after a
        # restart. Packed by resp.pack_command: a step's batch has a few hundred arguments.
        items: list[str | int] = ["EVAL", _SCRIPT, len(events) + 2, self._counter_key, keys.SEALS_KEY]
        items += [keys.stream_key(e.job_id) for e in events]
        items += [self._batch_no, _COUNTER_TTL_S, len(keys.TOKENS_CHANNEL_PREFIX) + 1]
        for e in events:
            ttl = e.stream_ttl
            spec = ("" if e.token else "j") + ("s" if e.seals else "")
            if ttl is not KEEP_TTL:
                spec += f"t{ttl if ttl == NO_EXPIRY else max(1, ttl)}"
            items += [e.data, keys.tokens_channel(e.job_id), spec]
            if e.token:
                items += e.token
        return _Batch(self._batch_no, resp.pack_command(items), tuple(e.job_id for e in events))

    def _pump(self, wait_s: float = 0.0) -> None:
        """Read the replies that are there (waiting up to `wait_s` for the first), then send what is unsent."""
        if time.monotonic() < self._retry_at:
            return
        try:
            conn = self._conn or self._open()
            if conn._sock is None:  # not connected yet, or disconnected: whatever was in flight goes again
                self._sent = 0
                # connect() itself, not the send's implicit connect: a Sentinel-managed connection finds the
                # primary only in connect() (redis-py's send path would go to its default host instead)
                conn.connect()
            while self._sent and (
                self._sent >= MAX_IN_FLIGHT or conn.can_read(timeout=wait_s if wait_s > 0 else 0)
            ):
                self._acknowledge(conn)
                wait_s = 0.0
            if self._sent < len(self._unacked):
                # no health check: its PING would read a batch's reply as its own
                conn.send_packed_command(
                    [b.packed for b in list(self._unacked)[self._sent :]], check_health=False
                )
                self._sent = len(self._unacked)
            self._backoff = 0.05
        except _REDIS_ERRORS as exc:
            if self._conn is not None:
                self._conn.disconnect()
            self._sent = 0
            now = time.monotonic()
            if self._down_since is None or now - self._logged_at >= LOG_EVERY_S:
                self._down_since = self._down_since or now
                self._logged_at = now
                log.warning(
                    "publisher: Redis unreachable for %.1f s (%s); %d event batches kept, sent again once it answers",
                    now - self._down_since,
                    exc,
                    len(self._unacked),
                )
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self.max_backoff)

    def _acknowledge(self, conn: Any) -> None:
        batch = self._unacked[0]
        try:
            reply = conn.read_response()
        except redis.ResponseError as exc:
            # The whole batch refused: the counter did not move, so the next batch reports a gap. Refused for
            # memory, it is transient: these jobs' streams start over (`take_dropped`) and the gap is explained,
            # as is an empty batch's.
            oom = is_oom(exc)
            if oom or not batch.job_ids:  # wrote nothing: an empty batch writes only its counter
                self._refused_unwritten += 1
                self._full.update(batch.job_ids)
                kind = "full" if oom else "empty"
                if (now := time.monotonic()) - self._refusal_logged_at.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
                    self._refusal_logged_at[kind] = now
                    if oom:
                        log.error(
                            "publisher: Redis is full (maxmemory) and refuses events (%s); streams start over",
                            exc,
                        )
                    else:
                        log.warning("publisher: Redis refused an empty batch (%s)", exc)
            else:  # a bug: sending it again would fail forever; the loop repairs these jobs' streams
                log.exception("publisher: Redis refused %d events; dropping them", len(batch.job_ids))
                self._dropped.update(batch.job_ids)
        else:
            if self._down_since is not None:
                log.warning(
                    "publisher: Redis answers again after %.1f s; kept events written",
                    time.monotonic() - self._down_since,
                )
                self._down_since = None
            code, refused = int(reply[0]), [_text(job_id) for job_id in reply[2:]]
            self.sent_events += len(batch.job_ids) - len(refused)
            if refused:
                log.error(
                    "publisher: Redis refused the events of %d jobs (%s); dropping them",
                    len(refused),
                    _text(reply[1]),
                )
                self._dropped.update(refused)
            if -code > self._refused_unwritten:  # more batches missing than were refused unwritten
                log.error(
                    "publisher: Redis lost event batches it had acknowledged (a failover, or a restart without "
                    "persistence); the streams of running jobs start over"
                )
                self.lost = True
            self._refused_unwritten = 0
            self.written = batch.number
        self._unacked.popleft()
        self._sent -= 1
        self.acked = batch.number

    def _open(self) -> Any:
        """The publisher's own connection (same settings and client name as the worker's), made to fail fast: a
        connect must not retry and sleep in the engine loop, the publisher backs off by itself."""
        conn = self.connection.connection_pool.make_connection()
        conn.retry = Retry(NoBackoff(), 0)
        timeout = conn.socket_connect_timeout
        conn.socket_connect_timeout = (
            CONNECT_TIMEOUT_S if timeout is None else min(timeout, CONNECT_TIMEOUT_S)
        )
        self._conn = conn
        return conn


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
