import asyncio
import json
import zlib

import pytest
from rq import Queue, SimpleWorker
from rq.job import Job as RQJob
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from rose.jobs import keys
from rose.jobs.async_client import AsyncClient
from rose.jobs.client import Client, InvalidRequest, JobCanceled, JobFailed, StreamReset
from rose.jobs.events import (
    TOKEN_ENTRY_FIELDS,
    DoneEvent,
    ErrorEvent,
    ResetEvent,
    TokenEvent,
    Usage,
    token_entry,
)
from rose.jobs.schemas import ValidationError
from rose.jobs.stream_reader import reset_point


@pytest.fixture
def client(fake_r):
    return Client(fake_r, queue="rose")


def add(r, event, as_json: bool = False):
    """Store an event as a worker does: a token event as its entry's fields (`as_json`: its JSON, as a stream's repair
    and earlier workers store it), any other as its JSON."""
    if isinstance(event, TokenEvent) and not as_json:
        fields = dict(
            zip(TOKEN_ENTRY_FIELDS, token_entry(event.seq, event.text, event.token_ids), strict=True)
        )
    else:
        fields = {keys.STREAM_FIELD: event.to_json()}
    r.xadd(keys.stream_key(event.job_id), fields)


def done(job_id, seq):
    return DoneEvent(
        job_id=job_id, seq=seq, finish_reason="length", usage=Usage(prompt_tokens=1, completion_tokens=2)
    )


def test_submit_is_a_plain_json_rq_job(client, fake_r):
    job = client.submit(
        "Hello", max_tokens=8, temperature=0.5, metadata={"k": 1}, job_timeout=30, result_ttl=60
    )
    raw = RQJob.fetch(job.id, connection=fake_r, serializer=JSONSerializer)
    assert raw.func_name == "rose.jobs.generate"
    assert raw.args == []
    assert raw.kwargs == {"prompt": "Hello", "max_tokens": 8, "temperature": 0.5, "metadata": {"k": 1}}
    assert (raw.timeout, raw.result_ttl, raw.origin) == (30, 60, "rose")
    # zlib-compressed JSON [func, instance, args, kwargs] on the wire: readable from any language
    assert json.loads(zlib.decompress(fake_r.hget(raw.key, "data"))) == [
        "rose.jobs.generate",
        None,
        [],
        raw.kwargs,
    ]
    assert fake_r.lrange("rq:queue:rose", 0, -1) == [job.id.encode()]


def test_submit_token_ids_and_local_validation(client):
    job = client.submit([1, 2, 3], max_tokens=2)
    assert job.rq_job.kwargs == {"prompt_token_ids": [1, 2, 3], "max_tokens": 2}
    with pytest.raises(InvalidRequest, match="max_token"):
        client.submit("x", max_token=3)


def test_invalid_submit_says_what_the_worker_says_and_enqueues_nothing(client, fake_r):
    """A typo raises the worker's own message with the closest field, not pydantic's multi-line dump."""
    with pytest.raises(InvalidRequest) as info:
        client.submit("x", max_token=64)
    assert str(info.value) == (
        "invalid rose.jobs.generate arguments: unknown field 'max_token' (did you mean 'max_tokens'?)"
    )
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ValidationError)
    assert [e["loc"] for e in info.value.errors] == [("max_token",)]
    # an enqueue option's typo is suggested too; every problem is named, on one line
    with pytest.raises(InvalidRequest) as info:
        client.submit("x", job_timout=30, max_tokens="8")
    message = str(info.value)
    assert "unknown field 'job_timout' (did you mean 'job_timeout'?)" in message and "max_tokens: " in message
    assert "\n" not in message and "pydantic" not in message
    # submit_many validates every request before enqueueing any
    with pytest.raises(InvalidRequest, match="'temprature' \\(did you mean 'temperature'\\?\\)"):
        client.submit_many(["ok", {"prompt": "bad", "temprature": 0.5}])
    assert fake_r.llen("rq:queue:rose") == 0


def test_async_client_submit_raises_the_same(fake_r):
    async def go() -> None:
        client = AsyncClient.__new__(AsyncClient)
        client._sync = Client(fake_r, queue="rose")
        await client.submit("x", max_token=64)

    with pytest.raises(InvalidRequest, match="did you mean 'max_tokens'"):
        asyncio.run(go())
    assert fake_r.llen("rq:queue:rose") == 0


