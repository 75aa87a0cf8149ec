"""A step error in a real Engine fails only the job that causes it; the rest of the full batch finishes right."""

from __future__ import annotations

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import enqueue, stream_events, wait_status

from rose.engine.engine import Engine
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams
from rose.jobs.client import Client, JobFailed

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["the cat sat", "one two three", "hello there", "a b c d"]


def poisoned_engine(model, tok, poison: str) -> Engine:
    """A real Engine whose sampler raises, before any request changes, whenever `poison` is in the batch: what an
    input that passes validation but breaks the sampler (top_k=2**63 did) looks like to the worker."""
    engine = Engine(model, tok, device="cpu", max_num_seqs=4, max_model_len=64)
    sample = engine.sampler

    def sampler(logits, seqs, check=None):
        if any(s.prompt == poison for s in seqs):
            raise ValueError("Overflow when unpacking long long")
        return sample(logits, seqs, check)

    engine.sampler = sampler
    return engine


def test_a_failing_request_in_a_full_batch_fails_alone(run_worker, r, q):
    model, tok = build_preset("tiny-gpt2")
    alone = Engine(model, tok, device="cpu", max_num_seqs=4, max_model_len=64)
    expected = {}
    for i, prompt in enumerate(PROMPTS[:3]):
        alone.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while alone.has_unfinished():
        for out in alone.step():
            if out.finished:
                expected[PROMPTS[int(out.request_id)]] = out.output.text
    # the bad job is the newest in a full batch (4 = max_num_seqs), as in the report that lost 20 good jobs
    good = [enqueue(q, prompt=p, max_tokens=8, temperature=0, ignore_eos=True) for p in PROMPTS[:3]]
    bad = enqueue(q, prompt="bad", max_tokens=8)
    run_worker(engine=poisoned_engine(model, tok, "bad"))
    wait_status(r, bad, "failed", timeout=60)
    with pytest.raises(JobFailed, match=r"engine error: ValueError\('Overflow when unpacking long long'\)"):
        Client(r).job(bad.id).result(timeout=1)
    for job, prompt in zip(good, PROMPTS, strict=False):
        wait_status(r, job, "finished", timeout=60)
        result = Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()
        assert result["text"] == expected[prompt]
        assert "".join(e["text"] for e in stream_events(r, job.id) if e["type"] == "token") == result["text"]
