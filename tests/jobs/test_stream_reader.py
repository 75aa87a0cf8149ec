"""rose.jobs.stream_reader without Redis: the entries a reader's XRANGE and XREAD return, and what it yields of them
(the clients' tests, tests/jobs/test_client.py, read real streams through both clients)."""

from __future__ import annotations

import pytest

from rose.jobs import stream_reader
from rose.jobs.errors import JobCanceled, JobFailed, StreamReset
from rose.jobs.events import TOKEN_ENTRY_FIELDS, token_entry
from rose.jobs.stream_reader import Cursor, TextDeltas


def token(seq: int, text: str) -> dict[str, str]:
    return dict(zip(TOKEN_ENTRY_FIELDS, map(str, token_entry(seq, text, [seq])), strict=True))


def event(json: str) -> dict[str, str]:
    return {"event": json}


DONE = event(
    '{"type":"done","seq":2,"finish_reason":"length","usage":{"prompt_tokens":1,"completion_tokens":2}}'
)


def test_a_cursor_yields_the_last_attempt_then_what_comes_after_and_stops_at_the_end():
    cursor = Cursor("j")
    reset = event('{"type":"reset","reason":"restart"}')
    stored = [("1-0", token(0, "old")), ("2-0", reset), ("3-0", token(0, "a"))]
    assert [e.text for e in cursor.stored(stored)] == ["a"]
    assert cursor.last_id == "3-0" and not cursor.ended
    later = cursor.read(
        [("rose:stream:j", [("4-0", token(1, "b")), ("5-0", DONE), ("6-0", token(9, "late"))])]
    )
    assert [e.type for e in later] == ["token", "done"]  # nothing after the terminal event
    assert cursor.ended and cursor.last_id == "6-0"


def test_events_are_parsed_as_they_are_taken():
    cursor = Cursor("j")
    events = cursor.read([("s", [("1-0", token(0, "a")), ("2-0", {"event": "not json"})])])
    assert next(events).text == "a"  # the entry after it is not read yet
    with pytest.raises(ValueError):
        next(events)


def test_quiet_reads_are_counted_and_time_out_from_when_the_last_events_were_taken(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stream_reader.time, "monotonic", lambda: now[0])
    cursor = Cursor("j", timeout=5)
    assert list(cursor.stored([])) == [] and cursor.last_id == "0"
    assert cursor.read(None) is None and cursor.read([]) is None and cursor.quiet_polls == 2
    now[0] = 104.0
    cursor.check_timeout()  # 4 s without an event: not yet
    events = cursor.read([("rose:stream:j", [("1-0", token(0, "a"))])])
    assert next(events).text == "a"
    now[0] = 108.0  # the caller spends 4 s on the event
    assert list(events) == [] and cursor.quiet_polls == 0
    assert cursor.read(None) is None and cursor.quiet_polls == 1
    now[0] = 112.0
    cursor.check_timeout()  # 4 s since the event was taken
    now[0] = 113.5
    with pytest.raises(TimeoutError, match="no event from job j for 5 s"):
        cursor.check_timeout()
    Cursor("j").check_timeout()  # no timeout: never


def test_text_deltas_are_the_first_choices_and_an_end_other_than_done_raises():
    cursor = Cursor("j")
    deltas = TextDeltas("j")
    reset = event('{"type":"reset","reason":"restart"}')
    first = cursor.stored(
        [
            ("1-0", reset),
            ("2-0", token(0, "He")),
            ("3-0", event('{"type":"token","seq":1,"text":"x","token_ids":[5],"index":1}')),
        ]
    )
    assert [deltas.delta(e) for e in first] == ["He", None]
    with pytest.raises(StreamReset, match="drop the 2 characters received"):
        deltas.delta(next(Cursor("j").read([("s", [("4-0", reset)])])))
    error = next(Cursor("j").read([("s", [("5-0", event('{"type":"error","seq":0,"message":"boom"}'))])]))
    with pytest.raises(JobFailed, match="boom"):
        TextDeltas("j").delta(error)
    canceled_entry = ("6-0", event('{"type":"canceled","seq":0,"reason":"stopped"}'))
    canceled = next(Cursor("j").read([("s", [canceled_entry])]))
    with pytest.raises(JobCanceled, match="stopped"):
        TextDeltas("j").delta(canceled)
    no_text = next(Cursor("j").read([("s", [("7-0", reset)])]))
    assert TextDeltas("j").delta(no_text) is None  # no text given yet
