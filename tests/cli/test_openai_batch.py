"""`rose batch` with files in OpenAI's Batch API format: the conversion of request lines (unit tests), and the
command as a user runs it against a real redis-server and rose-worker, its output read with the openai package's
own types."""

from __future__ import annotations

import collections
import json
import re
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from cli_helpers import interrupt_when
from openai.types import BatchError, Completion
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletion
from openai.types.chat import completion_create_params as chat_params
from openai.types.shared import ErrorObject

from rose import LLM, SamplingParams
from rose.cli.batch import parse_queue_for
from rose.cli.batch_files import Entry, PlainFormat, survey
from rose.cli.openai_batch import (
    CHAT_URL,
    COMPLETIONS_URL,
    OpenAIFormat,
    RequestError,
    detect_format,
    to_job_fields,
)
from rose.engine.presets import build_tokenizer
from rose.harness.job_audit import stream_events

pytestmark = pytest.mark.timeout(400)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
DIGIT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "digit", "parameters": DIGIT}},
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
]


def chat(custom_id: str = "c1", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT_URL,
        "body": {"model": "tiny", "messages": MESSAGES, **body},
    }


def completion(custom_id: str = "p1", prompt: Any = "Once upon a time", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETIONS_URL,
        "body": {"model": "tiny", "prompt": prompt, **body},
    }


# ---------------------------------------------------------------------------------------------------- conversion


def test_every_supported_chat_field_maps_to_its_job_field() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    fields, model = to_job_fields(
        chat(
            max_completion_tokens=7,
            temperature=0.5,
            top_p=0.9,
            stop=["\n", "END"],
            seed=3,
            n=1,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            logprobs=False,
            response_format=schema,
            metadata={"run": "a"},
            user="u",
            store=False,
            stream=False,
            top_logprobs=None,  # null = absent
            parallel_tool_calls=True,
            tools=TOOLS,
            tool_choice="auto",
            chat_template_kwargs={"x": 1},  # vLLM's extras
            top_k=5,
            ignore_eos=True,
            logit_bias={"50256": -100, "11": 2.5},
            allowed_token_ids=[11, 12],
            bad_words=["foo", "bar baz"],
        )
    )
    assert model == "tiny"
    assert fields == {
        "messages": MESSAGES,
        "n": 1,
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["\n", "END"],
        "seed": 3,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "response_format": schema,
        "metadata": {"run": "a"},
        "tools": TOOLS,
        "tool_choice": "auto",
        "chat_template_kwargs": {"x": 1},
        "top_k": 5,
        "ignore_eos": True,
        "logit_bias": {"50256": -100, "11": 2.5},
        "allowed_token_ids": [11, 12],
        "bad_words": ["foo", "bar baz"],
        "stream": False,
    }


@pytest.mark.parametrize(
    ("prompt", "job_field"),
    [
        ("Hello", {"prompt": "Hello"}),
        (["Hello"], {"prompt": "Hello"}),
        ([5, 6, 7], {"prompt_token_ids": [5, 6, 7]}),
        ([[5, 6, 7]], {"prompt_token_ids": [5, 6, 7]}),
    ],
)
def test_completions_prompt_forms(prompt: Any, job_field: dict[str, Any]) -> None:
    fields, _ = to_job_fields(completion(prompt=prompt, max_tokens=4, stop="x", best_of=1, echo=False))
    assert fields == {**job_field, "max_tokens": 4, "stop": "x"}


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
def test_several_prompts_in_one_request_are_refused(prompt: Any) -> None:
    with pytest.raises(RequestError, match="2 prompts") as exc:
        to_job_fields(completion(prompt=prompt))
    assert exc.value.param == "prompt"


def test_max_tokens_and_max_completion_tokens() -> None:
    assert to_job_fields(chat(max_tokens=5))[0]["max_tokens"] == 5
    assert to_job_fields(chat(max_completion_tokens=6))[0]["max_tokens"] == 6
    assert to_job_fields(chat(max_tokens=6, max_completion_tokens=6))[0]["max_tokens"] == 6
    with pytest.raises(RequestError, match="conflict"):
        to_job_fields(chat(max_tokens=5, max_completion_tokens=6))
    # neither: OpenAI's default (up to the context limit), unless the command line gives --max-tokens
    assert to_job_fields(chat())[0]["max_tokens"] is None
    assert "max_tokens" not in to_job_fields(chat(), {"max_tokens": 9})[0]


