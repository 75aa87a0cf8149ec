"""What the worker watches about its running jobs, and how often; it answers with findings the loop applies.

The probe (rose.worker.probe) is sent before an engine step and read after it. What it asks is priced for a fleet
on one Redis, where nothing may cost Redis per generated token:
- every `check_interval` seconds (0: every engine step), the signals: the size of each queue's canceled registry,
  one command a queue whatever the number of running jobs; timeouts are judged at the same time. A changed size
  sends for every running job's status at the next step, so a cancel stops a job's generation within about
  `check_interval` plus two steps;
- every STATUS_INTERVAL_S (or `check_interval` if longer), every running job's status: deletions and jobs no longer
  ours (taken over by another worker, or finished by a retirement whose reply was lost); `check_all` asks it at the
  next step (after a Redis outage or failover, rose.worker.worker).
`rq`'s stop commands (`send_stop_job_command`, RQ 3's `send_stop_execution_command`) come by pub/sub and are found
at the next iteration.

Storing a result never depends on that delay: the retirer writes a batch's results only if each job is still
started by this worker, under a WATCH (rose.worker.batch_store), and a job to be stored by RQ's handler (phases CHECKING / RECHECKING: a success callback, or handed back by
the retirer) is owed a probe of its own: one goes out before the next step (at once when the engine is idle), and
`Checked.checked` lists the jobs a probe read while they were owed one.

The probe also sizes the queues for the next intake (rose.worker.intake: a dequeue moves what there is without
asking first; empty queues seen by a probe, or left by a dequeue, are not tried again until a probe sees jobs).
Watch never changes a job: the loop (rose.worker.loop) applies what it reports.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from rose.worker import probe, rq_store
from rose.worker.running import ACTIVE, CHECKED_PHASE, Running

log = logging.getLogger(__name__)

# Every running job's status is read this often (about a microsecond of Redis per job): deletions and jobs taken
# over are rare, and after an outage the worker reads them at once (`check_all`).
STATUS_INTERVAL_S = 5.0


class Verdict(enum.Enum):
    DELETED = "deleted"  # the job's hash is gone
    CANCELED = "canceled"  # job.cancel() / a client's cancel (detail: canceled / stopped)
    FAILED = "failed"  # failed by someone else (RQ's cleanup of a registry entry it took for abandoned)
    STORED = "stored"  # finished by our own retirement, whose reply was lost: only its announcement is left
    LOST = "lost"  # another worker runs it now (this one was taken for dead): drop our copy
    TIMED_OUT = "timed_out"  # ran past its RQ job timeout
    DEADLINE = "deadline"  # ran past its deadline, on a worker that aborts such jobs
    STOP = "stop"  # an `rq` stop command names it


@dataclass(frozen=True, slots=True)
class Finding:
    run: Running
    verdict: Verdict
    detail: str = ""  # LOST: the job's status and owner now


@dataclass(slots=True)
class Checked:
    findings: list[Finding] = field(default_factory=list)
    checked: list[Running] = field(default_factory=list)  # owed a check, and read by this one


def owed(runs: Iterable[Running]) -> bool:
    return any(run.phase in CHECKED_PHASE for run in runs)


class Watch:
    def __init__(
        self, target: probe.Target, check_interval: float, abort_past_deadline: bool = False
    ) -> None:
        self.check_interval = check_interval
        self.abort_past_deadline = abort_past_deadline  # --deadline-policy abort
        self._target = target
        self._probe = probe.InFlightProbe(target)
        self._next_check = 0.0  # monotonic time the next signals are due
        self._next_status = 0.0  # monotonic time every running job's status is next read
        self._status_asked = False  # read every running job's status at the next step (a signal changed)
        self._canceled: tuple[int, ...] | None = None  # the canceled registries' sizes, as last read
        self._owed: list[Running] = []  # jobs owed a check when the probe in flight was sent
        self._lengths: list[int] | None = None  # as of the last probe, for the next intake
        self._stops: collections.deque[tuple[str, str]] = (
            collections.deque()
        )  # appended by RQ's pub/sub thread

    # ---- stop commands ----------------------------------------------------------------------------------------

    def stop_command(self, job_id: str, execution_id: str = "") -> None:
        """An `rq` stop command (any thread). `execution_id` empty: whatever execution runs the job."""
        self._stops.append((job_id, execution_id))

    def stops(self, running: dict[str, Running]) -> list[Finding]:
        """The stop commands received since the last call that name a running job (and its execution, if given)."""
        found: list[Finding] = []
        while self._stops:
            job_id, execution_id = self._stops.popleft()
            run = running.get(job_id)
            if run is not None and run.phase in ACTIVE and execution_id in ("", run.execution.id):
                found.append(Finding(run, Verdict.STOP))
            else:  # as RQ's worker does: a job that ended first (its result waiting to be stored, a full Redis
                # holding it back) is left as it is
                log.info("stop command for job %s, which is not running here: ignored", job_id)
        return found

    # ---- the probe ----------------------------------------------------------------------------------------------

    def check_all(self) -> None:
        """Read every running job's status at the next step (at once when the engine is idle)."""
        self._status_asked = True

    def before_step(self, running: dict[str, Running]) -> None:
        """Send the probe if signals or statuses are due, or jobs are owed a check (its answer is read by `check`
        after the step)."""
        t = time.monotonic()
        runs = list(running.values())
        if not runs:
            return
        owed_runs = [run for run in runs if run.phase in CHECKED_PHASE]
        signals = t >= self._next_check
        statuses = self._status_asked or t >= self._next_status
        if not (signals or statuses or owed_runs):
            return
        if signals:
            self._next_check = t + self.check_interval
        if statuses:
            self._status_asked = False
            self._next_status = t + max(STATUS_INTERVAL_S, self.check_interval)
        self._probe.send(runs if statuses else owed_runs, signals)
        self._owed = owed_runs

    def due(self, running: dict[str, Running], engine_busy: bool) -> bool:
        """After a step: whether `check` runs now (its probe is in, or an owed check cannot wait for a step)."""
        if not running:
            return False
        return self._probe.pending or (not engine_busy and (self._status_asked or owed(running.values())))

    def check(self, running: dict[str, Running]) -> Checked:
        """Cancels, deletions, lost ownership, timeouts and deadlines. Reads the probe in flight, or probes now (one round trip,
        which also sizes the queues for the next intake)."""
        if self._probe.pending:
            asked = self._owed
            reply = self._probe.receive()
        else:
            statuses = self._status_asked
            self._status_asked = False
            asked = [run for run in running.values() if run.phase in CHECKED_PHASE]
            reply = probe.probe(self._target, list(running.values()) if statuses else asked)
        self._owed = []
        self._lengths = reply.lengths
        if reply.canceled is not None:
            if self._canceled is not None and reply.canceled != self._canceled:
                self._status_asked = True  # a job was canceled somewhere: is it one of ours?
            self._canceled = reply.canceled
        result = Checked(checked=[run for run in asked if run.phase in CHECKED_PHASE])
        for item in reply.found:
            result.findings.append(_judge(item, self._target.worker_name))
        seen = {finding.run.id for finding in result.findings}
        t, now = time.monotonic(), time.time()
        for run in running.values():
            if run.id in seen:
                continue
            if run.timed_out(t):
                result.findings.append(Finding(run, Verdict.TIMED_OUT))
            elif self.abort_past_deadline and run.past_deadline(now):
                result.findings.append(Finding(run, Verdict.DEADLINE))
        return result

    # ---- queue lengths for the intake -----------------------------------------------------------------------------

    def queue_lengths(self) -> list[int] | None:
        """The queue lengths the last probe read, once (None: no probe since the last intake)."""
        lengths, self._lengths = self._lengths, None
        return lengths


def _judge(item: probe.Attention, me: str) -> Finding:
    run, status, owner = item.run, item.status, item.owner
    if status is None:
        return Finding(run, Verdict.DELETED)
    if status in (rq_store.CANCELED, rq_store.STOPPED):
        return Finding(run, Verdict.CANCELED, status)
    if status == rq_store.FAILED:
        return Finding(run, Verdict.FAILED, owner)
    if status == rq_store.FINISHED and owner == me and run.output is not None:
        return Finding(run, Verdict.STORED)
    return Finding(run, Verdict.LOST, f"{status} on {owner!r}")
