"""Reading a job's stream, without I/O: what `Job.events` / `Job.stream` and their asyncio twins (rose.jobs.client,
rose.jobs.async_client) do with the entries their reads return, so that both read one protocol.

A reader reads the whole stream once (XRANGE), then blocks on what comes after its last entry (XREAD from
`Cursor.last_id`). It yields the events after the last stored `reset` (earlier attempts are superseded), and stops
after the terminal event. After a quiet read (`Cursor.read` gives None) the caller checks whether the job ended
without a worker to end its stream (canceled while queued), and `Cursor.check_timeout` raises TimeoutError after
`timeout` seconds without an event.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rose.jobs.errors import JobCanceled, JobFailed, StreamReset
from rose.jobs.events import TERMINAL_TYPES, entry_dict, parse_entry

POLL_S = 1.0  # seconds a stream read blocks
Entries = list[tuple[Any, Any]]  # a stream's entries as redis-py returns them: (id, fields)


def reset_point(entries: Entries) -> int:
    """Index just after the last reset among already stored entries: earlier attempts are superseded."""
    start = 0
    for i, (_, fields) in enumerate(entries):
        if entry_dict(fields).get("type") == "reset":
            start = i + 1
    return start


@dataclass(slots=True)
class Cursor:
    """One reader's place in job `job_id`'s stream. `stored` takes the XRANGE of the whole stream, `read` each
    XREAD reply (None when it brought nothing: a quiet read, counted); both give the events to yield, parsed as they
    are taken, up to and including the terminal event (`ended` then). The quiet clock starts over once the caller
    has taken every event of a read, as a reader that spends time on each event is not a quiet stream."""

    job_id: str
    timeout: float | None = None
    last_id: Any = "0"
    ended: bool = False
    quiet_polls: int = 0
    quiet_since: float = field(default_factory=time.monotonic)

    def stored(self, entries: Entries) -> Iterator[Any]:
        if entries:
            self.last_id = entries[-1][0]
        return self._events(entries[reset_point(entries) :])

    def read(self, reply: Any) -> Iterator[Any] | None:
        """The events of an XREAD reply (from `last_id`, on this stream alone)."""
        entries = reply[0][1] if reply else []
        if not entries:
            self.quiet_polls += 1
            return None
        self.last_id = entries[-1][0]
        return self._events(entries)

    def check_timeout(self) -> None:
        if self.timeout is not None and time.monotonic() - self.quiet_since > self.timeout:
            raise TimeoutError(f"no event from job {self.job_id} for {self.timeout} s")

    def _events(self, entries: Entries) -> Iterator[Any]:
        for _, fields in entries:
            event = parse_entry(fields, self.job_id)
            yield event
            if event.type in TERMINAL_TYPES:
                self.ended = True
                return
        if entries:  # all taken
            self.quiet_since, self.quiet_polls = time.monotonic(), 0


@dataclass(slots=True)
class TextDeltas:
    """`Job.stream`'s view of the events: the first choice's text deltas (their concatenation equals the result's
    text); a reset after text was given raises StreamReset, an error JobFailed, a cancel JobCanceled."""

    job_id: str
    text: list[str] = field(default_factory=list)

    def delta(self, event: Any) -> str | None:
        """The event's text to yield, if any."""
        if event.type == "token" and not event.index:  # the first choice's (n > 1: events() has them all)
            self.text.append(event.text)
            return event.text
        if event.type == "reset" and self.text:
            raise StreamReset(self.job_id, "".join(self.text))
        if event.type == "error":
            raise JobFailed(self.job_id, event.message)
        if event.type == "canceled":
            raise JobCanceled(self.job_id, event.reason)
        return None
