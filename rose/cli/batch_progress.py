"""The numbers on `rose batch`'s progress line: jobs finished, failed, running and queued, and tokens per second.

Tokens are counted while the jobs stream, not only when they end (a batch's first results come only after its
first jobs' last tokens, and the line would read 0 until then): a running job counts the token events in its Redis
stream (`rose:stream:<id>`, one XLEN each: the worker appends one event per job per engine step, so events track
tokens), an ended job its exact `usage.completion_tokens`. A resumed batch counts only what its own run saw
generated: a previous run's job that this run adopts is counted from its stream length when adopted, and one that
had already ended counts nothing.

Redis load stays bounded: the streams are sampled in one pipelined round trip at most every `SAMPLE_EVERY_S`,
only for jobs the last status poll saw running, and at most `SAMPLE_CAP` of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rose.jobs import keys

SAMPLE_EVERY_S = 0.5
SAMPLE_CAP = 1024


@dataclass
class Throughput:
    """Tokens generated for this run's jobs since `started` (time.monotonic())."""

    started: float = field(default_factory=time.monotonic)
    ended_tokens: int = 0  # of the jobs that ended during this run
    live: dict[str, int] = field(default_factory=dict)  # running job -> token events counted so far
    # adopted job -> events its stream held when this run found it; None: it had ended before this run
    baseline: dict[str, int | None] = field(default_factory=dict)
    last_sample: float = float("-inf")

    def adopt(self, job_id: str, streamed_before: int | None) -> None:
        """A previous run's job this run waits for: its first `streamed_before` events (None: all of it, the
        job had already ended) were generated before this run and are not counted."""
        self.baseline[job_id] = streamed_before

    def sampled(self, lengths: dict[str, int]) -> None:
        """Record running jobs' stream lengths (XLEN)."""
        for job_id, length in lengths.items():
            if job_id in self.baseline and self.baseline[job_id] is None:
                continue
            self.live[job_id] = max(0, length - (self.baseline.get(job_id) or 0))

    def ended(self, job_id: str, completion_tokens: int | None) -> None:
        """A job ended: its exact token count (usage.completion_tokens) replaces its streamed estimate. None (it
        failed or was canceled): what it was seen streaming stays counted: the workers did generate it."""
        streamed = self.live.pop(job_id, 0)
        base = self.baseline.pop(job_id, 0)
        if base is None:  # ended before this run: nothing of it was generated now
            return
        if completion_tokens is None:
            self.ended_tokens += streamed
        else:
            self.ended_tokens += max(0, completion_tokens - base)

    def tokens(self) -> int:
        return self.ended_tokens + sum(self.live.values())

    def rate(self, now: float | None = None) -> float:
        """Tokens per second since `started`."""
        elapsed = (time.monotonic() if now is None else now) - self.started
        return self.tokens() / max(elapsed, 1e-6)

    def sample_due(self, now: float) -> bool:
        if now - self.last_sample < SAMPLE_EVERY_S:
            return False
        self.last_sample = now
        return True


def stream_lengths(conn: Any, job_ids: Iterable[str], cap: int = SAMPLE_CAP) -> dict[str, int]:
    """XLEN of up to `cap` jobs' event streams, in one pipelined round trip (a missing stream reads 0)."""
    ids = []
    for job_id in job_ids:
        if len(ids) >= cap:
            break
        ids.append(job_id)
    if not ids:
        return {}
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.xlen(keys.stream_key(job_id))
        return {job_id: int(n) for job_id, n in zip(ids, pipe.execute(), strict=True)}


def progress_text(done: int, failed: int, running: int, queued: int, tok_s: float) -> str:
    """The progress bar's postfix: `done=3 failed=0 running=64 queued=448 tok/s=812.5`."""
    return f"done={done} failed={failed} running={running} queued={queued} tok/s={tok_s:.1f}"
