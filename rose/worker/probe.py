"""The probe: one round trip, sent before an engine step and read after it, that says which running jobs need
attention, whether any job was canceled, and how long the queues are.

On a busy host every round trip from the engine loop waits for redis-server to get a core the model's threads are
using, so the loop asks at most once per step, and what it asks decides what Redis pays:
- the statuses of given jobs: a Lua script reads the status and owner of each inside Redis and returns only those no
  longer `started` by this worker (canceled, stopped, deleted, finished by a retirement whose reply was lost, taken
  over by another worker): a few hundred nanoseconds of Redis per job, so rose.worker.watch asks it once a second,
  not at every step;
- the signals: the size of each queue's canceled registry (RQ's `job.cancel()` adds the job there), one command per
  queue whatever the number of running jobs: asked every `--check-interval`, a change sends for the statuses;
- the queue lengths, for the next intake.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from rose.worker import resp, rq_store
from rose.worker.rq_worker import RQWorker
from rose.worker.running import Running

# KEYS: the running jobs' hashes; ARGV[1]: this worker's name; ARGV[2]: the status 'started'; ARGV[3], ARGV[4]:
# the names of the status and owner fields. Returns {index, status, owner, ...} (1-based index; '' for a missing
# field) for jobs not started by us.
_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do
  local f = redis.call('HMGET', key, ARGV[3], ARGV[4])
  if f[1] ~= ARGV[2] or f[2] ~= ARGV[1] then
    out[#out + 1] = i
    out[#out + 1] = f[1] or ''
    out[#out + 1] = f[2] or ''
  end
end
return out
"""


@dataclass(slots=True)
class Attention:
    """A running job whose hash says it is not (or no longer) ours to run: status None means deleted."""

    run: Running
    status: str | None
    owner: str


@dataclass(frozen=True, slots=True)
class Target:
    """Where the probe looks: the worker's connection, its name, its queues' keys (highest priority first) and
    their canceled registries' keys."""

    connection: redis.Redis
    worker_name: str
    queue_keys: tuple[str, ...]
    canceled_keys: tuple[str, ...] = ()


def target(rq: RQWorker) -> Target:
    """The probe's target for this RQ worker."""
    queues = rq.queues
    return Target(
        rq.connection,
        rq.name,
        tuple(q.key for q in queues),
        tuple(q.canceled_job_registry.key for q in queues),
    )


@dataclass(slots=True)
class Reply:
    """What a probe found: `found` (running jobs needing attention), `lengths` (of the queues), `canceled` (the
    sizes of the canceled registries, None when not asked)."""

    found: list[Attention]
    lengths: list[int]
    canceled: tuple[int, ...] | None = None


def _command(target: Target, runs: list[Running], signals: bool) -> tuple[bytes, int]:
    """The probe packed as one pipeline: (bytes, number of replies)."""
    parts: list[bytes] = []
    if runs:
        # EVAL, not EVALSHA: Redis caches the compiled script either way, and there is no NOSCRIPT to recover
        # from after a Redis restart (which, on fakeredis's TCP server, also closes the connection)
        items = [
            "EVAL",
            _SCRIPT,
            len(runs),
            *(run.key for run in runs),
            target.worker_name,
            rq_store.STARTED,
            rq_store.JOB_STATUS_FIELD,
            rq_store.JOB_OWNER_FIELD,
        ]
        parts.append(resp.pack_command(items))
    parts.extend(resp.pack_command(["LLEN", key]) for key in target.queue_keys)
    if signals:
        parts.extend(resp.pack_command(["ZCARD", key]) for key in target.canceled_keys)
    return b"".join(parts), len(parts)


def _parse(target: Target, runs: list[Running], signals: bool, replies: list) -> Reply:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    found: list[Attention] = []
    if runs:
        flat, replies = replies[0], replies[1:]
        for i in range(0, len(flat), 3):
            status = rq_store.decoded(flat[i + 1])
            found.append(
                Attention(runs[int(flat[i]) - 1], status or None, rq_store.decoded(flat[i + 2]) or "")
            )
    n = len(target.queue_keys)
    lengths = [int(x) for x in replies[:n]]
    canceled = tuple(int(x) for x in replies[n:]) if signals else None
    return Reply(found, lengths, canceled)


def probe(target: Target, runs: list[Running], signals: bool = False) -> Reply:
    """The statuses of `runs` (those needing attention), the queue lengths and (`signals`) the canceled registries'
    sizes, in one round trip."""
    return _parse(
        target, runs, signals, resp.Pending(target.connection, *_command(target, runs, signals)).read()
    )


class InFlightProbe:
    """The probe sent before the engine step and read after it: Redis answers while the model runs, so the loop
    does not wait for the round trip. Statuses are read while the step runs: a cancel is seen after this step
    or the next."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._pending: resp.Pending | None = None
        self._runs: list[Running] = []
        self._signals = False

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def runs(self) -> list[Running]:
        """The jobs the probe in flight asks about."""
        return list(self._runs)

    def send(self, runs: list[Running], signals: bool = False) -> None:
        self.abandon()
        self._pending = resp.Pending(self.target.connection, *_command(self.target, runs, signals))
        self._runs, self._signals = runs, signals

    def receive(self) -> Reply:
        """The in-flight probe's answer."""
        pending, runs = self._pending, self._runs
        self._pending, self._runs = None, []
        if pending is None:
            raise RuntimeError("no probe in flight")
        return _parse(self.target, runs, self._signals, pending.read())

    def abandon(self) -> None:
        """Drop an unread probe (its connection is closed, so its reply never reaches another command)."""
        if self._pending is not None:
            self._pending.abandon()
            self._pending, self._runs = None, []
