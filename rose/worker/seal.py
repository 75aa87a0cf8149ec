"""The seal: a job's end stored in RQ and its last stream events become visible together, whatever the instant of a
kill -9.

A result stored in a retirer batch carries its `done` event in the same transaction (rose.worker.retirer): nothing to
seal. Every other end (a result stored by RQ's handler, a failure, a stop, a cancel) is written into RQ first and the
job's terminal event after, at the next publish. In between, the job is marked in `rose:seals` (job id -> worker
name), just before the end is written (rose.worker.endings). The terminal event is written only while the marker is
there, and removes it in the same script (rose.worker.publisher). So a kill at any instant leaves either no end
stored, or the terminal event written, or the marker. A marker whose worker
is dead is claimed (HDEL: one claimant) by a live worker's recovery scan, at once by a restart under the same name,
and the job's stream is repaired from what RQ stored: the token events the stream lacks after its last reset (the
stored text beyond the streamed text), then the terminal event. A job stored as ended thus always ends its stream
with exactly one terminal event after its last reset, and its streamed text equals its stored text: at once, or once
repaired (at a same-name restart, else within two recovery scans after the dead worker's heartbeat lapsed).

A job that will run again (RQ's Retry, requeued) is never marked: its next attempt starts its stream with a reset.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from rose.jobs import keys
from rose.jobs.events import (
    TERMINAL_TYPES,
    CanceledEvent,
    DoneEvent,
    ErrorEvent,
    ResetEvent,
    Usage,
    entry_dict,
    token_event_json,
)
from rose.worker import rq_scan, rq_store
from rose.worker.outbox import ended_stream_ttl
from rose.worker.redis_guard import is_oom
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

log = logging.getLogger(__name__)

_ENDED = (rq_store.FINISHED, rq_store.FAILED, rq_store.CANCELED, rq_store.STOPPED)

# KEYS[1]: the seal markers; KEYS[2]: keys.OOM_PROBE_KEY; ARGV[1]: job id; ARGV[2]: the owner it was seen with. The
# claim of a dead worker's marker: only if nobody (a live worker that reran the job) marked the job since, and only
# while Redis takes writes (a full one takes the HDEL and refuses the repair: the no-op write first is refused).
_CLAIM = """
redis.call('SET', KEYS[2], '', 'XX')
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""
# KEYS[1]: the seal markers; KEYS[2]: the job's stream. ARGV[1]: job id; ARGV[2]: the stream's last entry id as read
# ('' if empty); ARGV[3]: the stream's TTL (-1: persist); ARGV[4]: the job's channel; ARGV[5...]: events. Written only
# if no worker holds a marker for the job and nothing was appended since the stream was read.
_APPEND = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local id = ''
if #last > 0 then id = last[1][1] end
if id ~= ARGV[2] then return 0 end
for i = 5, #ARGV do
  redis.call('XADD', KEYS[2], '*', 'event', ARGV[i])
  redis.call('PUBLISH', ARGV[4], ARGV[i])
end
local ttl = tonumber(ARGV[3])
if ttl < 0 then redis.call('PERSIST', KEYS[2]) else redis.call('EXPIRE', KEYS[2], ttl) end
return #ARGV - 4
"""


def mark(conn: redis.Redis, run: Running, worker_name: str) -> None:
    """Mark the job before its end is written by RQ's handler (one round trip: those ends are the rare ones)."""
    conn.hset(keys.SEALS_KEY, run.id, worker_name)


class SealWatch:
    """Repairs the streams of jobs whose terminal event is owed by nobody any more.

    That is a marker of a dead worker, repaired once seen so in two scans in a row (a live worker whose registration
    lapsed in a Redis outage has time to come back and write its own events: its marker claimed by a repair, its
    terminal event would be dropped and its last tokens sent twice); a killed predecessor's (same name, at start-up)
    at once. Or one of this worker's own for a job it neither holds nor has events in flight for (its terminal event
    was refused by Redis, or lost in a failover): at once, busy or not, since the worker knows it owes nothing."""

    def __init__(self) -> None:
        self._stale: set[str] = set()

    def scan(
        self,
        rq: RQWorker,
        alive: Callable[[str], bool],
        *,
        held: Callable[[str], bool],
        predecessor: bool = False,
    ) -> int:
        """One scan. `held`: whether this worker still holds a job of its own marker or has its events in flight;
        `predecessor`: markers under this worker's name are a killed predecessor's (at start-up). Returns how many
        streams were repaired."""
        conn = rq.connection
        markers = {
            rq_store.decoded(job): rq_store.decoded(owner)
            for job, owner in conn.hgetall(keys.SEALS_KEY).items()
        }
        stale, due = set(), set()
        verdicts: dict[str, bool] = {}
        for job_id, owner in markers.items():
            if owner == rq.name:
                if predecessor or not held(job_id):
                    due.add(job_id)
                continue
            if owner not in verdicts:
                verdicts[owner] = alive(owner)
            if not verdicts[owner]:
                stale.add(job_id)
        due |= stale & self._stale
        self._stale = stale - due
        repaired = 0
        for job_id in sorted(due):
            try:
                if conn.eval(_CLAIM, 2, keys.SEALS_KEY, keys.OOM_PROBE_KEY, job_id, markers[job_id]):
                    repaired += repair(conn, rq, job_id, markers[job_id])
            except redis.ConnectionError:
                raise
            except redis.ResponseError as exc:
                if is_oom(exc):  # Redis is full: the guard waits, the marker stays for a later scan
                    raise
                log.exception("job %s: repairing its stream failed", job_id)
            except Exception:  # one unreadable job must not take the worker down, nor stop the others' repair
                log.exception("job %s: repairing its stream failed", job_id)
        return repaired


