"""Jobs with `n` > 1 through the worker (a real Engine on tiny-llama, a real redis-server, plain RQ producers): the
result lists every choice (each the offline engine's, seed + index), its usage counts them all; the token events name
their choice (`index`) and each choice's events add up to it; Job.stream() gives the first choice's text; a stream
that lost its end is repaired choice by choice from the stored result."""

from __future__ import annotations

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import check_stream, enqueue, registered_rq_worker, stream_events, wait_status

from rose.engine.engine import Engine
from rose.engine.llm import LLM
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams
from rose.harness.job_audit import audit
from rose.jobs import keys
from rose.jobs.client import Client
from rose.worker import seal

pytestmark = pytest.mark.timeout(120)


def result_of(r, job) -> dict:
    return Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()


def by_choice(events: list[dict], n: int) -> list[tuple[str, list[int], list]]:
    tokens = [e for e in events if e["type"] == "token"]
    assert {e["index"] for e in tokens} <= set(range(n))
    return [
        (
            "".join(e["text"] for e in tokens if e["index"] == i),
            [t for e in tokens if e["index"] == i for t in e["token_ids"]],
            [x for e in tokens if e["index"] == i for x in e.get("logprobs", [])],
        )
        for i in range(n)
    ]


@pytest.fixture
def engine():
    model, tok = build_preset("tiny-llama")
    return Engine(model, tok, device="cpu", max_num_seqs=8, max_model_len=128, block_size=16)


def test_choices_are_stored_and_streamed_each_under_its_index(run_worker, r, q, engine):
    run_worker(engine=engine, stream_interval=0.02)
    prompt = "Write a short story about " * 4
    job = enqueue(q, prompt=prompt, n=3, max_tokens=10, seed=4, ignore_eos=True, logprobs=1)
    quiet = enqueue(q, prompt="x y z", n=2, max_tokens=3, stream=False)
    single = enqueue(q, prompt="one", max_tokens=2)
    for j in (job, quiet, single):
        wait_status(r, j, "finished", timeout=60)
    assert result_of(r, single)["choices"] is None
    assert all("index" not in e for e in check_stream(r, single.id, "done"))

    result = result_of(r, job)
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert result["usage"]["completion_tokens"] == 30
    assert (result["text"], result["token_ids"], result["logprobs"]) == (
        choices[0]["text"],
        choices[0]["token_ids"],
        choices[0]["logprobs"],
    )
    offline = LLM(engine.model, engine.tokenizer, device="cpu", max_model_len=128)  # the worker is idle now
    for i, c in enumerate(choices):
        [alone] = offline.generate(prompt, SamplingParams(max_tokens=10, seed=4 + i, ignore_eos=True))
        assert c["token_ids"] == alone.token_ids and c["text"] == alone.text
        assert [e["token_id"] for e in c["logprobs"]] == c["token_ids"]
    assert len({tuple(c["token_ids"]) for c in choices}) == 3

    events = check_stream(r, job.id, "done")
    assert events[-1]["usage"]["completion_tokens"] == 30
    streamed = by_choice(events, 3)
    assert streamed == [(c["text"], c["token_ids"], c["logprobs"]) for c in choices]
    assert "".join(Client(r).job(job.id).stream(timeout=5)) == choices[0]["text"]

    quiet_result = result_of(r, quiet)
    assert len(quiet_result["choices"]) == 2 and quiet_result["usage"]["completion_tokens"] == 6
    assert [e["type"] for e in check_stream(r, quiet.id, "done")] == ["done"]


def test_a_lost_end_is_repaired_choice_by_choice(run_worker, r, q, redis_server, engine):
    worker = run_worker(engine=engine, stream_interval=0)
    job = enqueue(q, prompt="tell me", n=2, max_tokens=4, seed=1, ignore_eos=True)
    wait_status(r, job, "finished", timeout=60)
    worker.stop()
    choices = result_of(r, job)["choices"]
    assert len(stream_events(r, job.id)) == 9  # a token event per choice per step, then done
    for entry_id, _ in r.xrange(keys.stream_key(job.id))[3:]:
        r.xdel(keys.stream_key(job.id), entry_id)
    rq = registered_rq_worker(redis_server, "repairer")
    try:
        assert seal.repair(r, rq, job.id, "ghost")
    finally:
        rq.connection.close()
    assert audit(r, job.id) == []
    events = stream_events(r, job.id)
    assert events[-1]["type"] == "done" and [e["seq"] for e in events] == list(range(len(events)))
    assert [(t, ids) for t, ids, _ in by_choice(events, 2)] == [(c["text"], c["token_ids"]) for c in choices]
