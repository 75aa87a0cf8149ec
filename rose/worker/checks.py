"""What a busy worker checks about its running jobs, and how often.

Every `check_interval` seconds (0: every engine step) the loop sends the probe (rose.worker.probe) before a step and
reads it after: cancels, deletions and jobs no longer ours (taken over by another worker, or finished by a
retirement whose reply was lost); then timeouts. Between probes nothing about the running jobs is read, so a cancel
stops a job's generation within about `check_interval` plus one step (`rq`'s stop-job commands come by pub/sub and
act at the next iteration). Storing a result never
depends on that delay: the retirer reads each finishing job's status under WATCH before it writes (a canceled job
is never stored as finished), and a job it hands back to the loop, or one with a success callback, is checked
again before RQ's handler stores it.

The probe also sizes the queues for the next intake; on a step without a probe, and when the probe saw empty
queues, only the queue lengths are asked after the step (read at the next intake), so a busy loop never waits for
a round trip to learn whether jobs came.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rq.job import JobStatus

from rose.worker import probe
from rose.worker.outcomes import RoseJobTimeout

if TYPE_CHECKING:
    from rose.worker.intake import Running
    from rose.worker.worker import RoseWorker

log = logging.getLogger(__name__)


class Checks:
    """Mixin of RoseWorker: the probe's schedule and what the loop does with its answer."""

    def _force_check(self: RoseWorker, runs: list[Running]) -> None:
        """These jobs are to be stored by RQ's handler (retire_inline): read their status first. A probe already in
        flight does not cover them, so one goes out before the next step (at once when the engine is idle), and
        `_retire` leaves each alone until a probe that covered it has been read."""
        for run in runs:
            run.needs_check = True
        self._check_forced = True

    def _send_checks(self: RoseWorker) -> None:
        """Before a step: send the probe if it is due (its answer is read by `_checks` after the step)."""
        t = time.monotonic()
        if self.running and (t >= self._next_check or self._check_forced):
            self._next_check = t + self.settings.check_interval
            self._probe.send(list(self.running.values()))

    def _checks_due(self: RoseWorker) -> bool:
        """After a step: whether `_checks` runs now (its probe is in, or a forced check cannot wait for a step)."""
        if not self.running:
            return False
        return self._probe.pending or (self._check_forced and not self.engine.has_unfinished())

    def _checks(self: RoseWorker) -> None:
        """Cancels (job.cancel() / client), deletions, lost ownership and timeouts, before any retirement. One round
        trip (usually sent before the step and answered while it ran), which also sizes the queues for the next
        intake."""
        if self._probe.pending:
            covered = self._probe.runs
            found, self._queue_lengths = self._probe.receive()
        else:
            covered = list(self.running.values())
            found, self._queue_lengths = probe.probe(self, covered)
        for item in found:
            run, status, owner = item.run, item.status, item.owner
            if self.running.get(run.id) is not run:
                continue
            if status is None:
                self._cancel(run, "deleted")
            elif status in (JobStatus.CANCELED.value, JobStatus.STOPPED.value):
                self._cancel(run, "canceled")
            elif status == JobStatus.FINISHED.value and owner == self.name and run.output is not None:
                # Our retirement reached Redis but its reply was lost (connection drop): finish the job here.
                self._announce_done(run)
            else:
                # Requeued by another worker that took us for dead (e.g. after a long Redis outage).
                log.warning("job %s is now %s on %r; dropping our copy", run.id, status, owner)
                self._forget(run)
        # only now: a Redis error above leaves the check owed; jobs handed back after the probe went out still owe one
        for run in covered:
            run.needs_check = False
        self._check_forced = any(run.needs_check for run in self.running.values())
        t = time.monotonic()
        for run in list(self.running.values()):
            if run.timeout is not None and run.output is None and t - run.started_mono > run.timeout:
                self._fail(
                    run,
                    f"Job exceeded maximum timeout value ({run.timeout} seconds)",
                    exc_class=RoseJobTimeout,
                )

    def _apply_stops(self: RoseWorker) -> None:
        """`rq`'s stop-job commands (received by pub/sub), at every iteration: before the job's result is stored."""
        while self._stop_job_ids:
            job_id, _, execution_id = self._stop_job_ids[0].partition(":")
            run = self.running.get(job_id)
            if run is not None and execution_id in ("", run.execution.id):
                self._stop(run)  # forgets the job only once stored as stopped
            self._stop_job_ids.popleft()  # only then: after a Redis error the next iteration tries again

    def _ask_lengths(self: RoseWorker) -> None:
        """After a step: ask the queue lengths for the next intake unless the probe brought them (non-empty) or a
        question is in flight; the reply is read at the intake, so the loop waits for no round trip."""
        if self.draining or self._suspended or self._lengths_probe.pending or self._room() <= 0:
            return
        if self._queue_lengths is None or not any(self._queue_lengths):
            self._lengths_probe.send([])
