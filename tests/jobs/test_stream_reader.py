"""rose.jobs.stream_reader without Redis: the entries a reader's XRANGE and XREAD return, and what it yields of them
(the clients' tests, tests/jobs/test_client.py, read real streams through both clients)."""

from __future__ import annotations

import time

import pytest

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
    stored = [
        ("1-0", token(0, "old")),
        ("2-0", event('{"type":"reset","reason":"restart"}')),
        ("3-0", token(0, "a")),
    ]
    assert [e.text for e in cursor.stored(stored)] == ["a"]
    assert cursor.last_id == "3-0" and not cursor.ended
    later = cursor.read(
        [("rose:stream:j", [("4-0", token(1, "b")), ("5-0", DONE), ("6-0", token(9, "late"))])]
    )
    assert [e.type for e in later] == ["token", "done"]  # nothing after the terminal event
    assert cursor.ended and cursor.last_id == "6-0"


def test_quiet_reads_are_counted_until_an_event_and_time_out():
    cursor = Cursor("j", timeout=0.05)
    assert cursor.stored([]) == [] and cursor.last_id == "0"
    assert cursor.read(None) == [] and cursor.quiet() == 1
    assert cursor.read([]) == [] and cursor.quiet() == 2
    cursor.check_timeout()  # not yet
    assert len(cursor.read([("rose:stream:j", [("1-0", token(0, "a"))])])) == 1
    assert cursor.quiet_polls == 0 and cursor.quiet() == 1  # counted again from the event
    time.sleep(0.06)
    with pytest.raises(TimeoutError, match="no event from job j for 0.05 s"):
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
        deltas.delta(Cursor("j").read([("s", [("4-0", reset)])])[0])
    error = Cursor("j").read([("s", [("5-0", event('{"type":"error","seq":0,"message":"boom"}'))])])[0]
    with pytest.raises(JobFailed, match="boom"):
        TextDeltas("j").delta(error)
    canceled = Cursor("j").read([("s", [("6-0", event('{"type":"canceled","seq":0,"reason":"stopped"}'))])])[
        0
    ]
    with pytest.raises(JobCanceled, match="stopped"):
        TextDeltas("j").delta(canceled)
    assert TextDeltas("j").delta(Cursor("j").read([("s", [("7-0", reset)])])[0]) is None  # no text given yet