def repair(conn: redis.Redis, rq: RQWorker, job_id: str, owner: str = "") -> bool:
    """Append what the job's stream lacks after its last reset, from the end RQ stored. The caller has claimed the
    job's marker (nothing is written while a worker holds one). Returns whether anything was written.

    A stream whose last attempt is not whole (a gap in its seqs, or tokens that disagree with the stored result:
    Redis lost or refused some of its events) starts over: a reset, the stored text as one token event, the end."""
    end = rq_scan.job_end(conn, job_id, rq)
    raw = conn.xrange(keys.stream_key(job_id))
    last_id = rq_store.decoded(raw[-1][0]) if raw else ""
    entries = [entry_dict(f) for _, f in raw]
    resets = [i for i, e in enumerate(entries) if e.get("type") == "reset"]
    attempt = entries[resets[-1] + 1 :] if resets else entries
    if any(e.get("type") in TERMINAL_TYPES for e in attempt):
        return False
    if end.status not in _ENDED and (end.status is not None or not entries):
        return False  # queued, started, ...: it runs again, its next attempt begins with a reset; or nothing to end
    events: list[str] = []
    if [e.get("seq") for e in attempt] != list(range(len(attempt))):
        events.append(ResetEvent(job_id=job_id, reason="redis lost events").to_json())
        attempt = []
    value = end.return_value if isinstance(end.return_value, dict) else None
    if end.status == rq_store.FINISHED and value is not None:
        tail = _missing_tokens(attempt, value)
        if tail is None:  # the stream disagrees with the stored result: it starts over
            log.error(
                "job %s: its stream disagrees with its stored result; streaming the result anew", job_id
            )
            events = [ResetEvent(job_id=job_id, reason="redis lost events").to_json()]
            attempt = []
            tail = _missing_tokens(attempt, value)
    seq = len(attempt)
    if end.status == rq_store.FINISHED and value is not None:
        for index, text, ids, logprobs in tail or []:
            events.append(token_event_json(seq, text, ids, logprobs, index))
            seq += 1
        usage = (
            Usage(**value["usage"])
            if isinstance(value.get("usage"), dict)
            else Usage(prompt_tokens=0, completion_tokens=len(value.get("token_ids") or []))
        )
        done = DoneEvent(
            job_id=job_id, seq=seq, finish_reason=value.get("finish_reason") or "stop", usage=usage
        )
        events.append(done.to_json())
    elif end.status == rq_store.FAILED:
        events.append(ErrorEvent(job_id=job_id, seq=seq, message=_message(end.error)).to_json())
    elif end.status in (rq_store.CANCELED, rq_store.STOPPED):
        reason = "stopped" if end.status == rq_store.STOPPED else "canceled"
        events.append(CanceledEvent(job_id=job_id, seq=seq, reason=reason).to_json())
    elif end.status is None:
        events.append(CanceledEvent(job_id=job_id, seq=seq, reason="deleted").to_json())
    else:  # finished without a readable result: end the stream all the same
        streamed = sum(len(e.get("token_ids", [])) for e in attempt if e.get("type") == "token")
        usage = Usage(prompt_tokens=0, completion_tokens=streamed)
        events.append(DoneEvent(job_id=job_id, seq=seq, finish_reason="stop", usage=usage).to_json())
    ttl = ended_stream_ttl(end.result_ttl)
    stream, channel = keys.stream_key(job_id), keys.tokens_channel(job_id)
    if not conn.eval(_APPEND, 2, keys.SEALS_KEY, stream, job_id, last_id, ttl, channel, *events):
        log.info("job %s: its stream moved on meanwhile (a live worker holds it); not repaired", job_id)
        return False
    log.warning(
        "job %s: its end was stored but its stream did not show it (worker %s died, or Redis refused or lost its "
        "events); appended %d events from RQ's record",
        job_id,
        owner or "?",
        len(events),
        extra={"event": "sealed", "job_id": job_id, "owner": owner},
    )
    return True


def _missing_tokens(
    attempt: list[dict], value: dict
) -> list[tuple[int | None, str, list[int], list | None]] | None:
    """The token events the stream lacks to equal the stored result, one per choice that lacks tokens: (its index,
    None for a job of one choice; text; token ids; their logprobs entries, None for a job without). None if the
    stream disagrees with the result."""
    choices = value.get("choices") if isinstance(value.get("choices"), list) else None
    wanted = (
        [(None, value)] if choices is None else [(i, c) for i, c in enumerate(choices) if isinstance(c, dict)]
    )
    tails = []
    for index, choice in wanted:
        tokens = [e for e in attempt if e.get("type") == "token" and e.get("index") == index]
        streamed_text = "".join(e.get("text", "") for e in tokens)
        streamed_ids = [i for e in tokens for i in e.get("token_ids", [])]
        text, ids = choice.get("text") or "", list(choice.get("token_ids") or [])
        if not text.startswith(streamed_text) or ids[: len(streamed_ids)] != streamed_ids:
            return None
        if text == streamed_text and len(ids) == len(streamed_ids):
            continue
        logprobs = choice.get("logprobs")
        tail_logprobs = logprobs[len(streamed_ids) :] if isinstance(logprobs, list) else None
        tails.append((index, text[len(streamed_text) :], ids[len(streamed_ids) :], tail_logprobs))
    return tails


def _message(exc_string: str | None) -> str:
    """The failure's message from RQ's stored exception text (`RoseJobError: message`, or a traceback)."""
    text = (exc_string or "").strip()
    name, sep, message = text.partition(": ")
    if sep and name.replace(".", "").isidentifier():  # `RoseJobError: message`, as rose-worker writes it
        return message
    lines = text.splitlines()
    return lines[-1] if lines else "the job failed"
