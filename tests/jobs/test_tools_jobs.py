"""Tool calling as job fields (rose.jobs.schemas: `tools`, `tool_choice`) and in results (rose.jobs.tools,
rose.jobs.contract.job_result): validation naming the problem, the constraint of a forced tool_choice, rendering,
the worker's parser setting, and the calls read out of a finished job's text."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from rose.config import WorkerSettings
from rose.engine.chat import ChatOptions, ChatTemplateError
from rose.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rose.engine.presets import build_tokenizer
from rose.engine.tool_calls import get_tool_parser, messages_for_template
from rose.jobs import contract, tools
from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error
from rose.worker.cli import load_settings

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def chat(**fields: Any) -> GenerateRequest:
    return GenerateRequest(messages=MESSAGES, **fields)


def refusal(**fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        GenerateRequest(**fields)
    return format_validation_error(info.value)


# ---- the job fields ---------------------------------------------------------------------------------------------


def test_tool_choice_defaults_and_constraints():
    auto = chat(tools=TOOLS)
    assert auto.effective_tool_choice == "auto" and not auto.forces_tool_calls
    assert auto.constraint() is None and auto.to_sampling_params().structured_outputs is None
    assert chat().effective_tool_choice == "none"
    assert chat(tools=TOOLS, tool_choice="none").constraint() is None

    named = chat(tools=TOOLS, tool_choice=NAMED).to_sampling_params().structured_outputs
    assert named is not None and named.json == WEATHER  # the function's parameters: the text IS the arguments
    required = chat(tools=TOOLS, tool_choice="required").to_sampling_params().structured_outputs
    assert required is not None and required.json["type"] == "array" and required.json["minItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in required.json["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    # auto / none keep the job's own constraint
    fmt = {"type": "json_object"}
    assert chat(tools=TOOLS, response_format=fmt).constraint().json_object


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "unknown tool 'nope'"),
        ({"tool_choice": "sometimes"}, "tool_choice must be 'none', 'auto', 'required'"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.function.name is missing"),
        ({"tools": []}, "'tools' must be a non-empty list"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type 'retrieval' is an unknown tool type"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name 'get_weather' is a duplicate"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name 'a b'"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters must be a JSON Schema of type 'object'",
        ),
        ({"tools": "get_weather"}, "tools: Input should be a valid list"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        (
            {"tool_choice": NAMED, "structured_outputs": {"regex": "a"}},
            "cannot be combined with 'structured_outputs'",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set ['tools']"),
        ({"chat_template_kwargs": {"tool_choice": "x"}}, "chat_template_kwargs may not set ['tool_choice']"),
    ],
)
def test_bad_tools_are_refused_with_the_reason(fields: dict[str, Any], reason: str):
    fields = {"messages": MESSAGES, "tools": TOOLS, **fields}
    assert reason in refusal(**fields)


def test_tools_need_messages_and_tool_choice_needs_tools():
    assert "tools only apply to 'messages' jobs" in refusal(prompt="x", tools=TOOLS)
    assert "tool_choice only apply to 'messages' jobs" in refusal(prompt="x", tool_choice="auto")
    assert "'tool_choice' was given without 'tools'" in refusal(messages=MESSAGES, tool_choice="required")


def test_a_tool_schema_that_will_not_compile_is_named():
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    broken = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": bad}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        assert "tools[1].function.parameters is invalid" in refusal(
            messages=MESSAGES, tools=broken, tool_choice=choice
        )
    not_a_schema = {"type": "object", "properties": {"a": {"type": "bogus"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": not_a_schema}}
    message = refusal(messages=MESSAGES, tools=[tool], tool_choice="required")
    assert "tools[0].function.parameters is invalid: not a valid JSON Schema" in message
    # "auto" and "none" compile nothing: the model writes its calls freely
    chat(tools=[tool])
    chat(tools=[tool], tool_choice="none")


def test_tools_are_rendered_by_the_chat_template():
    tok = build_tokenizer()
    past = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
            }
        ],
    }
    messages = [*MESSAGES, past, {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    for choice in ("auto", "none", "required", NAMED):
        prompt = GenerateRequest(messages=messages, tools=TOOLS, tool_choice=choice).engine_prompt(tok)[
            "prompt"
        ]
        expected = messages_for_template(messages)
        assert prompt == tok.apply_chat_template(
            expected, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        assert "# Tools" in prompt and json.dumps(TOOLS[0]) in prompt
        # past calls' arguments are rendered as the object they hold, not as a quoted string
        assert '{"name": "get_time", "arguments": {"tz": "UTC"}}' in prompt
    assert "# Tools" not in GenerateRequest(messages=MESSAGES).engine_prompt(tok)["prompt"]
    with pytest.raises(ChatTemplateError, match="tools"):
        ChatOptions(tools=[{"type": "function"}])


# ---- the worker's parser ----------------------------------------------------------------------------------------


def test_the_worker_setting_and_its_default():
    template = build_tokenizer().chat_template
    assert tools.resolve_parser(None, template).name == "hermes"  # the preset template's format
    assert tools.resolve_parser(None, "{{ messages }}") is None
    assert tools.resolve_parser(None, None) is None
    assert tools.resolve_parser("none", template) is None
    assert tools.resolve_parser("mistral", template).name == "mistral"
    assert WorkerSettings().tool_call_parser is None
    assert load_settings(["--tool-call-parser", "llama3_json"])[0].tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool-call parser 'openai'"):
        WorkerSettings(tool_call_parser="openai")


def test_the_env_variable(monkeypatch):
    monkeypatch.setenv("ROSE_TOOL_CALL_PARSER", "none")
    assert WorkerSettings().tool_call_parser == "none"


def test_an_auto_job_needs_a_parser():
    hermes = get_tool_parser("hermes")
    message = tools.missing_parser(chat(tools=TOOLS), None)
    assert message is not None and "--tool-call-parser" in message
    assert tools.missing_parser(chat(tools=TOOLS), hermes) is None
    for fields in ({"tools": TOOLS, "tool_choice": "required"}, {"tools": TOOLS, "tool_choice": "none"}, {}):
        assert tools.missing_parser(chat(**fields), None) is None


def test_special_tokens_are_kept_for_a_parser_whose_marker_is_one():
    mistral, hermes = get_tool_parser("mistral"), get_tool_parser("hermes")
    assert not tools.sampling_params(chat(tools=TOOLS), mistral).skip_special_tokens
    assert tools.sampling_params(chat(tools=TOOLS), hermes).skip_special_tokens
    assert tools.sampling_params(chat(tools=TOOLS, tool_choice="required"), mistral).skip_special_tokens
    assert tools.sampling_params(chat(), mistral).skip_special_tokens


def test_parse_refuses_an_auto_job_on_a_worker_without_parser():
    job = SimpleNamespace(
        func_name="rose.jobs.generate", args=(), kwargs={"messages": MESSAGES, "tools": TOOLS}
    )
    refused = contract.parse(job, "rose", ["rose"], False)  # type: ignore[arg-type]
    assert isinstance(refused, str) and "--tool-call-parser" in refused
    request = contract.parse(job, "rose", ["rose"], False, tool_parser=get_tool_parser("hermes"))  # type: ignore[arg-type]
    assert isinstance(request, GenerateRequest) and request.tools == TOOLS
    job.kwargs["tool_choice"] = {"type": "function", "function": {"name": "nope"}}
    refused = contract.parse(job, "rose", ["rose"], False)  # type: ignore[arg-type]
    assert isinstance(refused, str) and "tool_choice names an unknown tool 'nope'" in refused


# ---- the result -------------------------------------------------------------------------------------------------


def calls(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    for call in result["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result["tool_calls"]]


def test_auto_reads_the_calls_with_the_parser():
    hermes = get_tool_parser("hermes")
    result = tools.tool_result(chat(tools=TOOLS), HERMES, "stop", hermes)
    assert result["finish_reason"] == "tool_calls" and result["content"] == "Let me check."
    assert calls(result) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    only_calls = tools.tool_result(chat(tools=TOOLS), HERMES.removeprefix("Let me check.\n"), "stop", hermes)
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 2
    text = tools.tool_result(chat(tools=TOOLS), "Sunny, I think.", "length", hermes)
    assert text == {"content": "Sunny, I think.", "tool_calls": [], "finish_reason": "length"}
    broken = tools.tool_result(chat(tools=TOOLS), "<tool_call>\n{not json", "length", hermes)
    assert broken == {"content": "<tool_call>\n{not json", "tool_calls": [], "finish_reason": "length"}


def test_none_and_no_tools_parse_nothing():
    hermes = get_tool_parser("hermes")
    none = tools.tool_result(chat(tools=TOOLS, tool_choice="none"), HERMES, "stop", hermes)
    assert none == {"content": HERMES, "tool_calls": [], "finish_reason": "stop"}
    plain = tools.tool_result(chat(), HERMES, "stop", hermes)
    assert plain == {"content": None, "tool_calls": None, "finish_reason": "stop"}
    assert tools.tool_result(None, "x", "length", None)["tool_calls"] is None


def test_forced_calls():
    required = chat(tools=TOOLS, tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Lyon"}}, {"name": "get_time", "parameters": {}}]'
    result = tools.tool_result(required, text, "stop", None)
    assert result["finish_reason"] == "tool_calls" and result["content"] is None
    assert calls(result) == [("get_weather", {"city": "Lyon"}), ("get_time", {})]
    cut = tools.tool_result(required, text[:30], "length", None)  # cut short: content, no calls
    assert cut == {"content": text[:30], "tool_calls": [], "finish_reason": "length"}

    named = tools.tool_result(chat(tools=TOOLS, tool_choice=NAMED), '{"city": "Oslo"}', "stop", None)
    assert named["finish_reason"] == "stop" and named["content"] is None  # vLLM: a named call stays "stop"
    assert calls(named) == [("get_weather", {"city": "Oslo"})]
    ids = tools.tool_result(chat(tools=TOOLS, tool_choice=NAMED), "{}", "stop", get_tool_parser("mistral"))
    assert len(ids["tool_calls"][0]["id"]) == 9  # the parser's id style


def output(*texts: str, finish_reason: str = "stop") -> RequestOutput:
    """The engine's final output of a job with one choice per text."""
    choices = [CompletionOutput(i, text, [1, 2, 3], finish_reason) for i, text in enumerate(texts)]
    metrics = RequestMetrics(arrival_time=10.0, first_token_time=10.5, finished_time=11.0)
    return RequestOutput("r", None, [4, 5], choices, metrics)


