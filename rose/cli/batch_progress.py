"""The numbers on `rose batch`'s progress line: jobs finished, failed, running and queued, and tokens per second.

tok/s is exact, not estimated: the `usage.completion_tokens` of the jobs that finished during this run, over
the time since this run started. Token events cannot give a running count: a streamed job's events are
coalesced (one event carries every token since the previous one), and a job sent with `stream: false` (rose
batch's default) has none. So the rate reads 0 until the first jobs finish, and while jobs run it lags what
the workers generate (a running job's tokens count only once it has finished); over a run of many jobs it
converges on the real rate.

Only tokens known to be generated during this run count, so the rate never overstates it. A resumed batch: a
previous run's job that had already ended counts nothing, one still queued when this run found it counts in
full, and one already running then counts nothing (part of it was generated before this run, and how much is
not known: its stream no longer tells, and the workers' clocks are not ours). Jobs that fail or are canceled
count nothing: rose stores no token count for them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Throughput:
    """Completion tokens of the jobs that finished during this run, since `started` (time.monotonic())."""

    started: float = field(default_factory=time.monotonic)
    tokens: int = 0
    # adopted jobs (a previous run's) whose tokens are not (all) this run's: they count nothing when they end
    uncounted: set[str] = field(default_factory=set)

    def adopt(self, job_id: str, counted: bool) -> None:
        """A previous run's job this run waits for: `counted` when every token it generates is this run's (it
        was still queued when found), False when it had started or ended before."""
        if not counted:
            self.uncounted.add(job_id)

    def ended(self, job_id: str, completion_tokens: int | None) -> None:
        """A job ended: its exact token count (usage.completion_tokens), None if it failed or was canceled."""
        if job_id in self.uncounted:
            self.uncounted.discard(job_id)
        elif completion_tokens is not None:
            self.tokens += completion_tokens

    def rate(self, now: float | None = None) -> float:
        """Tokens per second since `started`."""
        elapsed = (time.monotonic() if now is None else now) - self.started
        return self.tokens / max(elapsed, 1e-6)


def progress_text(done: int, failed: int, running: int, queued: int, tok_s: float) -> str:
    """The progress bar's postfix: `done=3 failed=0 running=64 queued=448 tok/s=812.5`."""
    return f"done={done} failed={failed} running={running} queued={queued} tok/s={tok_s:.1f}"