@pytest.mark.parametrize(
    ("line", "param"),
    [
        (chat(functions=[{"name": "f"}]), "functions"),  # the legacy form of tools
        (chat(function_call="auto"), "function_call"),
        (chat(audio={"voice": "alloy", "format": "mp3"}), "audio"),
        (chat(modalities=["text", "audio"]), "modalities"),
        (chat(reasoning_effort="low"), "reasoning_effort"),
        (chat(prediction={"type": "content", "content": "x"}), "prediction"),
        (chat(web_search_options={}), "web_search_options"),
        (chat(stream_options={"include_usage": True}), "stream_options"),  # without stream: true
        (chat(stream=False, stream_options={"include_usage": True}), "stream_options"),
        (chat(stream=True, stream_options={"include_obfuscation": True}), "stream_options"),
        (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
        (chat(stream=True, stream_options={"chunk_size": 4}), "stream_options"),
        (completion(stream=True, stream_options=["include_usage"]), "stream_options"),
        (chat(service_tier="flex"), "service_tier"),
        (chat(top_logprobs=2), "top_logprobs"),  # without logprobs: true
        (chat(logprobs=False, top_logprobs=0), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (chat(logprobs=1), "logprobs"),
        (chat(stream="true"), "stream"),
        (chat(stream=1), "stream"),
        (completion(stream=0), "stream"),
        (chat(detokenize=False), "detokenize"),  # a job field, but no vLLM extra: output would be empty
        (completion(logprobs=21), "logprobs"),
        (completion(logprobs=True), "logprobs"),
        (completion(logprobs=1.0), "logprobs"),
        (completion(echo=True), "echo"),
        (completion(best_of=2), "best_of"),
        (completion(suffix="x"), "suffix"),
        (completion(messages=MESSAGES), "messages"),  # wrong endpoint's field
        (chat(prompt="x"), "prompt"),
        (completion(chat_template_kwargs={}), "chat_template_kwargs"),
    ],
)
def test_each_unsupported_field_is_reported(line: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as exc:
        to_job_fields(line)
    assert exc.value.param == param and param in str(exc.value)


# what rose takes from OpenAI's request types; every other field of theirs must be refused, never dropped
ACCEPTED = {
    "messages": MESSAGES,
    "prompt": "x",
    "model": "tiny",
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "temperature": 0.0,
    "top_p": 0.5,
    "stop": "x",
    "seed": 1,
    "n": 1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "response_format": {"type": "json_object"},
    "metadata": {"k": "v"},
    "user": "u",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "store": True,
    "stream": False,
    "logprobs": False,
    "top_logprobs": 3,  # with logprobs: true (below)
    "echo": False,
    "best_of": 1,
    "parallel_tool_calls": False,
    "tools": TOOLS,
    "tool_choice": "auto",
    "logit_bias": {"7": -100},
}


# with stream: true (OpenAI's streaming request types), stream_options too
ACCEPTED_STREAMING = {**ACCEPTED, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(
    ("url", "params", "accepted"),
    [
        (CHAT_URL, chat_params.CompletionCreateParamsNonStreaming, ACCEPTED),
        (COMPLETIONS_URL, completion_params.CompletionCreateParamsNonStreaming, ACCEPTED),
        (CHAT_URL, chat_params.CompletionCreateParamsStreaming, ACCEPTED_STREAMING),
        (COMPLETIONS_URL, completion_params.CompletionCreateParamsStreaming, ACCEPTED_STREAMING),
    ],
)
def test_every_field_of_openais_request_types_is_taken_or_refused(
    url: str, params: type, accepted: dict[str, Any]
) -> None:
    base = chat() if url == CHAT_URL else completion()
    if accepted is ACCEPTED_STREAMING:
        base["body"]["stream"] = True
    for name in typing.get_type_hints(params):
        line = {**base, "body": {**base["body"], name: accepted.get(name, "some value")}}
        if name == "top_logprobs":
            line["body"]["logprobs"] = True
        if name in accepted:
            fields, _ = to_job_fields(line)
            assert fields, name
        else:
            with pytest.raises(RequestError) as exc:
                to_job_fields(line)
            assert exc.value.param == name


@pytest.mark.parametrize(
    ("body", "job_stream"),
    [
        ({}, None),  # absent: the command line decides (rose batch: false unless --stream)
        ({"stream": None}, None),  # null counts as absent
        ({"stream": False}, False),
        ({"stream": True}, True),
        ({"stream": True, "stream_options": {"include_usage": True}}, True),  # rose's done event has usage
        ({"stream": True, "stream_options": {"include_usage": False, "include_obfuscation": False}}, True),
        ({"stream": True, "stream_options": {"include_usage": None}}, True),
        ({"stream": True, "stream_options": {}}, True),
        ({"stream_options": None}, None),
    ],
)
def test_stream_maps_to_the_job_field(body: dict[str, Any], job_stream: bool | None) -> None:
    for line in (chat(**body), completion(**body)):
        fields, _ = to_job_fields(line)
        assert fields.get("stream", "absent") == ("absent" if job_stream is None else job_stream)
        # the line's own stream wins over the command line's default
        entry = OpenAIFormat().parse(1, json.dumps(line), {"stream": False})
        assert entry.error is None and entry.request == fields


def test_stream_errors_are_400_lines_naming_the_field() -> None:
    fmt = OpenAIFormat()
    for body, param, code, words in (
        ({"stream": "yes"}, "stream", "invalid_type", "'stream' must be true or false"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value", "only allowed when"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options",
            "unsupported_value",
            "include_obfuscation=true is not supported",
        ),
    ):
        entry = fmt.parse(1, json.dumps(chat(**body)), {"stream": False})
        assert entry.request is None and words in entry.error
        error = fmt.invalid_line(entry)["response"]["body"]["error"]
        assert (error["param"], error["code"]) == (param, code)
        assert ErrorObject.model_validate(error).param == param


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"method": "GET"}, "method"),
        ({"url": "/v1/embeddings"}, "url"),
        ({"url": "/v1/responses"}, "url"),
        ({"body": "x"}, "body"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_request_lines(change: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as exc:
        to_job_fields({**chat(), **change})
    assert exc.value.param == param
    line = chat()
    del line["body"]["model"]
    with pytest.raises(RequestError, match="'model' is required"):
        to_job_fields(line)


def test_a_bad_value_is_a_400_line_naming_the_field() -> None:
    fmt = OpenAIFormat()
    entry = fmt.parse(4, json.dumps(completion(prompt=[], temperature=-1.0)), {})
    assert entry.request is None and entry.error
    out = fmt.invalid_line(entry)
    assert out["custom_id"] == "p1" and out["error"] is None and out["id"].startswith("batch_req_")
    assert out["response"]["status_code"] == 400
    error = out["response"]["body"]["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == entry.error


@pytest.mark.parametrize(
    ("bias", "why"),
    [
        ({"1": 500}, r"logit_bias\[1\] must be a number in \[-100, 100\]"),
        ({"one": 5}, "'one' is no token id"),
    ],
)
def test_a_bad_logit_bias_is_a_400_line_naming_it(bias: dict[str, Any], why: str) -> None:
    entry = OpenAIFormat().parse(1, json.dumps(chat(logit_bias=bias)), {})
    assert entry.request is None and re.search(why, entry.error), entry.error


def test_output_lines_parse_with_openais_types() -> None:
    fmt = OpenAIFormat({"tiny": "q-tiny"})
    result = {
        "text": " blue",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 9, "completion_tokens": 2},
    }
    chat_entry = fmt.parse(1, json.dumps(chat(max_tokens=2)), {})
    assert chat_entry.queue == "q-tiny"
    line = fmt.result_line(chat_entry, "job1", result)
    assert line["id"] == "batch_req_job1" and line["custom_id"] == "c1" and line["error"] is None
    assert line["response"]["status_code"] == 200 and line["response"]["request_id"] == "job1"
    body = ChatCompletion.model_validate(line["response"]["body"])
    assert body.model == "tiny" and body.choices[0].message.content == " blue"
    assert body.choices[0].finish_reason == "length" and body.usage is not None
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (9, 2, 11)

    text_entry = fmt.parse(2, json.dumps(completion(max_tokens=2)), {})
    assert text_entry.queue == "q-tiny"
    done = Completion.model_validate(
        fmt.result_line(text_entry, "job2", {**result, "finish_reason": "stop"})["response"]["body"]
    )
    assert done.object == "text_completion" and done.choices[0].text == " blue"
    assert done.choices[0].finish_reason == "stop"

    failed = fmt.failed_line(text_entry, "job3", "RoseJobError: too long", "job_failed")
    assert failed["response"] is None and failed["error"] == {
        "code": "job_failed",
        "message": "RoseJobError: too long",
    }
    assert fmt.output_key(failed) == ('"p1"', True) and fmt.output_key(line) == ('"c1"', False)


@pytest.mark.parametrize(
    ("body", "param", "why"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "unknown tool"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"tools": [{"type": "retrieval"}]}, "tools", r"tools\[0\]\.type"),
        ({"tools": {"name": "f"}}, "tools", "valid list"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "without 'tools'"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "combined"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
             "properties": {"a": {"type": "bogus"}}}}}], "tool_choice": "required"},
            "tools",
            r"tools\[0\]\.function\.parameters is invalid",
        ),
    ],
)  # fmt: skip
def test_bad_tools_are_400_lines_naming_the_param(body: dict[str, Any], param: str, why: str) -> None:
    fmt = OpenAIFormat()
    entry = fmt.parse(1, json.dumps(chat(**{"tools": TOOLS, **body})), {})
    assert entry.request is None and re.search(why, entry.error), entry.error
    error = fmt.invalid_line(entry)["response"]["body"]["error"]
    assert ErrorObject.model_validate(error).param == param and error["code"] == "invalid_value"


