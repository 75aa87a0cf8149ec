"""The job events of one loop iteration, queued in order and handed to the publisher at the end of the iteration.

Streams (`rose:stream:<id>`) expire with the job's result TTL once the job has ended (-1: never); while the job
runs, they live at least until its timeout plus that TTL. A running job's events re-set the expiry once a minute
only (one Redis command less per token otherwise).
"""

from __future__ import annotations

import time
from typing import Any

from rq.job import Job

from rose.jobs.events import ResetEvent, token_event_json
from rose.worker.publisher import KEEP_TTL, NO_EXPIRY, Outgoing, Publisher
from rose.worker.running import Running

STREAM_TTL_REFRESH_S = 60  # a running job's events re-set its stream's expiry this often (it is hours long)


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


class Outbox:
    """Owns the events not yet handed to `publisher`."""

    def __init__(self, publisher: Publisher, default_result_ttl: int) -> None:
        self.publisher = publisher
        self.default_result_ttl = default_result_ttl
        self._events: list[Outgoing] = []

    def token(self, run: Running, text: str, token_ids: list[int]) -> None:
        data = token_event_json(run.id, run.next_seq(), text, token_ids)
        self._events.append(Outgoing(run.id, data, self._running_ttl(run)))

    def reset(self, run: Running, reason: str = "restart") -> None:
        """The job starts over (an earlier attempt's events are in its stream): subscribers drop what they had."""
        run.stream_ttl_due = 0.0
        self._events.append(
            Outgoing(run.id, ResetEvent(job_id=run.id, reason=reason).to_json(), self._running_ttl(run))
        )

    def terminal(self, run: Running, event: Any) -> None:
        """The job's last event (done, error, canceled), its end stored in RQ and the job marked
        (rose.worker.seal): written while the mark holds. Its stream now expires with the job's result."""
        ttl = stream_ttl(self.default_result_ttl, run.job)
        self._events.append(Outgoing(run.id, event.to_json(), ttl, seals=True))

    @property
    def idle(self) -> bool:
        """Nothing queued here nor unacknowledged by Redis."""
        return not self._events and self.publisher.backlog == 0

    def flush(self) -> None:
        """Hand the queued events to the publisher (which also collects Redis's replies, or retries after an
        outage)."""
        if self._events:
            self.publisher.send(self._events)
            self._events = []
        else:
            self.publisher.poll()

    def _running_ttl(self, run: Running) -> int | None:
        t = time.monotonic()
        if t < run.stream_ttl_due:
            return KEEP_TTL
        run.stream_ttl_due = t + STREAM_TTL_REFRESH_S
        return stream_ttl(self.default_result_ttl, run.job, run)