def test_submit_many(client, fake_r):
    jobs = client.submit_many(["a", {"prompt": "b", "max_tokens": 3, "job_id": "fixed"}], temperature=0.0)
    assert [j.id for j in jobs][1] == "fixed"
    assert fake_r.lrange("rq:queue:rose", 0, -1) == [j.id.encode() for j in jobs]
    assert jobs[1].rq_job.kwargs == {"prompt": "b", "max_tokens": 3, "temperature": 0.0}


def test_stream_reads_replay_and_ends_on_done(client, fake_r):
    job = client.submit("x")
    for i, t in enumerate(["He", "llo"]):
        add(fake_r, TokenEvent(job_id=job.id, seq=i, text=t, token_ids=[i]), as_json=i == 1)  # either form
    add(fake_r, done(job.id, 2))
    assert "".join(job.stream(timeout=5)) == "Hello"
    assert "".join(job.stream(timeout=5)) == "Hello"  # replayable, no duplicates


def test_the_last_reset_is_found_in_entries_read_as_bytes_or_decoded():
    token = dict(zip(TOKEN_ENTRY_FIELDS, map(str, token_entry(0, "a", [1])), strict=True))
    entries = [("1-0", token), ("2-0", {"event": '{"type":"reset","reason":"restart"}'}), ("3-0", token)]
    assert reset_point(entries) == 2  # a connection with decode_responses
    as_bytes = [(i, {k.encode(): v.encode() for k, v in f.items()}) for i, f in entries]
    assert reset_point(as_bytes) == 2


def test_late_reader_skips_superseded_attempts(client, fake_r):
    job = client.submit("x")
    add(fake_r, TokenEvent(job_id=job.id, seq=0, text="old", token_ids=[0]))
    add(fake_r, ResetEvent(job_id=job.id))
    add(fake_r, TokenEvent(job_id=job.id, seq=0, text="new", token_ids=[1]))
    add(fake_r, done(job.id, 1))
    assert list(job.stream(timeout=5)) == ["new"]
    assert [e.type for e in job.events(timeout=5)] == ["token", "done"]


def test_reset_mid_stream_raises(client, fake_r):
    job = client.submit("x")
    add(fake_r, TokenEvent(job_id=job.id, seq=0, text="old", token_ids=[0]))
    it = job.stream(timeout=5)
    assert next(it) == "old"
    add(fake_r, ResetEvent(job_id=job.id))
    with pytest.raises(StreamReset) as info:
        next(it)
    assert info.value.text == "old"


def test_stream_error_event_raises(client, fake_r):
    job = client.submit("x")
    add(fake_r, ErrorEvent(job_id=job.id, seq=0, message="prompt too long"))
    with pytest.raises(JobFailed, match="prompt too long"):
        list(job.stream(timeout=5))


def test_cancel_queued_job_never_starts_and_ends_its_stream(client, fake_r):
    job = client.submit("x")
    assert job.cancel() is True
    assert job.rq_job.get_status() == JobStatus.CANCELED
    assert fake_r.llen("rq:queue:rose") == 0
    with pytest.raises(JobCanceled):
        list(job.stream(timeout=5))
    with pytest.raises(JobCanceled):
        job.result(timeout=1)
    assert job.cancel() is False


def test_result_timeout(client):
    job = client.submit("x")
    with pytest.raises(TimeoutError):
        job.result(timeout=1)


def test_stock_rq_worker_fails_the_job_loudly(client, fake_r):
    """A stock `rq worker` that picks a rose job up must fail it with an explanation, not hang."""
    job = client.submit("x", max_tokens=2)
    SimpleWorker(
        [Queue("rose", connection=fake_r, serializer=JSONSerializer)],
        connection=fake_r,
        serializer=JSONSerializer,
    ).work(burst=True)
    assert job.rq_job.get_status() == JobStatus.FAILED
    with pytest.raises(JobFailed, match="must be run by the rose-worker daemon") as failed:
        job.result(timeout=1)
    # the requeue it suggests reads the job: rose's jobs need RQ's JSON serializer (-S json)
    assert "`rq requeue -S json --queue <queue> <job_id>`" in str(failed.value)