def test_tool_call_output_lines_parse_with_openais_types() -> None:
    fmt = OpenAIFormat()
    entry = fmt.parse(1, json.dumps(chat(tools=TOOLS, tool_choice="required")), {})
    assert entry.request is not None and entry.request["tools"] == TOOLS
    call = {"id": "call_1", "type": "function", "function": {"name": "digit", "arguments": '{"a": 3}'}}
    usage = {"prompt_tokens": 9, "completion_tokens": 12}
    text = '[{"name": "digit", "parameters": {"a": 3}}]'
    result = {
        "text": text,
        "finish_reason": "tool_calls",
        "usage": usage,
        "tool_calls": [call],
        "content": None,
    }
    body = ChatCompletion.model_validate(fmt.result_line(entry, "job1", result)["response"]["body"])
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    function = choice.message.tool_calls[0].function
    assert (choice.message.tool_calls[0].id, function.name, json.loads(function.arguments)) == (
        "call_1",
        "digit",
        {"a": 3},
    )
    # no calls (tool_choice auto, the model wrote text): content is the text, no tool_calls
    result = {"text": "Blue.", "finish_reason": "stop", "usage": usage, "tool_calls": [], "content": "Blue."}
    body = ChatCompletion.model_validate(fmt.result_line(entry, "job2", result)["response"]["body"])
    assert body.choices[0].message.content == "Blue." and body.choices[0].message.tool_calls is None
    assert body.choices[0].finish_reason == "stop"
    # rose's own lines carry them as the result does, for a job with tools only
    plain = PlainFormat().result_line(Entry(1, "a"), "job3", result)
    assert (plain["tool_calls"], plain["content"], plain["text"]) == ([], "Blue.", "Blue.")
    no_tools = {"text": "Blue.", "finish_reason": "stop", "usage": usage, "tool_calls": None, "content": None}
    assert "tool_calls" not in PlainFormat().result_line(Entry(1, "a"), "job4", no_tools)


