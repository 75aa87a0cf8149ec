"""Tool calling through the worker (a real Engine on tiny-llama, a real redis-server, plain RQ producers): a
"required" and a named-function job store calls valid under their tools' schemas (finish_reason "tool_calls" and
"stop", as vLLM's); an "auto" job on the random model stores its text as content with no calls; the stored text is
the streamed text; a job naming an unknown tool fails with the reason; on a worker with no tool-call parser an
"auto" job fails saying to start it with --tool-call-parser, while forced calls still run."""

from __future__ import annotations

import json

import jsonschema
import pytest
from rq import Retry
from rq.job import Job
from rq.serializers import JSONSerializer
from worker_helpers import check_stream, enqueue, wait_status

from rose.engine.engine import Engine
from rose.engine.presets import build_preset

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}
DIGIT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "digit", "parameters": DIGIT}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def engine() -> Engine:
    model, tok = build_preset("tiny-llama")
    # the tools make a ~600-token prompt; one line of JSON, so that a random model's constrained output ends
    return Engine(model, tok, device="cpu", max_num_seqs=8, max_model_len=1024, disable_any_whitespace=True)


def close_array(tok) -> dict[str, float]:
    """A bias on the token "]": a random model's "required" array closes after its first call."""
    return {str(tok.convert_tokens_to_ids("]")): 100}


def result_of(r, job) -> dict:
    return Job.fetch(job.id, connection=r, serializer=JSONSerializer).return_value()


def failure_of(r, job) -> str:
    return Job.fetch(job.id, connection=r, serializer=JSONSerializer).latest_result().exc_string


def check_calls(result: dict) -> list[str]:
    """The names of the result's calls, each in OpenAI's form with arguments valid under its tool's schema."""
    assert result["tool_calls"], result
    for call in result["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    return [call["function"]["name"] for call in result["tool_calls"]]


def test_tool_jobs_on_the_real_engine(run_worker, r, q):
    eng = engine()
    worker = run_worker(engine=eng, stream_interval=0.02)
    assert worker.worker.jobs.tool_parser.name == "hermes"  # guessed from the preset's chat template
    common = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0}
    required = enqueue(
        q, **common, tool_choice="required", max_tokens=64, logit_bias=close_array(eng.tokenizer)
    )
    named = enqueue(q, **common, tool_choice=NAMED, max_tokens=32, stream=False)
    auto = enqueue(q, **common, max_tokens=8)
    none = enqueue(q, **common, tool_choice="none", max_tokens=4)
    plain = enqueue(q, messages=MESSAGES, max_tokens=4)
    unknown = enqueue(q, **common, tool_choice={"type": "function", "function": {"name": "nope"}})
    for job in (required, named, auto, none, plain):
        wait_status(r, job, "finished", timeout=120)
    wait_status(r, unknown, "failed", timeout=10)
    assert "tool_choice names an unknown tool 'nope': tools are digit, get_weather" in failure_of(r, unknown)

    result = result_of(r, required)
    assert result["finish_reason"] == "tool_calls" and result["content"] is None
    assert len(check_calls(result)) == 1
    # text stays the raw output, the one streamed: here the JSON array of calls
    events = check_stream(r, required.id, "done")
    assert "".join(e["text"] for e in events if e["type"] == "token") == result["text"]
    assert json.loads(result["text"])[0]["name"] == result["tool_calls"][0]["function"]["name"]
    assert events[-1]["finish_reason"] == "tool_calls"

    result = result_of(r, named)
    assert result["finish_reason"] == "stop" and result["content"] is None  # a named call stays "stop" (vLLM)
    assert check_calls(result) == ["get_weather"]
    assert json.loads(result["tool_calls"][0]["function"]["arguments"]) == json.loads(result["text"])

    result = result_of(r, auto)  # the random model writes no <tool_call>: all content
    assert result["tool_calls"] == [] and result["content"] == result["text"] and result["text"]
    assert result["finish_reason"] == "length"
    result = result_of(r, none)
    assert (result["tool_calls"], result["content"]) == ([], result["text"])
    result = result_of(r, plain)
    assert (result["tool_calls"], result["content"]) == (None, None)
    # the tools were in the prompt
    assert result_of(r, none)["usage"]["prompt_tokens"] > result["usage"]["prompt_tokens"] + 100


def test_a_worker_without_parser_fails_auto_jobs_with_the_reason(run_worker, r, q):
    run_worker(engine=engine(), tool_call_parser="none")
    auto = enqueue(q, messages=MESSAGES, tools=TOOLS, max_tokens=4, retry=Retry(max=2))
    named = enqueue(q, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=32, temperature=0)
    wait_status(r, auto, "failed", timeout=30)
    assert "start rose-worker with --tool-call-parser" in failure_of(r, auto)
    assert Job.fetch(auto.id, connection=r, serializer=JSONSerializer).retries_left == 2  # not retried
    wait_status(r, named, "finished", timeout=120)  # forced calls need no parser
    assert check_calls(result_of(r, named)) == ["get_weather"]
