"""The job events of one loop iteration, queued in order and handed to the publisher at the end of the iteration.

What a token costs Redis is decided here. A job with `stream: false` gets no token events at all: only its terminal
event, so its cost in Redis does not grow with its tokens. A streamed job's first tokens go out at once (time to the
first token), and later ones are held and released together, one event per job carrying every token since its last
(`text` and `token_ids` cover them all), at most every `stream_interval` seconds (the worker's `--stream-interval`;
0: every step). A job's held tokens go out as soon as it finishes or ends otherwise, ahead of its terminal event,
which takes the next seq. The outbox numbers every event (`Running.seq`) and records, on each job, the publisher
batch that carries its latest events (`Running.events_batch`): `delivered(run)` says whether Redis has them, which
the loop requires before it stores a result.

Streams (`rose:stream:<id>`) expire with the job's result TTL once the job has ended (-1: never); while the job
runs, they live at least until its timeout plus that TTL. A running job's events re-set the expiry once a minute
only (one Redis command less per event otherwise).

A job whose events a full Redis refused (`maxmemory`: `refused_for_memory`) waits for its stream to start over until
Redis writes a batch handed over after the refusal: another job's, or an empty one sent every RETRY_FULL_S while
none is. Not at every step: that sent every such job's text so far to a Redis that refused it, once a step while it
lasted (63 MB in 20 s of a full Redis at 64 jobs). Its new tokens are not sent meanwhile (the resync carries them),
and it is not `delivered`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rq.job import Job

from rose.jobs import keys
from rose.jobs.events import DoneEvent, ResetEvent, Usage, token_event
from rose.jobs.logprobs import LogprobEntry
from rose.worker.publisher import KEEP_TTL, NO_EXPIRY, Outgoing, Publisher
from rose.worker.running import Running

log = logging.getLogger(__name__)

STREAM_TTL_REFRESH_S = 60  # a running job's events re-set its stream's expiry this often (it is hours long)
# while streams wait for a full Redis, it is asked this often whether it has room (as the guard asks)
RETRY_FULL_S = 0.5


def ended_stream_ttl(result_ttl: int | None) -> int:
    """The expiry of an ended job's stream, from its result TTL (NO_EXPIRY for RQ's -1)."""
    if result_ttl is not None and result_ttl < 0:
        return NO_EXPIRY
    return max(1, result_ttl or 0)


def stream_ttl(default_result_ttl: int, job: Job, run: Running | None = None) -> int:
    """The expiry of the job's stream: its result TTL once ended, plus its registry TTL while `run` runs."""
    ttl = ended_stream_ttl(job.get_result_ttl(default_result_ttl))
    if run is not None and ttl != NO_EXPIRY:
        ttl += run.registry_ttl()
    return ttl


@dataclass(slots=True)
class _Held:
    """A streamed job's tokens (of one choice) not in an event yet."""

    run: Running
    index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None  # a job with `logprobs`: their entries