def test_job_result_carries_the_calls_and_keeps_the_raw_text():
    job = SimpleNamespace(enqueued_at=None, started_at=None)
    hermes = get_tool_parser("hermes")
    result = contract.job_result(
        output(HERMES),
        job,  # type: ignore[arg-type]
        started_wall=10.0,
        worker="w",
        metadata=None,
        request=chat(tools=TOOLS),
        tool_parser=hermes,
    )
    assert result["text"] == HERMES  # what was streamed
    assert result["finish_reason"] == "tool_calls" and result["content"] == "Let me check."
    assert [c["function"]["name"] for c in result["tool_calls"]] == ["get_weather", "get_time"]
    plain = contract.job_result(
        output("hi", finish_reason="length"),
        job,  # type: ignore[arg-type]
        started_wall=10.0,
        worker="w",
        metadata=None,
    )
    assert (plain["tool_calls"], plain["content"], plain["finish_reason"]) == (None, None, "length")
    assert set(result) == set(contract.JobResult.__annotations__)
    # n > 1: each choice's calls are its own; the top-level fields are the first choice's
    two = contract.job_result(
        output("Sunny.", HERMES),
        job,  # type: ignore[arg-type]
        started_wall=10.0,
        worker="w",
        metadata=None,
        request=chat(tools=TOOLS, n=2),
        tool_parser=hermes,
    )
    first, second = two["choices"]
    assert (first["tool_calls"], first["content"], first["finish_reason"]) == ([], "Sunny.", "stop")
    assert second["finish_reason"] == "tool_calls" and len(second["tool_calls"]) == 2
    assert (two["tool_calls"], two["content"]) == ([], "Sunny.")


def test_contract_imports_no_torch():
    code = "import sys, rose.jobs.contract, rose.jobs.tools; print('torch' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert ran.stdout.strip() == "False"


def test_job_result_metrics_are_stored_to_the_microsecond():
    """The clocks' float noise is not stored: seconds to the microsecond, tokens a second to the thousandth."""
    out = output("hi")
    out.metrics.arrival_time, out.metrics.first_token_time, out.metrics.finished_time = (
        0.1,
        0.1 + 1 / 3,
        0.1 + 2 / 3,
    )
    job = SimpleNamespace(enqueued_at=None, started_at=None)
    result = contract.job_result(out, job, started_wall=0.0, worker="w", metadata=None)  # type: ignore[arg-type]
    assert result["metrics"] == {
        "queue_s": None,
        "ttft_s": 0.333333,
        "generation_s": 0.666667,
        "tokens_per_s": 4.5,
    }
