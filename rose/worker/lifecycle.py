"""The worker's lifecycle: one `WorkerState`, which only ever moves forward.

    STARTING ──> RUNNING ──> DRAINING ──> STOPPING ──> STOPPED

- RUNNING: registered, its predecessor's jobs requeued (RoseWorker._startup);
- DRAINING: the first stop request (SIGTERM / SIGINT, `send_shutdown_command`), while starting or running;
- STOPPING: a second stop request, or the loop ended (drained, the drain deadline, --burst, max_idle_time):
  RoseWorker._shutdown winds down;
- STOPPED: unregistered (the end of RoseWorker._shutdown).

Two writers, each with its own field, so that neither can undo the other: the loop moves its phase (STARTING,
RUNNING, STOPPING, STOPPED: `advance`, forward only), and stop requests (SIGTERM / SIGINT on the loop's thread,
`send_shutdown_command` on RQ's pub/sub thread) are appended to a list of their own (`request_stop`; a list append
is atomic, so a signal landing mid-call loses nothing). The state is read from both: a running phase with one stop
request is DRAINING, with two STOPPING. A stop during start-up leaves the worker DRAINING once it has started.

`rq suspend` is no state of the lifecycle: it is RQ's state of the worker (suspended / busy / idle), kept by
rose.worker.rq_worker.RQWorker, and a RUNNING worker takes no jobs while it holds.
"""

from __future__ import annotations

import enum
import math
import time

__all__ = ["Lifecycle", "WorkerState"]


class WorkerState(enum.Enum):
    STARTING = "starting"  # built; `work()` registers it and requeues its predecessor's jobs
    RUNNING = "running"  # registered and serving: the loop takes jobs (none under `rq suspend`)
    DRAINING = "draining"  # asked to stop: no new jobs, recovery or maintenance; ends once nothing runs
    STOPPING = "stopping"  # leaving the loop: what finished stored, what runs requeued, then unregistered
    STOPPED = "stopped"  # unregistered: /health says the loop is not alive


_ORDER = {state: i for i, state in enumerate(WorkerState)}


class Lifecycle:
    """The worker's phase and its stop requests; `state` is read from both."""

    __slots__ = ("_phase", "_stops")

    def __init__(self) -> None:
        self._phase = WorkerState.STARTING
        self._stops: list[tuple[object, float]] = []  # (token, drain deadline), in arrival order

    def advance(self, to: WorkerState) -> bool:
        """The loop moves on to phase `to` (not DRAINING: that is a stop request's) if it lies ahead; whether it
        moved."""
        if to is WorkerState.DRAINING:
            raise ValueError("DRAINING comes from request_stop, not from the loop")
        if _ORDER[to] <= _ORDER[self._phase]:
            return False
        self._phase = to
        return True

    def request_stop(self, drain_timeout: float) -> bool:
        """A stop request: the first starts the drain (True), with `drain_timeout` seconds to finish what runs; a
        later one stops at once (False)."""
        token = object()
        self._stops.append((token, time.monotonic() + drain_timeout))
        return self._stops[0][0] is token

    @property
    def state(self) -> WorkerState:
        phase = self._phase
        if phase in (WorkerState.STOPPING, WorkerState.STOPPED) or not self._stops:
            return phase
        return WorkerState.STOPPING if len(self._stops) > 1 else WorkerState.DRAINING

    @property
    def started(self) -> bool:
        """The start-up is done: registered, the predecessor's jobs requeued (whatever stop requests came)."""
        return self._phase is not WorkerState.STARTING

    @property
    def drain_deadline(self) -> float:
        """Monotonic time by which running jobs must be done: inf until a stop request."""
        return self._stops[0][1] if self._stops else math.inf

    def should_exit(self, busy: bool) -> bool:
        """Whether the loop ends now: a second stop request, or draining with nothing `busy` or past the deadline."""
        state = self.state
        if state is WorkerState.STOPPING:
            return True
        if state is not WorkerState.DRAINING:
            return False
        return time.monotonic() >= self.drain_deadline or not busy

    @property
    def draining(self) -> bool:
        """Taking no new jobs, for good: a stop request came."""
        return bool(self._stops)
