"""`rose batch`'s progress numbers: running jobs and streamed tokens show before the first job ends, and a resumed
batch's tokens from a previous run never count in tok/s."""

from __future__ import annotations

import argparse
import io

import pytest

from rose.cli import batch as batch_cli
from rose.cli.batch_files import Entry
from rose.cli.batch_progress import SAMPLE_EVERY_S, Throughput, progress_text, stream_lengths
from rose.jobs import keys
from rose.jobs.client import Client


def stream(r, job_id: str, n: int) -> None:
    for i in range(n):
        r.xadd(keys.stream_key(job_id), {keys.STREAM_FIELD: f'{{"type": "token", "seq": {i}}}'})


def test_running_jobs_count_their_streamed_tokens_until_they_end() -> None:
    t = Throughput(started=100.0)
    t.sampled({"a": 5, "b": 3})
    assert t.tokens() == 8 and t.rate(now=102.0) == pytest.approx(4.0)
    t.sampled({"a": 9})  # later sample: grows, b keeps its last count
    assert t.tokens() == 12
    t.ended("a", 10)  # the exact count (usage.completion_tokens) replaces the streamed estimate
    assert t.tokens() == 13 and "a" not in t.live
    t.ended("b", None)  # failed after streaming 3: those were generated
    assert t.tokens() == 13 and t.live == {}


def test_a_resumed_jobs_earlier_tokens_do_not_count() -> None:
    t = Throughput(started=0.0)
    t.adopt("old-running", 40)  # streamed 40 events before this run
    t.adopt("old-ended", None)  # ended before this run started
    t.adopt("old-queued", 0)  # still queued: everything it generates is this run's
    t.sampled({"old-running": 45, "old-queued": 7, "old-ended": 64})
    assert t.live == {"old-running": 5, "old-queued": 7}
    t.ended("old-running", 48)
    t.ended("old-ended", 64)
    t.ended("old-queued", 8)
    assert t.tokens() == 8 + 8  # 48 - 40, nothing of old-ended, all 8 of old-queued
    assert t.baseline == {}


def test_sampling_is_rate_limited() -> None:
    t = Throughput()
    assert t.sample_due(10.0)
    assert not t.sample_due(10.0 + SAMPLE_EVERY_S / 2)
    assert t.sample_due(10.0 + SAMPLE_EVERY_S)


def test_stream_lengths_is_capped_and_reads_missing_streams_as_zero(fake_r) -> None:
    stream(fake_r, "a", 3)
    assert stream_lengths(fake_r, ["a", "missing"]) == {"a": 3, "missing": 0}
    assert stream_lengths(fake_r, ["a", "missing"], cap=1) == {"a": 3}
    assert stream_lengths(fake_r, []) == {}


def test_progress_text() -> None:
    assert progress_text(3, 1, 64, 448, 812.54) == "done=3 failed=1 running=64 queued=448 tok/s=812.5"


class FakeProgress:
    def __init__(self) -> None:
        self.postfix = ""

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def refresh(self) -> None:
        pass


def test_batch_shows_running_jobs_and_tokens_before_any_job_ends(fake_r) -> None:
    """The real poll + sample + show path of `rose batch` against Redis: nothing has ended, yet the line shows
    the running jobs and a non-zero tok/s; an adopted job's earlier events are not counted."""
    client = Client(fake_r, queue="rose")
    args = argparse.Namespace()
    batch = batch_cli.Batch(args, fmt=None, out=io.StringIO(), err=None, jobs_out=io.StringIO())  # type: ignore[arg-type]
    running, queued, adopted = (client.submit(p) for p in ("a", "b", "c"))
    for job in (running, adopted):
        fake_r.hset(f"rq:job:{job.id}", "status", "started")
    stream(fake_r, adopted.id, 30)  # a previous run's job: 30 events before this run found it
    status, streamed = batch_cli._previous_job(fake_r, adopted.id)
    assert (status, streamed) == ("started", 30)
    batch.throughput.adopt(adopted.id, streamed)
    for i, job in enumerate((running, queued, adopted)):
        batch.inflight[job.id] = Entry(i + 1, str(i + 1))
    stream(fake_r, running.id, 6)
    stream(fake_r, adopted.id, 2)

    assert batch_cli._poll(batch, client, fake_r) == 0
    assert batch.running == {running.id, adopted.id}
    assert batch.throughput.sample_due(1e9)
    batch.throughput.sampled(stream_lengths(fake_r, batch.running))
    progress = FakeProgress()
    batch_cli._show(batch, progress)
    done, failed, run, queue, rate = (part.split("=")[1] for part in progress.postfix.split())
    assert (done, failed, run, queue) == ("0", "0", "2", "1")
    assert float(rate) > 0
    assert batch.throughput.tokens() == 6 + 2
