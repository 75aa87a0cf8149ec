"""Logprobs through the worker (a real Engine on tiny-llama, a real redis-server, plain RQ producers): a job with
`logprobs: k` stores one entry per token (its id, text, bytes, logprob, and the k most likely tokens), the values
the offline engine gives; a streamed job's token events carry the entries of their tokens, which add up to the
stored ones, also across coalesced events; a job that asks for more than the engine's max_logprobs fails with the
reason; a job without logprobs stores none and its events carry none. A job with `prompt_logprobs` (also of n
choices) stores its prompt's entries, the offline engine's values with their bytes and ranks."""

from __future__ import annotations

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import check_stream, enqueue, wait_status

from rose.engine.engine import Engine
from rose.engine.llm import LLM
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def result_of(r, job) -> dict:
    return Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()


def test_logprobs_are_stored_and_streamed_as_the_engine_gives_them(run_worker, r, q):
    model, tok = build_preset("tiny-llama")
    engine = Engine(model, tok, device="cpu", max_num_seqs=4, max_model_len=128)
    run_worker(engine=engine, stream_interval=0.02)
    streamed = enqueue(q, prompt="The label is", max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    quiet = enqueue(q, prompt="Another", max_tokens=4, temperature=0.8, seed=1, logprobs=0, stream=False)
    plain = enqueue(q, prompt="Plain", max_tokens=3)
    too_many = enqueue(q, prompt="x", max_tokens=3, logprobs=21)
    scored = enqueue(
        q, prompt="Score this text", max_tokens=2, temperature=0.5, seed=3, n=2, prompt_logprobs=2
    )
    too_many_prompt = enqueue(q, prompt="x", max_tokens=3, prompt_logprobs=21)
    for job in (streamed, quiet, plain, scored):
        wait_status(r, job, "finished", timeout=60)
    wait_status(r, too_many, "failed", timeout=10)
    failed = Job.fetch(too_many.id, connection=r, serializer=JSONSerializer)
    assert "logprobs must be <= 20" in failed.latest_result().exc_string
    wait_status(r, too_many_prompt, "failed", timeout=10)
    failed = Job.fetch(too_many_prompt.id, connection=r, serializer=JSONSerializer)
    assert "prompt_logprobs must be <= 20" in failed.latest_result().exc_string

    result = result_of(r, streamed)
    entries = result["logprobs"]
    assert [e["token_id"] for e in entries] == result["token_ids"] and len(entries) == 12
    for e in entries:
        assert len(e["top_logprobs"]) == 5
        assert (
            e["logprob"] == e["top_logprobs"][0]["logprob"]
            and e["token_id"] == e["top_logprobs"][0]["token_id"]
        )
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted(
            (t["logprob"] for t in e["top_logprobs"]), reverse=True
        )
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", "replace")
    # the preset's byte-level tokens: the bytes of the tokens are the text
    assert bytes(b for e in entries for b in e["bytes"]) == result["text"].encode()

    offline = LLM(model, tok, device="cpu", max_model_len=128)
    [out] = offline.generate(
        "The label is", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
    )
    assert out.token_ids == result["token_ids"]
    assert [e["logprob"] for e in entries] == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
    for e, lp in zip(entries, out.logprobs, strict=True):
        assert [t["token_id"] for t in e["top_logprobs"]] == list(lp.top)

    events = check_stream(r, streamed.id, "done")
    tokens = [e for e in events if e["type"] == "token"]
    assert len(tokens) < 12  # coalesced
    assert all(len(e["logprobs"]) == len(e["token_ids"]) for e in tokens)
    assert [x for e in tokens for x in e["logprobs"]] == entries

    quiet_result = result_of(r, quiet)
    assert [e["token_id"] for e in quiet_result["logprobs"]] == quiet_result["token_ids"]
    assert all(e["top_logprobs"] == [] for e in quiet_result["logprobs"])
    assert [e["type"] for e in check_stream(r, quiet.id, "done")] == ["done"]

    assert result_of(r, plain)["logprobs"] is None and result_of(r, plain)["prompt_logprobs"] is None
    assert result["prompt_logprobs"] is None

    scored_result = result_of(r, scored)
    assert len(scored_result["choices"]) == 2
    [expected] = offline.generate("Score this text", SamplingParams(max_tokens=1, prompt_logprobs=2))
    prompt_entries = scored_result["prompt_logprobs"]
    assert len(prompt_entries) == len(expected.prompt_token_ids) and prompt_entries[0] is None
    for e, lp, token in zip(
        prompt_entries[1:], expected.prompt_logprobs[1:], expected.prompt_token_ids[1:], strict=True
    ):
        assert e["token_id"] == lp.token_id == token and e["rank"] == lp.rank
        assert e["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert [t["token_id"] for t in e["top_logprobs"]] == list(lp.top)
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", "replace")
    # the byte-level tokens of the prompt after its first are the prompt's text after the first token
    assert (
        tok.decode(expected.prompt_token_ids[:1])
        + bytes(b for e in prompt_entries[1:] for b in e["bytes"]).decode()
        == "Score this text"
    )
    assert all("logprobs" not in e for e in check_stream(r, plain.id, "done"))
