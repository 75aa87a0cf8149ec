"""rose.worker.outbox.Outbox.token alone, without Redis: which tokens go out at once, which are held, and that every
event (first, held, a finished choice's, released, resynced) carries exactly the tokens since the choice's last; and
what a refusal of a job's events starts (`refused`; a full Redis's: `refused_for_memory`)."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest

from rose.jobs.events import CanceledEvent
from rose.worker.outbox import RETRY_FULL_S, Outbox
from rose.worker.running import Choice, Running


class StubPublisher:
    """What the outbox asks of rose.worker.publisher.Publisher: batches kept here, never sent."""

    acked = settled = written = last_batch = verified = 0
    backlog = 0

    def __init__(self) -> None:
        self.batches: list[list] = []

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def verify(self) -> None:  # an empty batch
        self.verified += 1

    def send(self, events: list) -> int:
        self.batches.append(list(events))
        return len(self.batches)

    def poll(self) -> None:
        pass

    def unacked_jobs(self) -> set[str]:
        return set()


def running(job_id: str = "j", n: int = 1, logprobs: bool = False) -> Running:
    job = SimpleNamespace(id=job_id, key=f"rq:job:{job_id}", get_result_ttl=lambda default: default)
    run = Running(job, None, None, time.time(), time.monotonic(), 60)  # type: ignore[arg-type]
    run.request = SimpleNamespace(stream=True, metadata=None)  # type: ignore[assignment]
    run.choices = [Choice(logprobs=[] if logprobs else None) for _ in range(n)]
    return run


def sent(outbox: Outbox, publisher: StubPublisher, release: bool = False) -> list[dict]:
    outbox.flush(release=release)
    events = [json.loads(e.data) for e in publisher.batches[-1]] if publisher.batches else []
    publisher.batches.clear()
    return events


def entry(token_id: int) -> dict:
    return {"token_id": token_id, "token": "t", "bytes": None, "logprob": -1.0, "top_logprobs": []}


def test_the_first_event_goes_out_at_once_later_tokens_are_held_and_released_together():
    publisher = StubPublisher()
    outbox, run = Outbox(publisher, 500, stream_interval=3600), running(logprobs=True)
    outbox.token(run, "a", [1], [entry(1)])
    (first,) = sent(outbox, publisher)
    assert (first["seq"], first["text"], first["token_ids"], first["logprobs"]) == (0, "a", [1], [entry(1)])
    assert "index" not in first
    outbox.token(run, "b", [2], [entry(2)])
    outbox.token(run, "c", [3], [entry(3)])
    assert sent(outbox, publisher) == []  # held: the release is an hour away
    (held,) = sent(outbox, publisher, release=True)
    assert (held["seq"], held["text"], held["token_ids"]) == (1, "bc", [2, 3])
    assert held["logprobs"] == [entry(2), entry(3)]
    assert outbox.idle


def test_a_finished_choice_goes_out_with_what_it_held_and_each_choice_is_named():
    publisher = StubPublisher()
    outbox, run = Outbox(publisher, 500, stream_interval=3600), running(n=2)
    outbox.token(run, "a", [1], index=0)  # the job's first event: at once
    outbox.token(run, "x", [7], index=1)  # held (not the job's first)
    outbox.token(run, "b", [2], index=0)
    outbox.token(run, "y", [8], index=1, last=True)  # choice 1 finished: its held tokens go with these
    events = sent(outbox, publisher)
    assert [(e["index"], e["seq"], e["text"], e["token_ids"]) for e in events] == [
        (0, 0, "a", [1]),
        (1, 1, "xy", [7, 8]),
    ]
    outbox.release(run)
    (rest,) = sent(outbox, publisher)
    assert (rest["index"], rest["seq"], rest["text"], rest["token_ids"]) == (0, 2, "b", [2])
    assert outbox.idle


def test_without_a_stream_interval_every_call_is_an_event_and_nothing_is_held():
    publisher = StubPublisher()
    outbox, run = Outbox(publisher, 500, stream_interval=0), running()
    ids = [5, 6]
    for i in ids:
        outbox.token(run, str(i), [i])
    outbox.token(run, "", [], last=True)
    events = sent(outbox, publisher)
    assert [(e["seq"], e["text"], e["token_ids"]) for e in events] == [
        (0, "5", [5]),
        (1, "6", [6]),
        (2, "", []),
    ]
    assert outbox.idle


def test_a_resync_sends_every_token_so_far_after_a_reset():
    publisher = StubPublisher()
    outbox, run = Outbox(publisher, 500, stream_interval=3600), running()
    run.choices[0].text, run.choices[0].token_ids = ["a", "b"], [1, 2]  # what the loop recorded
    outbox.token(run, "a", [1])
    assert len(sent(outbox, publisher)) == 1
    outbox.token(run, "b", [2])  # held, then dropped with the reset: the resync carries it
    outbox.resync(run, "redis lost events")
    reset, tokens = sent(outbox, publisher)
    assert reset["type"] == "reset" and reset["reason"] == "redis lost events"
    assert (tokens["seq"], tokens["text"], tokens["token_ids"]) == (0, "ab", [1, 2])
    assert outbox.idle


def test_refused_events_start_the_stream_over_once_then_the_job_goes_on_without_one(caplog):
    publisher = StubPublisher()
    outbox, run = Outbox(publisher, 500, stream_interval=3600), running()
    run.choices[0].text, run.choices[0].token_ids = ["a"], [1]
    with caplog.at_level(logging.ERROR, logger="rose.worker.outbox"):
        outbox.refused(run)
        reset, tokens = sent(outbox, publisher)
        assert (reset["type"], reset["reason"]) == ("reset", "redis refused events")
        assert (tokens["seq"], tokens["token_ids"]) == (0, [1])
        assert not caplog.records
        outbox.refused(run)  # refused again: logged once, no new reset
        outbox.refused(run)
        assert sent(outbox, publisher) == []
    assert [r.getMessage() for r in caplog.records] == [
        "job j: Redis refuses its events again; it goes on without its stream"
    ]


class FullClock:
    """rose.worker.outbox's `time`, stepped by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def full(monkeypatch: pytest.MonkeyPatch) -> tuple[FullClock, StubPublisher, Outbox]:
    """An outbox without a stream interval on a stub publisher, its clock stepped by hand."""
    clock = FullClock()
    monkeypatch.setattr("rose.worker.outbox.time", clock)
    publisher = StubPublisher()
    return clock, publisher, Outbox(publisher, 500, stream_interval=0)


