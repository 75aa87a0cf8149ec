"""The per-step probe: one round trip that says which running jobs need attention and how long the queues are.

On a busy host every round trip from the engine loop waits for redis-server to get a core the model's threads are
using, so the loop asks once per step: a Lua script reads the status and owner of every running job inside Redis
and returns only the jobs that are no longer `started` by this worker (canceled, stopped, deleted, finished by a
retirement whose reply was lost, taken over by another worker), and the same pipeline sizes the queues for the
next intake. A step with nothing to report costs one small reply, whatever the number of running jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from rq.job import JobStatus

if TYPE_CHECKING:
    from rose.worker.intake import Running
    from rose.worker.worker import RoseWorker

# KEYS: the running jobs' hashes; ARGV[1]: this worker's name.
# Returns {index, status, owner, ...} (1-based index; '' for a missing field) for jobs not started by us.
_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do
  local f = redis.call('HMGET', key, 'status', 'worker_name')
  if f[1] ~= ARGV[2] or f[2] ~= ARGV[1] then
    out[#out + 1] = i
    out[#out + 1] = f[1] or ''
    out[#out + 1] = f[2] or ''
  end
end
return out
"""


@dataclass
class Attention:
    """A running job whose hash says it is not (or no longer) ours to run: status None means deleted."""

    run: Running
    status: str | None
    owner: str


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _commands(worker: RoseWorker, runs: list[Running]) -> list[tuple]:
    cmds: list[tuple] = []
    if runs:
        job_keys = [run.job.key for run in runs]
        # EVAL, not EVALSHA: Redis caches the compiled script either way, and there is no NOSCRIPT to recover
        # from after a Redis restart (which, on fakeredis's TCP server, also closes the connection)
        cmds.append(("EVAL", _SCRIPT, len(runs), *job_keys, worker.name, JobStatus.STARTED.value))
    cmds.extend(("LLEN", queue.key) for queue in worker.queues)
    return cmds


def _parse(runs: list[Running], replies: list) -> tuple[list[Attention], list[int]]:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    lengths = [int(n) for n in replies[1:]] if runs else [int(n) for n in replies]
    found: list[Attention] = []
    if runs:
        flat = replies[0]
        for i in range(0, len(flat), 3):
            status = _text(flat[i + 1])
            found.append(Attention(runs[int(flat[i]) - 1], status or None, _text(flat[i + 2])))
    return found, lengths


def probe(worker: RoseWorker, runs: list[Running]) -> tuple[list[Attention], list[int]]:
    """(jobs needing attention, length of each of the worker's queues) in one round trip."""
    with worker.connection.pipeline(transaction=False) as pipe:
        for cmd in _commands(worker, runs):
            pipe.execute_command(*cmd)
        replies = pipe.execute(raise_on_error=False)
    return _parse(runs, replies)


class InFlightProbe:
    """The probe sent before the engine step and read after it: Redis answers while the model runs, so the loop
    does not wait for the round trip. Statuses are read while the step runs: a cancel is seen after this step
    or the next."""

    def __init__(self, worker: RoseWorker) -> None:
        self.worker = worker
        self._conn: Any = None
        self._runs: list[Running] = []
        self._count = 0

    @property
    def pending(self) -> bool:
        return self._conn is not None

    def send(self, runs: list[Running]) -> None:
        self.abandon()
        pool = self.worker.connection.connection_pool
        conn = pool.get_connection()
        try:
            cmds = _commands(self.worker, runs)
            conn.send_packed_command(conn.pack_commands(cmds))
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            raise
        self._conn, self._runs, self._count = conn, runs, len(cmds)

    def receive(self) -> tuple[list[Attention], list[int]]:
        """The in-flight probe's answer."""
        conn, runs, count = self._conn, self._runs, self._count
        self._conn, self._runs = None, []
        pool = self.worker.connection.connection_pool
        replies: list[Any] = []
        try:
            for _ in range(count):
                try:
                    replies.append(conn.read_response())
                except redis.exceptions.ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        return _parse(runs, replies)

    def abandon(self) -> None:
        """Drop an unread probe (its connection is closed: an unread reply must not reach another command)."""
        if self._conn is not None:
            conn, self._conn, self._runs = self._conn, None, []
            conn.disconnect()
            self.worker.connection.connection_pool.release(conn)
