"""Fault points, for the tests that kill rose-worker at chosen instants (tests/worker/test_kill_points.py) and the
kill stress script (benchmarks/stress_kill.py).

`ROSE_FAULT_POINT=<name>[:<n>]` in a worker's environment makes the process SIGKILL itself the n-th time (default:
the first) it passes the point `<name>`: no cleanup, no flush, exactly as `kill -9`. Points:

- `result_stored`: a job's result was just stored in RQ; its `done` event is not queued yet if RQ's handler stored it
  (a retirer batch wrote it in the same transaction) (rose.worker.endings);
- `failure_stored`: a job's failure was just stored in RQ; its `error` event is not queued yet;
- `events_sent`: the last token events of finishing jobs were just handed to the publisher; their results are not
  stored yet (rose.worker.loop).

Unset (always, in production) a point costs one global read.
"""

from __future__ import annotations

import os
import signal

_NAME, _, _COUNT = (os.environ.get("ROSE_FAULT_POINT") or "").partition(":")
_hits = 0


def point(name: str) -> None:
    if _NAME and name == _NAME:
        _hit()


def _hit() -> None:
    global _hits
    _hits += 1
    if _hits >= int(_COUNT or 1):
        os.kill(os.getpid(), signal.SIGKILL)
