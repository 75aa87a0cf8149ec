"""Chat and constrained jobs through the real `rose-worker` (tiny-llama on CPU), enqueued by plain RQ producers:
chats rendered with the model's chat template, greedy text equal to `LLM.chat`; template problems and untrusted
per-job templates fail that job alone; JSON-schema / regex / choice jobs (`response_format`, `structured_outputs`)
give output that validates, greedy equal to the offline engine's, and an invalid constraint fails its job alone.
Two workers (default with --disable-any-whitespace, and --trust-request-chat-template) start once for the module,
in parallel."""

from __future__ import annotations

import copy
import json
import os
import re

import jsonschema
import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from rose.engine.engine import Engine
from rose.engine.llm import LLM
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams
from rose.harness.redis_server import RedisServerProcess
from rose.harness.worker_process import WorkerProcess, wait_for

pytestmark = pytest.mark.timeout(400)

MAX_MODEL_LEN = 256
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Redis of the module's own: the workers stay connected across tests, so nothing may flush it."""
    s = RedisServerProcess(directory=tmp_path_factory.mktemp("chat-redis"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def queues(server, tmp_path_factory):
    """{"default": Queue, "trusting": Queue}, each served by its own rose-worker process."""
    logs = tmp_path_factory.mktemp("chat-workers")
    common = ["--model", "tiny-llama", "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN)]
    procs = {
        kind: WorkerProcess(
            server.url,
            f"chat-{kind}-{os.getpid()}",
            [*common, "--queue", f"chat-{kind}", *extra],
            log_path=logs / f"{kind}.log",
        )
        for kind, extra in (
            ("default", ["--disable-any-whitespace"]),
            ("trusting", ["--trust-request-chat-template"]),
        )
    }
    try:
        for p in procs.values():
            p.wait_ready(180)
        r = server.client()
        yield {kind: Queue(f"chat-{kind}", connection=r, serializer=JSONSerializer) for kind in procs}
    finally:
        for p in procs.values():
            p.kill()


def ended(q: Queue, job_id: str) -> Job:
    wait_for(
        lambda: q.connection.hget(Job.key_for(job_id), "status") in (b"finished", b"failed"),
        150,
        interval=0.05,
        what=f"job {job_id} to end",
    )
    return Job.fetch(job_id, connection=q.connection, serializer=JSONSerializer)


def failure(job: Job) -> str:
    assert job.get_status() == "failed"
    return job.latest_result().exc_string


def test_a_plain_rq_chat_job_matches_llm_chat(queues):
    q = queues["default"]
    job = q.enqueue(
        "rose.jobs.generate", kwargs={"messages": CONVERSATION, "max_tokens": 8, "temperature": 0}
    )
    model, tok = build_preset("tiny-llama")
    llm = LLM(model, tok, device="cpu", max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    (expected,) = llm.chat(CONVERSATION, SamplingParams(max_tokens=8, temperature=0))
    done = ended(q, job.id)
    assert done.get_status() == "finished", failure(done)
    result = done.return_value()
    assert result["text"] == expected.text and result["token_ids"] == expected.token_ids
    assert result["finish_reason"] == expected.finish_reason
    # the rendered prompt's tokens are what is counted (BOS, role headers and all)
    assert (
        result["usage"]["prompt_tokens"]
        == len(expected.prompt_token_ids)
        > len(tok.encode("be brief hello world"))
    )


def test_a_per_job_template_fails_alone_on_a_default_worker(queues):
    q = queues["default"]
    bad = q.enqueue(
        "rose.jobs.generate",
        kwargs={"messages": CONVERSATION, "chat_template": NO_SYSTEM_TEMPLATE, "max_tokens": 4},
    )
    good = q.enqueue("rose.jobs.generate", kwargs={"messages": CONVERSATION, "max_tokens": 4})
    message = failure(ended(q, bad.id))
    assert "trust-request-chat-template" in message and "ROSE_TRUST_REQUEST_CHAT_TEMPLATE" in message
    assert ended(q, good.id).get_status() == "finished"


def test_a_template_that_rejects_a_role_fails_that_job_alone(queues):
    q = queues["trusting"]
    # enqueued together so they are taken in one batch
    with q.connection.pipeline() as pipe:
        jobs = q.enqueue_many(
            [
                Queue.prepare_data(
                    "rose.jobs.generate",
                    kwargs={"messages": msgs, "chat_template": NO_SYSTEM_TEMPLATE, "max_tokens": 4},
                )
                for msgs in (CONVERSATION, CONVERSATION[1:])
            ],
            pipeline=pipe,
        )
        pipe.execute()
    bad, good = (ended(q, j.id) for j in jobs)
    assert "System role not supported" in failure(bad)
    assert good.get_status() == "finished", failure(good)
    assert good.return_value()["usage"]["completion_tokens"] >= 1


def test_a_model_without_chat_template_fails_chat_jobs_with_the_reason(run_worker, q, r):
    # In-process RoseWorker over a real Engine whose tokenizer has no template (a second model process would cost
    # a start-up for one assertion); the job path (intake, _admit, failure) is the daemon's.
    model, tok = build_preset("tiny-llama")
    tok = copy.deepcopy(tok)
    tok.chat_template = None
    engine = Engine(model, tok, device="cpu", max_num_seqs=2, max_model_len=64)
    wt = run_worker(engine=engine)
    chat = q.enqueue("rose.jobs.generate", kwargs={"messages": CONVERSATION, "max_tokens": 2})
    plain = q.enqueue("rose.jobs.generate", kwargs={"prompt": "hello", "max_tokens": 2})
    message = failure(ended(q, chat.id))
    assert "tokenizer has no chat template" in message and "send a 'prompt'" in message
    assert ended(q, plain.id).get_status() == "finished"
    wt.stop()


SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["label", "score", "note"],
    "additionalProperties": False,
}


def enqueue_together(q: Queue, kwargs_list: list[dict]) -> list[Job]:
    with q.connection.pipeline() as pipe:
        jobs = q.enqueue_many(
            [Queue.prepare_data("rose.jobs.generate", kwargs=kw) for kw in kwargs_list], pipeline=pipe
        )
        pipe.execute()
    return jobs


def test_constrained_plain_rq_jobs_validate_and_match_the_engine(queues):
    q = queues["default"]
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    kwargs = [
        {"messages": CONVERSATION, "response_format": fmt, "max_tokens": 64, "temperature": 0},
        {"prompt": "classify", "response_format": fmt, "max_tokens": 64, "temperature": 1.0, "seed": 3},
        {"prompt": "phone", "structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}, "max_tokens": 16},
        {"prompt": "answer", "structured_outputs": {"choice": ["yes", "no", "maybe"]}, "max_tokens": 8},
        {"prompt": "free text", "max_tokens": 6, "temperature": 0},
    ]
    jobs = [ended(q, j.id) for j in enqueue_together(q, kwargs)]
    results = []
    for job in jobs:
        assert job.get_status() == "finished", failure(job)
        results.append(job.return_value())
    for result in results[:2]:
        assert result["finish_reason"] == "stop"
        jsonschema.validate(json.loads(result["text"]), SCHEMA)
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", results[2]["text"])
    assert results[3]["text"] in ("yes", "no", "maybe")

    # the worker's greedy constrained tokens are the offline engine's (same settings)
    model, tok = build_preset("tiny-llama")
    llm = LLM(
        model, tok, device="cpu", max_num_seqs=2, max_model_len=MAX_MODEL_LEN, disable_any_whitespace=True
    )
    params = SamplingParams(max_tokens=64, temperature=0, structured_outputs={"json": SCHEMA})
    (expected,) = llm.chat(CONVERSATION, params)
    assert results[0]["token_ids"] == expected.token_ids and results[0]["text"] == expected.text


def test_an_invalid_constraint_fails_its_job_alone(queues):
    q = queues["default"]
    bad_regex, bad_schema, good = enqueue_together(
        q,
        [
            {"prompt": "x", "structured_outputs": {"regex": "[a-"}, "max_tokens": 4},
            {
                "prompt": "x",
                "structured_outputs": {"json": {"type": "object", "required": 5}},
                "max_tokens": 4,
            },
            {"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}, "max_tokens": 4},
        ],
    )
    assert "structured_outputs.regex is invalid" in failure(ended(q, bad_regex.id))
    assert "structured_outputs.json is invalid" in failure(ended(q, bad_schema.id))
    done = ended(q, good.id)
    assert done.get_status() == "finished", failure(done)
    assert done.return_value()["text"] in ("a", "b")