def test_logprobs_fields_map_to_the_jobs_logprobs() -> None:
    assert to_job_fields(chat(logprobs=True))[0]["logprobs"] == 0  # the chosen tokens' only
    assert to_job_fields(chat(logprobs=True, top_logprobs=5))[0]["logprobs"] == 5
    assert "logprobs" not in to_job_fields(chat(logprobs=False))[0]
    assert to_job_fields(completion(logprobs=3))[0]["logprobs"] == 3
    assert to_job_fields(completion(logprobs=0))[0]["logprobs"] == 0
    assert "logprobs" not in to_job_fields(completion(logprobs=False))[0]


def entry(token_id: int, raw: bytes, logprob: float, top: list[tuple[int, bytes, float]]) -> dict[str, Any]:
    def one(t: int, b: bytes, lp: float) -> dict[str, Any]:
        return {"token_id": t, "token": b.decode("utf-8", "replace"), "bytes": list(b), "logprob": lp}

    return {**one(token_id, raw, logprob), "top_logprobs": [one(*x) for x in top]}


@pytest.mark.parametrize("n", [0, 129, True, 2.5, "2"])
def test_a_bad_n_is_a_400_line_naming_it(n: Any) -> None:
    entry = OpenAIFormat().parse(1, json.dumps(chat(n=n)), {})
    assert entry.request is None and entry.context["param"] == "n", entry.error