class Outbox:
    """Owns the events not yet handed to `publisher`, and the streamed jobs' tokens held until the next release."""

    def __init__(self, publisher: Publisher, default_result_ttl: int, stream_interval: float = 0.0) -> None:
        self.publisher = publisher
        self.default_result_ttl = default_result_ttl
        self.stream_interval = stream_interval
        self._events: list[Outgoing] = []
        self._runs: list[Running] = []  # the jobs of `_events`, for their `events_batch`
        self._held: dict[str, dict[int, _Held]] = {}  # job id -> choice index -> its held tokens
        self._release_at = 0.0  # monotonic time of the next release of held tokens
        self._waiting: dict[str, Running] = {}  # jobs whose streams start over once a full Redis has room
        # the last batch handed over when a full Redis's refusal was told: a later one written means room
        self._waiting_after = 0
        self._retry_full_at = 0.0  # monotonic time of the next empty batch asking a full Redis

    # ---- a job's events ----------------------------------------------------------------------------------------

    def token(
        self,
        run: Running,
        text: str,
        token_ids: list[int],
        logprobs: list[LogprobEntry] | None = None,
        *,
        index: int = 0,
        last: bool = False,
    ) -> None:
        """New tokens of the job's choice `index` (`logprobs`: their entries, for a job that asked; `last`: the
        choice finished with them). Nothing for a job that is not streamed. They go out at once as the job's first
        event, with what the choice held once it has finished, or at every step without a `stream_interval`;
        otherwise they are held until the next release. Either way one path makes the event (`_token_event`)."""
        if not run.streamed or self._waits(run):
            return
        choices = self._held.get(run.id)
        held = choices.get(index) if choices is not None else None
        if held is None:  # these tokens begin what the choice holds
            held = _Held(run, index, [text], list(token_ids), None if logprobs is None else list(logprobs))
            if not (run.seq == 0 or last or self.stream_interval <= 0):  # the first event goes out at once
                self._hold(held)
                return
        else:
            held.texts.append(text)
            held.token_ids.extend(token_ids)
            if held.logprobs is not None:
                held.logprobs.extend(logprobs or [])
            if not last:
                return
            del choices[index]
            if not choices:
                del self._held[run.id]
        self._token_event(held)

    def release(self, run: Running) -> None:
        """The job's held tokens, now, as one event per choice."""
        self._release(run.id)

    def _release(self, job_id: str) -> None:
        for held in self._held.pop(job_id, {}).values():
            self._token_event(held)

    def reset(self, run: Running, reason: str = "restart") -> None:
        """The job starts over (an earlier attempt's events are in its stream): subscribers drop what they had."""
        self._held.pop(run.id, None)
        self._waiting.pop(run.id, None)
        run.stream_ttl_due = 0.0
        run.seq = 0
        data = ResetEvent(job_id=run.id, reason=reason).to_json()
        self._append(run, Outgoing(run.id, data, self._running_ttl(run)))

    def resync(self, run: Running, reason: str) -> None:
        """Redis may have lost some of the job's events (a failover, a refused batch): start its stream over with a
        reset and every token generated so far in one event, so that its stream after the last reset is whole."""
        self.reset(run, reason)
        if not run.streamed:
            return
        for index, choice in enumerate(run.choices):
            if choice.token_ids:
                logprobs = list(choice.logprobs) if choice.logprobs is not None else None
                self._token_event(_Held(run, index, list(choice.text), list(choice.token_ids), logprobs))

    def refused(self, run: Running) -> None:
        """Redis refused events of the job (rose.worker.publisher `take_dropped`): its stream starts over once; if
        Redis refuses them again, the job goes on without its stream (a key of the wrong type stays so)."""
        run.refusals += 1
        if run.refusals == 1:
            self.resync(run, "redis refused events")
        elif run.refusals == 2:
            log.error("job %s: Redis refuses its events again; it goes on without its stream", run.id)

    def refused_for_memory(self, run: Running) -> None:
        """A full Redis refused events of the job (`take_dropped`): its stream starts over once Redis has room (not
        held against the job, as `refused` is)."""
        self._held.pop(run.id, None)
        if not self._waiting:
            self._retry_full_at = time.monotonic() + RETRY_FULL_S
        self._waiting[run.id] = run
        self._waiting_after = self.publisher.last_batch

    def terminal(self, run: Running, kind: Any, **fields: Any) -> None:
        """The job's last event (`kind`: DoneEvent, ErrorEvent, CanceledEvent, with its `fields`), after its held
        tokens, its end stored in RQ and the job marked (rose.worker.seal): written while the mark holds. Its stream
        now expires with the job's result; a stream waiting for a full Redis starts over first."""
        if self._waits(run):
            self.resync(run, "redis was full")
        self.release(run)
        event = kind(job_id=run.id, seq=run.next_seq(), **fields)
        ttl = stream_ttl(self.default_result_ttl, run.job)
        self._append(run, Outgoing(run.id, event.to_json(), ttl, seals=True))

    def done_commands(self, run: Running) -> list[tuple[Any, ...]]:
        """The commands that write the finished job's `done` event (its result built, its tokens delivered), for the
        transaction that stores its result (rose.worker.retirer): the end and its announcement become visible at
        once, with no seal to hold in between. The seq is taken only once they are committed (`Running.seq` is left
        as it is: a job handed back announces itself through `terminal`)."""
        result = run.result or {}
        event = DoneEvent(
            job_id=run.id,
            seq=run.seq,
            finish_reason=result.get("finish_reason") or "stop",
            usage=Usage(**result["usage"]),
        ).to_json()
        stream, ttl = keys.stream_key(run.id), stream_ttl(self.default_result_ttl, run.job)
        expiry = ("PERSIST", stream) if ttl == NO_EXPIRY else ("EXPIRE", stream, ttl)
        return [
            ("XADD", stream, "*", keys.STREAM_FIELD, event),
            expiry,
            ("PUBLISH", keys.tokens_channel(run.id), event),
        ]

    def forget(self, run: Running) -> None:
        """Drop what is held for a job this worker lets go without an end of its own (taken by another worker)."""
        self._held.pop(run.id, None)
        self._waiting.pop(run.id, None)

    # ---- delivery ------------------------------------------------------------------------------------------------

    def delivered(self, run: Running) -> bool:
        """Whether Redis has written (or refused, and the loop was told) every event of the job handed to the
        publisher so far."""
        return not self._waits(run) and run.events_batch <= self.publisher.settled

    def in_flight(self) -> set[str]:
        """The jobs with events queued here or not acknowledged by Redis yet, or waiting for a full Redis."""
        return {e.job_id for e in self._events} | self.publisher.unacked_jobs() | set(self._waiting)

    @property
    def idle(self) -> bool:
        """Nothing queued or held here, nor unacknowledged by Redis."""
        return not (self._events or self._held or self._waiting) and self.publisher.backlog == 0

    def wait(self, timeout: float) -> None:
        """Wait, up to `timeout` s, until Redis has acknowledged everything handed over and, while streams wait for a
        full Redis, until it is next asked (an idle loop would spin meanwhile)."""
        deadline = time.monotonic() + timeout
        self.publisher.flush(timeout=timeout)
        if self._waiting and self.publisher.written <= self._waiting_after:  # else: their turn is now
            time.sleep(max(0.0, min(self._retry_full_at, deadline) - time.monotonic()))

    def publish(self, running: Mapping[str, Running], retiring: Callable[[], list[Running]]) -> bool:
        """`flush`, then act on what Redis's replies so far say of the jobs held (`running` by id; `retiring`: the
        finished ones being stored): after a loss (a failover), every held job's stream starts over; a job whose
        events Redis refused for good starts over once (`refused`), one refused for memory once Redis has room
        (`refused_for_memory`); an ended job's refused terminal event is left to the worker's reconciliation.
        The streams started over are handed on at once: no job counts as delivered before them. Returns whether the
        worker must reconcile with Redis (a refusal or a loss)."""
        self.flush()
        publisher = self.publisher
        dropped, full = publisher.take_dropped()
        if not (publisher.lost or dropped or full):
            return False
        if publisher.lost:
            publisher.lost = False
            for run in [*running.values(), *retiring()]:
                self.resync(run, "redis lost events")
        else:
            for run in filter(None, map(running.get, dropped)):
                self.refused(run)
            for run in filter(None, map(running.get, full - dropped)):
                self.refused_for_memory(run)
        self.flush()
        return True

    def flush(self, *, release: bool = False) -> None:
        """Hand the queued events to the publisher (which also collects Redis's replies, or retries after an
        outage), with the held tokens if their release is due (`release`: now)."""
        now = time.monotonic()
        if self._waiting and self.publisher.written > self._waiting_after:  # Redis has room
            for run in list(self._waiting.values()):
                self.resync(run, "redis was full")
        elif self._waiting and now >= self._retry_full_at:  # an empty batch asks, not every text so far
            self._retry_full_at = now + RETRY_FULL_S
            self.publisher.verify()
        if self._held and (release or now >= self._release_at):
            for job_id in list(self._held):
                self._release(job_id)
            self._release_at = now + self.stream_interval
        if self._events:
            number = self.publisher.send(self._events)
            for run in self._runs:
                run.events_batch = number
            self._events, self._runs = [], []
        else:
            self.publisher.poll()

    # ---- internals -----------------------------------------------------------------------------------------------

    def _waits(self, run: Running) -> bool:
        """Whether this very job waits for a full Redis. An earlier attempt of its id found there is dropped (the
        loop forgets a job it lets go, so none should be): its restart must not reach the new attempt's stream."""
        waiting = self._waiting.get(run.id)
        if waiting is not None and waiting is not run:
            del self._waiting[run.id]
        return waiting is run

    def _hold(self, held: _Held) -> None:
        """Keep the choice's tokens until the next release (its clock starts with the first tokens held)."""
        if not self._held:
            self._release_at = time.monotonic() + self.stream_interval
        self._held.setdefault(held.run.id, {})[held.index] = held

    def _token_event(self, held: _Held) -> None:
        """One token event: a choice's tokens since its last one; it names its choice only for a job of several
        (n > 1)."""
        run = held.run
        index = held.index if len(run.choices) > 1 else None
        data, entry = token_event(run.next_seq(), "".join(held.texts), held.token_ids, held.logprobs, index)
        self._append(run, Outgoing(run.id, data, self._running_ttl(run), token=entry))

    def _append(self, run: Running, event: Outgoing) -> None:
        self._events.append(event)
        if not self._runs or self._runs[-1] is not run:
            self._runs.append(run)

    def _running_ttl(self, run: Running) -> int | None:
        t = time.monotonic()
        if t < run.stream_ttl_due:
            return KEEP_TTL
        run.stream_ttl_due = t + STREAM_TTL_REFRESH_S
        return stream_ttl(self.default_result_ttl, run.job, run)
