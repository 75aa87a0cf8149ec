"""A job whose JSON-constrained output breaks its schema (the grammar backend let it through) is never stored as a
clean result: it fails with `invalid_structured_output: <what breaks it>; the output (...): <its text>`, its
subscribers get that error event, the metric counts it, and `rose batch` files its line under that code.

The worker runs a real engine over tiny-llama leaning toward raw control characters, which xgrammar 0.2.8 lets into
a string with `maxLength` (rose.engine.structured_check)."""

from __future__ import annotations

import json

import pytest
from test_metrics import scrape
from test_metrics import value as sample
from worker_helpers import check_stream, enqueue, wait_status

from rose.cli.batch_files import failure_code
from rose.engine.engine import Engine
from rose.engine.presets import build_preset, lean_toward
from rose.jobs.client import Client, JobFailed
from rose.jobs.schemas import INVALID_STRUCTURED_OUTPUT

SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 4}},
    "required": ["s"],
    "additionalProperties": False,
}


def control_leaning_engine() -> Engine:
    model, tokenizer = build_preset("tiny-llama")
    lean_toward(model, tokenizer, lambda t: len(t) == 1 and ord(t) < 0x20 and t not in " \t\n\r")
    return Engine(
        model,
        tokenizer,
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_model_len=160,
        structured_outputs_backend="xgrammar",  # the backend whose defect lets the output through
    )


@pytest.mark.timeout(120)
def test_an_invalid_output_fails_its_job_naming_the_violation_and_keeping_the_text(
    run_worker, r, q, redis_server
):
    bad = enqueue(
        q, prompt="Answer in JSON:", max_tokens=100, temperature=0, structured_outputs={"json": SCHEMA}
    )
    free = enqueue(q, prompt="Answer in JSON:", max_tokens=3, temperature=0)
    wt = run_worker(engine=control_leaning_engine(), metrics_port=0)

    wait_status(r, bad, "failed", timeout=60)
    wait_status(r, free, "finished", timeout=60)
    with pytest.raises(JobFailed) as failed:
        Client(redis_server.url, queue="rose").job(bad.id).result(timeout=5)
    stored = failed.value.message  # RQ's stored form: `RoseJobError: <message>`
    assert stored.startswith(
        f"RoseJobError: {INVALID_STRUCTURED_OUTPUT}: not strict JSON: Invalid control character"
    )
    message = stored.removeprefix("RoseJobError: ")
    text = json.loads(message.split("characters): ", 1)[1])  # the whole output, as JSON
    value = text.rsplit('"', 2)[1]
    assert (
        text.startswith("{") and text.endswith('"}') and len(value) == 4 and all(ord(c) < 0x20 for c in value)
    )
    assert failure_code(stored) == failure_code(message) == INVALID_STRUCTURED_OUTPUT
    assert failure_code("RoseJobError: engine error") == "job_failed"

    events = check_stream(r, bad.id, "error")
    assert events[-1]["message"] == message
    samples = scrape(wt.worker.metrics_server.port)
    assert sample(samples, "rose_structured_output_errors_total") == 1
    assert sample(samples, "rose_request_failure_total") == 1
    assert sample(samples, "rose_request_success_total", finished_reason="length") == 1