def test_n_choices_in_openais_shapes() -> None:
    fmt = OpenAIFormat()
    choices = [
        {
            "index": i,
            "text": t,
            "token_ids": [i],
            "finish_reason": r,
            "logprobs": None,
            "tool_calls": None,
            "content": None,
        }
        for i, (t, r) in enumerate([(" a", "length"), (" b", "stop")])
    ]
    result = {**choices[0], "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "choices": choices}
    entry = fmt.parse(1, json.dumps(chat(n=2)), {})
    assert entry.request["n"] == 2
    body = ChatCompletion.model_validate(fmt.result_line(entry, "j", result)["response"]["body"])
    assert [(c.index, c.message.content, c.finish_reason) for c in body.choices] == [
        (0, " a", "length"),
        (1, " b", "stop"),
    ]
    assert body.usage.completion_tokens == 2
    text = Completion.model_validate(
        fmt.result_line(fmt.parse(2, json.dumps(completion(n=2)), {}), "k", result)["response"]["body"]
    )
    assert [c.text for c in text.choices] == [" a", " b"]


def test_logprobs_in_openais_shapes() -> None:
    """A result's entries become chat's logprobs.content and the completions' tokens / token_logprobs /
    top_logprobs / text_offset, and parse with openai's types; a token that is half a character keeps its bytes
    and the offsets count characters."""
    fmt = OpenAIFormat()
    euro = "€".encode()  # three bytes, here over two tokens
    entries = [
        entry(1, b" a", -0.5, [(1, b" a", -0.5), (2, b" b", -1.5)]),
        entry(3, euro[:2], -1.0, [(3, euro[:2], -1.0), (4, b"x", -2.0)]),
        entry(5, euro[2:], -0.25, [(5, euro[2:], -0.25), (6, b"y", -3.0)]),
        entry(7, b"!", -9999.0, []),
    ]
    result = {"text": " a€!", "finish_reason": "stop", "usage": {"prompt_tokens": 2, "completion_tokens": 4}}
    result["logprobs"] = entries
    line = fmt.result_line(fmt.parse(1, json.dumps(chat(logprobs=True, top_logprobs=2)), {}), "j1", result)
    body = ChatCompletion.model_validate(line["response"]["body"])
    content = body.choices[0].logprobs.content
    assert [c.logprob for c in content] == [-0.5, -1.0, -0.25, -9999.0]
    assert [c.bytes for c in content] == [list(b" a"), list(euro[:2]), list(euro[2:]), [33]]
    assert bytes(b for c in content for b in c.bytes).decode() == " a€!"
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [(" a", -0.5), (" b", -1.5)]
    assert content[3].top_logprobs == []

    line = fmt.result_line(fmt.parse(2, json.dumps(completion(logprobs=2)), {}), "j2", result)
    done = Completion.model_validate(line["response"]["body"])
    logprobs = done.choices[0].logprobs
    assert logprobs.tokens == [" a", "\ufffd", "\ufffd", "!"]
    assert logprobs.token_logprobs == [-0.5, -1.0, -0.25, -9999.0]
    assert logprobs.top_logprobs[0] == {" a": -0.5, " b": -1.5}
    assert logprobs.top_logprobs[3] == {"!": -9999.0}  # the chosen token, also when the top k holds none
    assert logprobs.text_offset == [0, 2, 2, 3]  # the euro sign starts at 2 and ends before 3

    plain = fmt.result_line(fmt.parse(3, json.dumps(chat()), {}), "j3", {**result, "logprobs": None})
    assert ChatCompletion.model_validate(plain["response"]["body"]).choices[0].logprobs is None


def test_prompt_logprobs_in_vllms_shape() -> None:
    """vLLM's extra `prompt_logprobs` becomes the job's field, and the result's entries its OpenAI server's shape:
    per prompt token None (the first) or {token id: {logprob, rank, decoded_token}} for the token and its top k; on
    the chat response, on each completions choice; both still parse with openai's types."""
    fmt = OpenAIFormat()
    assert to_job_fields(chat(prompt_logprobs=2))[0]["prompt_logprobs"] == 2
    assert to_job_fields(completion(prompt_logprobs=0))[0]["prompt_logprobs"] == 0
    for bad in (21, -1, True):
        parsed = fmt.parse(1, json.dumps(chat(prompt_logprobs=bad)), {})
        assert parsed.request is None and parsed.context["param"] == "prompt_logprobs", parsed.error
    second = {**entry(9, b" b", -2.5, [(8, b" a", -0.5), (9, b" b", -2.5)]), "rank": 2}
    third = {**entry(4, b"!", -7.0, [(8, b" a", -0.25)]), "rank": 30}
    result = {"text": "x", "finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    result["prompt_logprobs"] = [None, second, third]
    expected = [
        None,
        {
            "9": {"logprob": -2.5, "rank": 2, "decoded_token": " b"},
            "8": {"logprob": -0.5, "rank": 1, "decoded_token": " a"},
        },
        {
            "4": {"logprob": -7.0, "rank": 30, "decoded_token": "!"},
            "8": {"logprob": -0.25, "rank": 1, "decoded_token": " a"},
        },
    ]
    body = fmt.result_line(fmt.parse(1, json.dumps(chat(prompt_logprobs=1)), {}), "j1", result)["response"][
        "body"
    ]
    assert body["prompt_logprobs"] == expected and "prompt_logprobs" not in body["choices"][0]
    ChatCompletion.model_validate(body)
    body = fmt.result_line(fmt.parse(2, json.dumps(completion(prompt_logprobs=1)), {}), "j2", result)
    body = body["response"]["body"]
    assert body["choices"][0]["prompt_logprobs"] == expected and "prompt_logprobs" not in body
    Completion.model_validate(body)
    plain = PlainFormat().result_line(Entry(1, "a"), "j3", result)
    assert plain["prompt_logprobs"] == [None, second, third]
    assert "prompt_logprobs" not in PlainFormat().result_line(
        Entry(1, "a"), "j4", {**result, "prompt_logprobs": None}
    )


def test_the_format_is_detected_per_file(tmp_path: Path) -> None:
    plain, oai = tmp_path / "plain.jsonl", tmp_path / "oai.jsonl"
    plain.write_text('{"prompt": "x"}\n')
    oai.write_text("{not json\n" + json.dumps(chat()) + "\n")
    assert isinstance(detect_format(plain, {}), PlainFormat)
    assert isinstance(detect_format(oai, {}), OpenAIFormat)
    assert parse_queue_for(["a=q1", "org/m=x=q2"]) == {"a": "q1", "org/m=x": "q2"}
    with pytest.raises(ValueError, match="MODEL=QUEUE"):
        parse_queue_for(["no-queue"])
    assert isinstance(Entry(1, "x").context, dict)


def test_survey_lists_the_first_problems(tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [chat("a")] * 13)
    found = survey(inp, OpenAIFormat(), {})
    assert found.total == 13 and len(found.problems) == 11
    assert found.problems[0] == 'line 2: duplicate custom_id "a" (first on line 1)'
    assert found.problems[-1] == "... and 2 more"


# ------------------------------------------------------------------------------------ the command, end to end


def write_lines(path: Path, lines: list[Any]) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_file_with_repeated_custom_ids_is_refused_before_anything_runs(tmp_path, rose, cli_redis) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [chat("a"), chat("b"), completion("a"), "{not json", {"method": "POST"}, chat("b")])
    res = rose("batch", str(inp), "-o", str(out), "--queue", "obatch-refused")
    assert res.returncode == 2, res.stderr
    for problem in (
        'line 3: duplicate custom_id "a" (first on line 1)',
        "line 4: invalid JSON",
        "line 5: 'custom_id' (a non-empty string) is required",
        'line 6: duplicate custom_id "b" (first on line 2)',
    ):
        assert problem in res.stderr
    assert "nothing was run" in res.stderr
    assert not out.exists() and not (tmp_path / "out.jsonl.jobs").exists()
    assert not cli_redis.client().exists("rq:queue:obatch-refused")

    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "x"}\n')
    res = rose("batch", str(plain), "-o", str(out), "--queue-for", "m=q")
    assert res.returncode == 2 and "only for files in OpenAI's batch format" in res.stderr


JSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "digit",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


def check_success(line: dict[str, Any], model: str, max_tokens: int) -> ChatCompletion | Completion:
    assert line["error"] is None and line["id"] == f"batch_req_{line['response']['request_id']}"
    assert line["response"]["status_code"] == 200
    raw = line["response"]["body"]
    body = (
        ChatCompletion.model_validate(raw)
        if raw["object"] == "chat.completion"
        else Completion.model_validate(raw)
    )
    assert body.model == model and len(body.choices) == 1 and body.usage is not None
    assert body.choices[0].finish_reason == "length"  # --ignore-eos
    assert body.usage.completion_tokens == max_tokens
    assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
    return body


def check_logprobs(chat_line: dict[str, Any], text_line: dict[str, Any]) -> None:
    """The logprobs of a greedy chat line (top 3) and completions line (top 2, and its prompt's, top 1) are the
    engine's own: the values LLM gives for the same prompt on the same model, each chosen token the most likely
    one."""
    chat_body = check_success(chat_line, "tiny", 3)
    content = chat_body.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob and c.token == c.top_logprobs[0].token for c in content)
    assert bytes(b for c in content for b in c.bytes).decode() == chat_body.choices[0].message.content

    text_body = check_success(text_line, "tiny", 3)
    logprobs = text_body.choices[0].logprobs
    assert len(logprobs.tokens) == 3 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == text_body.choices[0].text
    offsets = [len("".join(logprobs.tokens[:i])) for i in range(3)]
    assert logprobs.text_offset == offsets
    llm = LLM("tiny-llama", device="cpu", max_model_len=256)
    [out] = llm.generate(
        "Once upon a time", SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    )
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in out.logprobs], abs=1e-4)
    assert [list(top.values()) for top in logprobs.top_logprobs] == [
        pytest.approx(list(lp.top.values()), abs=1e-4) for lp in out.logprobs
    ]
    # vLLM's prompt_logprobs on the completions choice: the engine's values for the prompt
    [scored] = llm.generate("Once upon a time", SamplingParams(max_tokens=1, prompt_logprobs=1))
    prompt = text_line["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert len(prompt) == len(scored.prompt_token_ids) and prompt[0] is None
    for got, lp in zip(prompt[1:], scored.prompt_logprobs[1:], strict=True):
        ids = [lp.token_id, *(t for t in lp.top if t != lp.token_id)]
        assert list(got) == [str(t) for t in ids] and got[str(lp.token_id)]["rank"] == lp.rank
        assert got[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)


CLOSE_ARRAY = str(build_tokenizer().convert_tokens_to_ids("]"))  # the preset's token "]"


def check_tool_calls(line: dict[str, Any]) -> None:
    """A tool_choice "required" line: its message is calls (no content), each valid under its tool's schema."""
    choice = ChatCompletion.model_validate(line["response"]["body"]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message
    assert choice.message.tool_calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def check_choices(line: dict[str, Any], n: int, max_tokens: int, kind: type) -> None:
    """An `n` line: n distinct choices in index order (seeded: choice i with seed + i), each max_tokens long
    (--ignore-eos), the usage counting them all; a chat line's logprobs per choice."""
    body = kind.model_validate(line["response"]["body"])
    assert [c.index for c in body.choices] == list(range(n))
    texts = [c.message.content if kind is ChatCompletion else c.text for c in body.choices]
    assert len(set(texts)) == n, texts
    assert body.usage.completion_tokens == n * max_tokens
    assert all(c.finish_reason == "length" for c in body.choices)
    if kind is ChatCompletion:
        for c in body.choices:
            assert len(c.logprobs.content) == max_tokens
            assert bytes(b for t in c.logprobs.content for b in t.bytes).decode() == c.message.content


def test_mixed_chat_and_completions_file_with_error_file_and_queue_routing(
    tmp_path, rose, cli_redis, cli_worker
) -> None:
    inp, out, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    lines = [
        chat("chat-1", max_tokens=3, temperature=0),
        chat("chat-2", model="tiny-b", max_completion_tokens=2, temperature=0),
        completion("text-1", max_tokens=4, temperature=0),
        completion("text-2", prompt=["Once upon a time"], max_tokens=4, temperature=0, model="tiny-b"),
        completion("ids-1", prompt=[5, 6, 7], max_tokens=2),
        chat("bad-tools", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        {**completion("bad-url"), "url": "/v1/embeddings"},
        completion("bad-value", temperature=-1.0),
        # runs, and fails in the worker: prompt + max_tokens exceed the worker's --max-model-len 4096
        completion("too-long", max_tokens=5000),
        # constrained: ends when its grammar does (finish_reason "stop", whatever --ignore-eos says)
        chat("json-1", max_tokens=32, temperature=0, response_format=JSON_FORMAT),
        chat("lp-chat", max_tokens=3, temperature=0, logprobs=True, top_logprobs=3),
        completion("lp-text", max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1),
        # calls decoded under the tools' schema; the bias on "]" closes the array after one call (a random model)
        chat(
            "tools-1",
            max_tokens=64,
            temperature=0,
            tools=TOOLS,
            tool_choice="required",
            logit_bias={CLOSE_ARRAY: 100},
        ),
        chat("n-chat", n=3, max_tokens=4, seed=5, logprobs=True),
        completion("n-text", n=2, max_tokens=3, seed=1),
    ]
    write_lines(inp, lines)
    args = ("batch", str(inp), "-o", str(out), "--error-file", str(errors), "--ignore-eos", "--no-progress")
    res = rose(*args, "--queue-for", "tiny-b=cli-routed")
    assert res.returncode == 1, res.stderr  # four lines failed
    assert "15 lines: 11 done, 4 failed" in res.stderr
    assert f"{inp}:6: tool_choice names an unknown tool 'nope'" in res.stderr

    good, bad = read(out), read(errors)
    assert collections.Counter(line["custom_id"] for line in good + bad) == collections.Counter(
        line["custom_id"] for line in lines
    )
    by_id = {line["custom_id"]: line for line in good}
    assert set(by_id) == {
        "chat-1", "chat-2", "text-1", "text-2", "ids-1", "json-1", "lp-chat", "lp-text", "tools-1", "n-chat",
        "n-text",
    }  # fmt: skip
    check_choices(by_id.pop("n-chat"), 3, 4, ChatCompletion)
    check_choices(by_id.pop("n-text"), 2, 3, Completion)
    check_tool_calls(by_id.pop("tools-1"))
    check_logprobs(by_id.pop("lp-chat"), by_id.pop("lp-text"))
    constrained = ChatCompletion.model_validate(by_id.pop("json-1")["response"]["body"])
    assert constrained.choices[0].finish_reason == "stop", constrained.choices[0].message.content
    jsonschema.validate(
        json.loads(constrained.choices[0].message.content), JSON_FORMAT["json_schema"]["schema"]
    )
    assert isinstance(check_success(by_id["chat-1"], "tiny", 3), ChatCompletion)
    assert isinstance(check_success(by_id["chat-2"], "tiny-b", 2), ChatCompletion)
    text_1 = check_success(by_id["text-1"], "tiny", 4)
    text_2 = check_success(by_id["text-2"], "tiny-b", 4)
    assert isinstance(text_1, Completion) and isinstance(text_2, Completion)
    assert text_1.choices[0].text == text_2.choices[0].text  # greedy, the same prompt in both forms
    ids_1 = check_success(by_id["ids-1"], "tiny", 2)
    assert ids_1.usage is not None and ids_1.usage.prompt_tokens == 3
    # chat lines went through the chat template: more prompt tokens than the bare message text alone
    chat_1 = ChatCompletion.model_validate(by_id["chat-1"]["response"]["body"])
    assert chat_1.usage is not None and chat_1.usage.prompt_tokens > 8

    # --queue-for: tiny-b's lines were enqueued on cli-routed, the others on the default queue
    conn = cli_redis.client()
    for custom_id, line in by_id.items():
        origin = conn.hget(f"rq:job:{line['response']['request_id']}", "origin").decode()
        assert origin == ("cli-routed" if custom_id in ("chat-2", "text-2") else "rose"), custom_id

    failed = {line["custom_id"]: line for line in bad}
    for custom_id, param in (("bad-tools", "tool_choice"), ("bad-url", "url"), ("bad-value", "temperature")):
        response = failed[custom_id]["response"]
        assert response["status_code"] == 400 and failed[custom_id]["error"] is None
        assert ErrorObject.model_validate(response["body"]["error"]).param == param
        assert response["body"]["error"]["type"] == "invalid_request_error"
        assert response["body"]["error"]["param"] == param
    assert failed["too-long"]["response"] is None
    assert BatchError.model_validate(failed["too-long"]["error"]).code == "job_failed"
    assert failed["too-long"]["error"]["code"] == "job_failed"
    assert "max_model_len" in failed["too-long"]["error"]["message"]

    again = rose(*args, "--queue-for", "tiny-b=cli-routed")  # nothing left to do
    assert again.returncode == 1 and "15 of 15 lines already in" in again.stderr
    assert (len(read(out)), len(read(errors))) == (11, 4)


def test_interrupted_then_resumed_without_duplicates(tmp_path, rose, cli_worker) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 80
    lines = [
        chat(f"c{i}", max_tokens=4) if i % 3 == 0 else completion(f"p{i}", prompt=f"Number {i}", max_tokens=4)
        for i in range(n)
    ]
    write_lines(inp, lines)
    args = ("batch", str(inp), "-o", str(out), "--ignore-eos", "--temperature", "0", "--chunk-size", "4")
    returncode, err = interrupt_when(
        (*args, "--max-in-flight", "4"), rose.env, lambda: len(read(out)) >= 12, "12 result lines"
    )
    first = read(out)
    left: dict[str, str] = {}  # custom_id -> job id of the jobs the first run left queued or running
    if returncode == 130:  # the usual case: stopped with jobs still running
        assert "interrupted" in err and (tmp_path / "out.jsonl.jobs").exists()
        assert len(first) < n
        written = {line["custom_id"] for line in first}
        left = {j["id"]: j["job_id"] for j in read(tmp_path / "out.jsonl.jobs") if j["id"] not in written}
        assert left
    else:  # the machine finished before the signal
        assert returncode == 0, err

    res = rose(*args, "--max-in-flight", "16")
    assert res.returncode == 0, res.stderr
    assert f"{len(first)} of {n} lines already in" in res.stderr
    output = read(out)
    assert collections.Counter(line["custom_id"] for line in output) == collections.Counter(
        line["custom_id"] for line in lines
    )
    for line in output:
        check_success(line, "tiny", 4)
        if line["custom_id"] in left:  # picked up, not submitted again
            assert line["response"]["request_id"] == left[line["custom_id"]]
    assert not (tmp_path / "out.jsonl.jobs").exists()


def test_error_file_with_rose_own_format(tmp_path, rose, cli_worker) -> None:
    inp, out, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    inp.write_text('{"id": "ok", "prompt": "x"}\n{"id": "bad", "prompt": "x", "temprature": 1}\n')
    args = ("batch", str(inp), "-o", str(out), "--error-file", str(errors), "--max-tokens", "2")
    assert rose(*args).returncode == 1
    assert [line["id"] for line in read(out)] == ["ok"] and "text" in read(out)[0]
    assert [line["id"] for line in read(errors)] == ["bad"] and "error" in read(errors)[0]
    again = rose(*args)
    assert again.returncode == 1 and "2 of 2 lines already in" in again.stderr
    assert "2 lines: 1 done, 1 failed" in again.stderr


def test_stream_true_lines_stream_their_tokens_and_keep_the_normal_output(
    tmp_path, rose, cli_redis, cli_worker
) -> None:
    """body.stream true: the job's tokens are published on Redis (stream_options.include_usage: the done event
    carries the usage); the output line is the usual non-streaming response. Lines without it publish only their
    end (rose batch's default); a bad stream or stream_options is a 400 line naming it."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(
        inp,
        [
            chat("live", max_tokens=4, stream=True, stream_options={"include_usage": True}),
            completion("quiet", max_tokens=4),
            completion("bad-stream", stream="yes"),
            chat("bad-options", stream=True, stream_options={"include_obfuscation": True}),
        ],
    )
    res = rose("batch", str(inp), "-o", str(out), "--ignore-eos", "--no-progress")
    assert res.returncode == 1, res.stderr  # the two bad lines
    by_id = {line["custom_id"]: line for line in read(out)}
    live = check_success(by_id["live"], "tiny", 4)
    assert isinstance(live, ChatCompletion)  # not chunks: the output line is the whole response
    assert isinstance(check_success(by_id["quiet"], "tiny", 4), Completion)
    conn = cli_redis.client()
    events = stream_events(conn, by_id["live"]["response"]["request_id"])
    assert [e["type"] for e in events][-1] == "done" and len(events) >= 2
    assert "".join(e["text"] for e in events[:-1]) == live.choices[0].message.content
    assert events[-1]["usage"]["completion_tokens"] == 4
    quiet = stream_events(conn, by_id["quiet"]["response"]["request_id"])
    assert [(e["type"], e["seq"]) for e in quiet] == [("done", 0)]
    for custom_id, param in (("bad-stream", "stream"), ("bad-options", "stream_options")):
        response = by_id[custom_id]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param


def test_user_is_the_jobs_tenant_over_the_command_lines() -> None:
    fmt = OpenAIFormat()
    for line in (chat(user="acme"), completion(user="acme")):
        entry = fmt.parse(1, json.dumps(line), {"tenant": "default-team"})
        assert entry.error is None and entry.request["tenant"] == "acme"
    entry = fmt.parse(1, json.dumps(chat()), {"tenant": "default-team"})
    assert (
        "tenant" not in entry.request
    )  # the command line's default applies (merged under the line's fields)
    for bad in (5, "  "):
        entry = fmt.parse(1, json.dumps(chat(user=bad)), {})
        assert entry.error.startswith("'user' must be a non-empty string (the job's tenant)")
        assert (entry.context["param"], entry.context["code"]) == ("user", "invalid_value")
