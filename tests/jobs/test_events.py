import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rose.jobs import keys
from rose.jobs.events import (
    TOKEN_ENTRY_FIELDS,
    DoneEvent,
    ErrorEvent,
    ResetEvent,
    TokenEvent,
    Usage,
    entry_dict,
    parse_entry,
    parse_event,
    token_entry,
    token_event,
    token_event_json,
)


def test_keys():
    assert keys.tokens_channel("abc") == "rose:tokens:abc"
    assert keys.stream_key("abc") == "rose:stream:abc"
    assert keys.job_id_of_channel("rose:tokens:abc") == keys.job_id_of_channel(b"rose:tokens:abc") == "abc"
    assert keys.FUNC_PATH == "rose.jobs.generate"


def test_token_event_wire_format():
    data = json.loads(TokenEvent(job_id="j", seq=0, text="Hi", token_ids=[5]).to_json())
    assert data == {"type": "token", "seq": 0, "text": "Hi", "token_ids": [5]}  # the key names the job


def test_the_job_id_comes_from_the_key_and_an_event_that_carries_one_keeps_it():
    assert parse_event('{"type":"reset","reason":"restart"}', "j") == ResetEvent(job_id="j")
    older = '{"job_id":"k","type":"token","seq":0,"text":"a","token_ids":[1]}'  # as workers wrote it before
    assert (
        parse_event(older, "j")
        == parse_event(older)
        == TokenEvent(job_id="k", seq=0, text="a", token_ids=[1])
    )
    with pytest.raises(ValidationError, match="job_id"):
        parse_event('{"type":"reset","reason":"restart"}')


@given(
    job_id=st.text(min_size=1),
    seq=st.integers(min_value=0, max_value=2**40),
    text=st.text(),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31)),
)
def test_hot_path_token_json_is_the_models_json(job_id, seq, text, token_ids):
    fast = token_event_json(seq, text, token_ids)
    model = TokenEvent(job_id=job_id, seq=seq, text=text, token_ids=token_ids)
    assert json.loads(fast) == json.loads(model.to_json())
    assert parse_event(fast, job_id) == model


@given(
    logprobs=st.none() | st.lists(st.fixed_dictionaries({"token_id": st.integers(0, 9), "token": st.text()})),
    index=st.none() | st.integers(min_value=0, max_value=127),
)
def test_hot_path_token_json_with_logprobs_and_index(logprobs, index):
    fast = token_event_json(3, "t", [1], logprobs, index)
    model = TokenEvent(job_id="j", seq=3, text="t", token_ids=[1], logprobs=logprobs, index=index)
    assert json.loads(fast) == json.loads(model.to_json())
    assert ("logprobs" in json.loads(fast)) == (logprobs is not None)
    assert ("index" in json.loads(fast)) == (index is not None)
    assert parse_event(fast, "j") == model


def stored(values) -> dict[bytes, bytes]:
    """A stream entry as redis-py reads it back: each value's text, in bytes."""
    return {k.encode(): str(v).encode() for k, v in values.items()}


@given(
    seq=st.integers(min_value=0, max_value=2**40),
    text=st.text(),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**31)),
)
def test_a_token_event_stored_as_its_fields_reads_as_its_json(seq, text, token_ids):
    values = dict(zip(TOKEN_ENTRY_FIELDS, token_entry(seq, text, token_ids), strict=True))
    want = json.loads(token_event_json(seq, text, token_ids))
    # read back as bytes, or by a connection with decode_responses
    assert entry_dict(stored(values)) == entry_dict(values) == want
    assert parse_entry(stored(values), "j") == TokenEvent(job_id="j", seq=seq, text=text, token_ids=token_ids)


def test_the_worker_stores_a_token_event_as_fields_only_without_logprobs_or_index():
    assert token_event(2, "ab", [7, 8]) == (token_event_json(2, "ab", [7, 8]), token_entry(2, "ab", [7, 8]))
    assert token_event(2, "ab", [7], index=1) == (token_event_json(2, "ab", [7], index=1), None)
    logprobs = [{"token_id": 7, "logprob": -0.5}]
    assert token_event(2, "ab", [7], logprobs) == (token_event_json(2, "ab", [7], logprobs), None)


def test_an_entry_holding_json_reads_as_it_and_one_holding_neither_is_refused():
    done = '{"type":"done","seq":4,"finish_reason":"stop","usage":{"prompt_tokens":1,"completion_tokens":4}}'
    assert entry_dict({b"event": done.encode()}) == json.loads(done)
    assert parse_entry({b"event": done.encode()}, "j").type == "done"
    with pytest.raises(ValueError, match=r"neither an event nor a token's fields: \[b'seq', b'x'\]"):
        entry_dict({b"x": b"1", b"seq": b"2"})


@pytest.mark.parametrize(
    "event",
    [
        TokenEvent(job_id="j", seq=3, text="é", token_ids=[1, 2]),
        DoneEvent(job_id="j", seq=4, finish_reason="stop", usage=Usage(prompt_tokens=2, completion_tokens=4)),
        ErrorEvent(job_id="j", seq=0, message="bad"),
        ResetEvent(job_id="j"),
    ],
)
def test_round_trip(event):
    assert "job_id" not in json.loads(event.to_json())
    assert parse_event(event.to_json(), "j") == event


def test_unknown_type_rejected_and_extra_fields_kept():
    with pytest.raises(ValidationError):
        parse_event({"job_id": "j", "type": "bogus"})
    event = parse_event({"job_id": "j", "type": "reset", "attempt": 2})
    assert event.type == "reset"
