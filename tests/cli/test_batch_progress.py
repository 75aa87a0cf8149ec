"""`rose batch`'s progress numbers: tok/s counts the exact completion tokens of the jobs that finished during the
run, whatever their token events (coalesced, or none at all with stream: false), and a resumed batch's tokens
from a previous run never count."""

from __future__ import annotations

import argparse
import io

import pytest
from rq.results import Result

from rose.cli import batch as batch_cli
from rose.cli.batch_files import Entry, PlainFormat
from rose.cli.batch_progress import Throughput, progress_text
from rose.jobs.client import Client, Job


def test_ended_jobs_count_their_exact_completion_tokens() -> None:
    t = Throughput(started=100.0)
    assert t.rate(now=101.0) == 0.0
    t.ended("a", 10)
    t.ended("b", 6)
    t.ended("c", None)  # failed or canceled: rose stores no token count for it
    assert t.tokens == 16 and t.rate(now=104.0) == pytest.approx(4.0)


def test_a_resumed_jobs_earlier_tokens_do_not_count() -> None:
    t = Throughput(started=0.0)
    t.adopt("old-ended", counted=False)  # ended before this run started
    t.adopt("old-running", counted=False)  # started before: part of its tokens are not this run's
    t.adopt("old-queued", counted=True)  # still queued: everything it generates is this run's
    t.ended("old-ended", 64)
    t.ended("old-running", 48)
    t.ended("old-queued", 8)
    t.ended("new", 5)
    assert t.tokens == 8 + 5
    assert t.uncounted == set()


def test_progress_text() -> None:
    assert progress_text(3, 1, 64, 448, 812.54) == "done=3 failed=1 running=64 queued=448 tok/s=812.5"


class FakeProgress:
    def __init__(self) -> None:
        self.postfix = ""

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def refresh(self) -> None:
        pass


def finish(r, job: Job, completion_tokens: int) -> None:
    """Store `job` as finished, as a worker does (status, then a successful result with its usage)."""
    usage = {"prompt_tokens": 1, "completion_tokens": completion_tokens}
    result = {"text": "x", "finish_reason": "length", "usage": usage}
    Result.create(job.rq_job, Result.Type.SUCCESSFUL, ttl=60, return_value=result)
    r.hset(f"rq:job:{job.id}", "status", "finished")


def test_batch_counts_finished_jobs_of_this_run_only(fake_r) -> None:
    """The real adopt + poll + show path of `rose batch` against Redis: jobs of this run and a previous run's job
    still queued when found count their completion tokens once finished; a previous run's job found running or
    already ended, a failed job and a running job count nothing; the line shows running and queued jobs."""
    client = Client(fake_r, queue="rose")
    batch = batch_cli.Batch(argparse.Namespace(), PlainFormat(), io.StringIO(), None, io.StringIO())
    new, running, queued, failed = (client.submit(p) for p in ("new", "running", "queued", "failed"))
    was_queued, was_running, had_ended, gone, canceled = (
        client.submit(p) for p in ("was-queued", "was-running", "had-ended", "gone", "canceled")
    )
    fake_r.hset(f"rq:job:{was_running.id}", "status", "started")
    finish(fake_r, had_ended, 100)
    fake_r.hset(f"rq:job:{canceled.id}", "status", "canceled")
    fake_r.delete(f"rq:job:{gone.id}")
    for i, job in enumerate((new, running, queued, failed)):
        batch.inflight[job.id] = Entry(i, f"line-{i}")
    adopted = {
        job.id: batch_cli._adopt(batch, fake_r, job.id, Entry(10 + i, f"old-{i}"))
        for i, job in enumerate((was_queued, was_running, had_ended, gone, canceled))
    }
    # gone or canceled since: the line runs again
    assert list(adopted.values()) == [True, True, True, False, False]

    fake_r.hset(f"rq:job:{running.id}", "status", "started")
    fake_r.hset(f"rq:job:{failed.id}", "status", "failed")
    finish(fake_r, new, 7)
    finish(fake_r, was_queued, 5)
    finish(fake_r, was_running, 40)
    assert batch_cli._poll(batch, client, fake_r) == 5  # new, failed, was-queued, was-running, had-ended
    assert (batch.done, batch.failed) == (4, 1)
    assert batch.running == {running.id} and set(batch.inflight) == {running.id, queued.id}
    assert batch.throughput.tokens == 7 + 5

    batch.throughput.started -= 2.0  # two seconds into the run
    progress = FakeProgress()
    batch_cli._show(batch, progress)
    done, failed_n, run, queue, rate = (part.split("=")[1] for part in progress.postfix.split())
    assert (done, failed_n, run, queue) == ("4", "1", "1", "1")
    assert 0 < float(rate) <= 12 / 2.0