def test_a_stream_a_full_redis_refused_starts_over_once_redis_writes_a_later_batch_not_at_every_step(full):
    clock, publisher, outbox = full
    run = running()
    run.choices[0].text, run.choices[0].token_ids = ["a", "b"], [1, 2]
    outbox.token(run, "a", [1])
    outbox.token(run, "b", [2])
    assert len(sent(outbox, publisher)) == 2
    publisher.last_batch = publisher.settled = 1  # that batch, refused for memory (take_dropped)
    outbox.refused_for_memory(run)
    assert not outbox.delivered(run) and not outbox.idle and "j" in outbox.in_flight()
    for _ in range(20):  # steps while Redis is full: the new tokens wait in the job, nothing is sent
        run.choices[0].text.append("c")
        run.choices[0].token_ids.append(3)
        outbox.token(run, "c", [3])
        assert sent(outbox, publisher) == []
    clock.now += 0.1
    publisher.written = 2  # a later batch (another job's) written: Redis has room
    reset, tokens = sent(outbox, publisher)
    assert (reset["type"], reset["reason"]) == ("reset", "redis was full")
    assert (tokens["seq"], tokens["text"], tokens["token_ids"]) == (0, "ab" + "c" * 20, [1, 2] + [3] * 20)
    publisher.settled = 3
    assert outbox.delivered(run) and outbox.idle


def test_a_full_redis_is_asked_with_an_empty_batch_every_half_second_while_nothing_else_is_written(full):
    clock, publisher, outbox = full
    run = running()
    run.choices[0].text, run.choices[0].token_ids = ["a"], [1]
    outbox.refused_for_memory(run)
    clock.now += RETRY_FULL_S / 2
    assert sent(outbox, publisher) == [] and publisher.verified == 0
    outbox.wait(timeout=5)  # an idle loop sleeps until Redis is asked again, not longer
    assert clock.now == 1000.0 + RETRY_FULL_S
    assert sent(outbox, publisher) == [] and publisher.verified == 1  # asked, without the text so far
    assert sent(outbox, publisher) == [] and publisher.verified == 1  # once each half second
    publisher.written = 1  # the empty batch written: Redis has room
    reset, tokens = sent(outbox, publisher)
    assert reset["type"] == "reset" and tokens["text"] == "a"
    publisher.last_batch = 2
    outbox.refused_for_memory(run)  # refused again: asked again half a second on
    outbox.wait(timeout=0.1)
    assert clock.now == 1000.0 + RETRY_FULL_S + 0.1 and sent(outbox, publisher) == []
    # an end goes out at once, after the stream's restart
    outbox.terminal(run, CanceledEvent, reason="stopped")
    assert [e["type"] for e in sent(outbox, publisher)] == ["reset", "token", "canceled"]


def test_a_waiting_attempt_left_behind_holds_back_no_later_attempt_of_its_job(full):
    clock, publisher, outbox = full
    old = running()
    publisher.last_batch = 1
    # and the loop let it go without forgetting it (a bug: `forget` is the rule)
    outbox.refused_for_memory(old)
    new = running()  # the same job id, taken again
    new.choices[0].text, new.choices[0].token_ids = ["a"], [1]
    outbox.token(new, "a", [1])
    (event,) = sent(outbox, publisher)
    assert (event["seq"], event["text"]) == (0, "a")
    publisher.settled = 1
    assert outbox.delivered(new) and outbox.idle  # the earlier attempt is gone: it restarts nothing
    publisher.written = 2
    clock.now += 1
    assert sent(outbox, publisher) == []


def test_an_idle_loop_does_not_wait_for_the_next_ask_once_redis_wrote_a_later_batch(full):
    clock, publisher, outbox = full
    run = running()
    publisher.last_batch = 1
    outbox.refused_for_memory(run)
    publisher.written = 2
    outbox.wait(timeout=5)
    assert clock.now == 1000.0  # no sleep: the streams start over at this flush
    assert [e["type"] for e in sent(outbox, publisher)] == ["reset"]  # no tokens generated yet