def test_stream_false_is_a_job_field_of_every_submit(client, fake_r):
    """`stream=False` (only the job's end is published) goes into the job's kwargs through GenerateRequest, from
    submit, chat and submit_many (common or per request), and its typo is named."""
    assert client.submit("x", stream=False).rq_job.kwargs == {"prompt": "x", "stream": False}
    messages = [{"role": "user", "content": "hi"}]
    assert client.chat(messages, stream=False).rq_job.kwargs == {"messages": messages, "stream": False}
    assert "stream" not in client.submit("x").rq_job.kwargs  # the default (true) is left to the worker
    many = client.submit_many(["a", {"prompt": "b", "stream": True}], stream=False)
    assert [job.rq_job.kwargs.get("stream") for job in many] == [False, True]  # the request's own field wins
    with pytest.raises(InvalidRequest, match="unknown field 'strem' \\(did you mean 'stream'\\?\\)"):
        client.submit("x", strem=False)
    with pytest.raises(InvalidRequest, match="stream: "):
        client.submit("x", stream="no")  # strict: a bool, not a string
    assert fake_r.llen("rq:queue:rose") == 5  # the refused two enqueued nothing


def test_async_client_passes_stream_false(fake_r):
    async def go() -> list[dict]:
        client = AsyncClient.__new__(AsyncClient)
        client._sync = Client(fake_r, queue="rose")
        one = await client.submit("x", stream=False)
        chat = await client.chat([{"role": "user", "content": "hi"}], stream=False)
        many = await client.submit_many(["a", "b"], stream=False)
        with pytest.raises(InvalidRequest, match="did you mean 'stream'"):
            await client.submit("x", strem=False)
        return [client._sync.job(job.id).rq_job.kwargs for job in (one, chat, *many)]

    assert [kwargs["stream"] for kwargs in asyncio.run(go())] == [False] * 4


def test_logit_bias_keys_come_as_ints_or_json_strings_and_survive_rq_json():
    from rose.jobs.schemas import GenerateRequest

    sent = {"prompt": "x", "logit_bias": {5: -100, "7": 2}, "allowed_token_ids": [5, 7, 9]}
    through_rq = JSONSerializer.loads(JSONSerializer.dumps(sent))  # int keys become strings, as in Redis
    for kwargs in (sent, through_rq):
        params = GenerateRequest(**kwargs).to_sampling_params()
        assert params.logit_bias == {5: -100.0, 7: 2.0} and params.allowed_token_ids == [5, 7, 9]
    with pytest.raises(ValidationError) as exc:
        GenerateRequest(prompt="x", logit_bias={"1": "x"})
    assert len(exc.value.errors()) == 1 and exc.value.errors()[0]["loc"] == ("logit_bias", "1")


def test_bad_words_are_a_job_field_of_plain_rq_kwargs(client, fake_r):
    from rose.jobs.schemas import GenerateRequest

    job = client.submit("x", bad_words=["foo", "bar baz", "foo"])
    kwargs = client.job(job.id).rq_job.kwargs
    assert kwargs["bad_words"] == ["foo", "bar baz", "foo"]
    assert GenerateRequest(**kwargs).to_sampling_params().bad_words == ["foo", "bar baz"]  # deduplicated
    for bad in ("foo", [""], ["ok\ud800"]):  # a str alone, an empty word, a lone surrogate
        with pytest.raises(InvalidRequest, match="bad_words"):
            client.submit("x", bad_words=bad)
    assert fake_r.llen("rq:queue:rose") == 1


def test_n_and_logprobs_are_job_fields_checked_before_anything_is_enqueued(client, fake_r):
    job = client.submit("x", n=4, logprobs=20, prompt_logprobs=0)
    kwargs = client.job(job.id).rq_job.kwargs
    assert (kwargs["n"], kwargs["logprobs"], kwargs["prompt_logprobs"]) == (4, 20, 0)
    for bad, why in (
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"logprobs": 21}, "logprobs must be <= 20"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be <= 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ):
        with pytest.raises(InvalidRequest, match=why):
            client.submit("x", **bad)
    assert fake_r.llen("rq:queue:rose") == 1
