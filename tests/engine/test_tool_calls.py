"""Tool calling building blocks (rose.engine.tool_calls): OpenAI `tools` / `tool_choice` checks, the constraint a
forced choice decodes under, vLLM's parsers for `auto` outputs, and tools rendered by real and preset templates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from real_tokenizers import load_tokenizer

from rose.engine.chat import render_chat
from rose.engine.presets import CHAT_TEMPLATE
from rose.engine.structured_check import check_constraint, violation
from rose.engine.structured_outputs import StructuredOutputsParams
from rose.engine.tool_calls import (
    TOOL_PARSERS,
    ParsedToolOutput,
    ToolCall,
    check_tools,
    constraint_for,
    get_tool_parser,
    guess_tool_parser,
    messages_for_template,
    new_tool_call_id,
    parse_forced,
    to_openai,
)

OPENAI_ID = re.compile(r"call_[A-Za-z0-9]{24}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def calls(parsed: ParsedToolOutput) -> list[tuple[str, dict]]:
    """The calls as (name, decoded arguments), ids checked and left out."""
    for call in parsed.tool_calls:
        assert OPENAI_ID.fullmatch(call.id) or MISTRAL_ID.fullmatch(call.id), call.id
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


# ----------------------------------------------------------------------------------------------- types and ids


def test_to_openai_and_ids():
    call = ToolCall(new_tool_call_id(), "get_weather", '{"city": "Paris"}')
    assert OPENAI_ID.fullmatch(call.id)
    assert MISTRAL_ID.fullmatch(new_tool_call_id("mistral"))
    assert len({new_tool_call_id() for _ in range(50)}) == 50
    assert to_openai(call) == {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    with pytest.raises(AttributeError):
        call.name = "other"  # frozen


# ----------------------------------------------------------------------------------------------- check_tools


def test_valid_requests_pass():
    check_tools(None, None)
    for choice in (None, "none", "auto", "required", named("get_time")):
        check_tools(TOOLS, choice)
    check_tools([{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}])


@pytest.mark.parametrize(
    ("tools", "tool_choice", "match"),
    [
        ([], None, "non-empty list"),
        ({"type": "function"}, None, "non-empty list"),
        (["get_weather"], None, r"tools\[0\] must be an object"),
        ([{"type": "web_search"}], None, r"tools\[0\].type 'web_search' is an unknown tool type"),
        ([{"type": "function"}], None, r"tools\[0\].function must be an object"),
        (
            [{"type": "function", "function": {"description": "x"}}],
            None,
            r"tools\[0\].function.name is missing",
        ),
        ([{"type": "function", "function": {"name": "get weather"}}], None, "1 to 64 letters"),
        ([WEATHER, TIME, WEATHER], None, r"tools\[2\].function.name 'get_weather' is a duplicate"),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            None,
            "description must be a str",
        ),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, "strict must be a bool"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            "parameters must be a JSON Schema of type 'object', got 'string'",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": ["city"]}}],
            None,
            "parameters must be a JSON Schema of type 'object', got 'list'",
        ),
        (TOOLS, named("get_news"), "unknown tool 'get_news': tools are get_time, get_weather"),
        (TOOLS, "any", "tool_choice must be 'none', 'auto', 'required' or"),
        (TOOLS, {"type": "custom", "custom": {"name": "x"}}, "tool_choice.type must be 'function'"),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name is missing"),
        (None, "auto", "'tool_choice' was given without 'tools'"),
        (None, named("get_time"), "without 'tools'"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(tools, tool_choice, match):
    with pytest.raises(ValueError, match=match):
        check_tools(tools, tool_choice)


# ----------------------------------------------------------------------------------------------- constraints


def test_constraint_shapes():
    assert constraint_for(TOOLS, "auto") is None
    assert constraint_for(TOOLS, "none") is None
    assert constraint_for(TOOLS, None) is None
    assert constraint_for(None, None) is None
    assert constraint_for(TOOLS, named("get_weather")) == WEATHER["function"]["parameters"]
    assert constraint_for(TOOLS, named("get_time")) == {"type": "object", "properties": {}}
    required = constraint_for(TOOLS, "required")
    assert required["type"] == "array" and required["minItems"] == 1
    assert required["items"]["type"] == "object"
    assert required["items"]["anyOf"] == [
        {
            "properties": {
                "name": {"type": "string", "enum": ["get_weather"]},
                "parameters": WEATHER["function"]["parameters"],
            },
            "required": ["name", "parameters"],
        },
        {
            "properties": {
                "name": {"type": "string", "enum": ["get_time"]},
                "parameters": {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
        },
    ]
    with pytest.raises(ValueError, match="unknown tool"):
        constraint_for(TOOLS, named("nope"))


def test_required_constraint_accepts_calls_and_rejects_a_wrong_name():
    schema = constraint_for(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    validator.validate(
        [
            {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
            {"name": "get_time", "parameters": {}},
        ]
    )
    for wrong in (
        [{"name": "get_news", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"unit": "celsius"}}],  # city is required
        [{"name": "get_weather"}],
        [],
        {"name": "get_time", "parameters": {}},
    ):
        assert not validator.is_valid(wrong), wrong


def test_defs_are_hoisted_to_the_root_and_tools_are_not_modified():
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    with_defs = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Point"}},
                "required": ["to"],
                "$defs": {"Point": point},
            },
        },
    }
    before = json.dumps(with_defs)
    schema = constraint_for([with_defs, TIME], "required")
    assert json.dumps(with_defs) == before
    assert schema["$defs"] == {"Point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "move", "parameters": {"to": {"x": 1}}}])
    assert not validator.is_valid([{"name": "move", "parameters": {"to": {"y": 1}}}])
    other = json.loads(before)
    other["function"]["name"] = "jump"
    other["function"]["parameters"]["$defs"]["Point"] = {"type": "string"}
    with pytest.raises(ValueError, match=r"\$defs/Point differently"):
        constraint_for([with_defs, other], "required")


@pytest.mark.parametrize("tool_choice", ["required", named("get_weather"), named("get_time")])
def test_constraints_compile_with_the_grammar_backend(tool_choice):
    schema = constraint_for(TOOLS, tool_choice)
    check_constraint(StructuredOutputsParams(json=schema), "tools")


def test_parse_forced():
    named_out = parse_forced('{ "city" : "Paris" }', TOOLS, named("get_weather"))
    assert named_out.content is None
    assert [(c.name, c.arguments) for c in named_out.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert OPENAI_ID.fullmatch(named_out.tool_calls[0].id)

    text = (
        '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, {"name": "get_time", "parameters": {}}]'
    )
    assert violation(StructuredOutputsParams(json=constraint_for(TOOLS, "required")), text) is None
    required = parse_forced(text, TOOLS, "required")
    assert required.content is None
    assert [(c.name, c.arguments) for c in required.tool_calls] == [
        ("get_weather", '{"city": "Zürich"}'),  # ensure_ascii=False, as vLLM
        ("get_time", "{}"),
    ]
    assert all(
        MISTRAL_ID.fullmatch(c.id) for c in parse_forced(text, TOOLS, "required", parser="mistral").tool_calls
    )

    # output that is not such calls (cut short by max_tokens, say) stays content
    for bad, choice in [
        ('{"city": "Par', named("get_weather")),
        ("[1, 2]", named("get_weather")),
        ('[{"name": "get_news", "parameters": {}}]', "required"),
        ('[{"name": "get_time"}]', "required"),
        ("[]", "required"),
        ('[{"name": "get_time", "parameters": {}}', "required"),
    ]:
        assert parse_forced(bad, TOOLS, choice) == ParsedToolOutput(bad, [])
    with pytest.raises(ValueError, match="does not force calls"):
        parse_forced("{}", TOOLS, "auto")


# ----------------------------------------------------------------------------------------------- parsers


def test_parser_registry():
    assert TOOL_PARSERS == ("hermes", "llama3_json", "mistral")
    for name in TOOL_PARSERS:
        assert get_tool_parser(name).name == name
    assert get_tool_parser("mistral").skip_special_tokens is False
    assert get_tool_parser("hermes").skip_special_tokens is True
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'.*hermes, llama3_json, mistral"):
        get_tool_parser("qwen")


HERMES_CASES = [
    # (output, content, calls)
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon", "unit": "celsius"})],
    ),
    (
        'Let me check both.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check both.",
        [("get_time", {})],
    ),
    (  # arguments given as a JSON string
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (  # cut before the closing tag (max_tokens): the open call still parses, as vLLM's
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        None,
        [("get_weather", {"city": "Rome"})],
    ),
]
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut short
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_weather"}\n</tool_call>',  # no arguments
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # a string, not JSON
    "<tool_call>\n</tool_call>",
    "<tool_call>" + "[" * 100_000,  # deeper than json's recursion limit
]


@pytest.mark.parametrize(("output", "content", "expected"), HERMES_CASES)
def test_hermes(output, content, expected):
    parsed = get_tool_parser("hermes").parse(output)
    assert parsed.content == content and calls(parsed) == expected


@pytest.mark.parametrize("output", HERMES_MALFORMED)
def test_malformed_hermes_output_is_content(output):
    assert get_tool_parser("hermes").parse(output) == ParsedToolOutput(output, [])


def test_hermes_keeps_unicode_and_content_around_calls():
    output = (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\nDone.'
    )
    parsed = get_tool_parser("hermes").parse(output)
    assert parsed.content == "Sure.\n\nDone."
    assert parsed.tool_calls[0].arguments == '{"city": "Zürich"}'


@pytest.mark.parametrize(
    ("output", "content", "expected"),
    [
        ("Paris is sunny today.", "Paris is sunny today.", []),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '{"name": "get_weather", "arguments": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {}};{"name": "get_weather", "parameters": {"city": "Lyon"}}',
            None,
            [("get_weather", {"city": "Paris"}), ("get_time", {}), ("get_weather", {"city": "Lyon"})],
        ),
        (  # nested objects and a ';' inside a string
            '{"name": "get_weather", "parameters": {"city": "a;b", "where": {"lat": {"deg": 1}}}}',
            None,
            [("get_weather", {"city": "a;b", "where": {"lat": {"deg": 1}}})],
        ),
        (  # arguments given as a JSON string
            '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            'I will look it up. <|python_tag|>{"name": "get_time", "parameters": {}}',
            "I will look it up.",
            [("get_time", {})],
        ),
    ],
)
def test_llama3_json(output, content, expected):
    parsed = get_tool_parser("llama3_json").parse(output)
    assert parsed.content == content and calls(parsed) == expected


@pytest.mark.parametrize(
    "output",
    [
        '{"name": "get_weather", "parameters": {"city": "Paris"}',  # cut short
        'The JSON is {"a": 1}.',  # an object, not a call
        '<|python_tag|>brave_search.call(query="weather")',  # a built-in tool's python call
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": 3, "parameters": {}}',
    ],
)
def test_malformed_llama3_json_output_is_content(output):
    assert get_tool_parser("llama3_json").parse(output) == ParsedToolOutput(output, [])


@pytest.mark.parametrize(
    ("output", "content", "expected"),
    [
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {}}]',
            None,
            [("get_weather", {"city": "Paris"}), ("get_time", {})],
        ),
        (
            'Checking.[TOOL_CALLS][{"name": "get_time", "arguments": "{}"}]',
            "Checking.",
            [("get_time", {})],
        ),
        (  # the array amid other text
            '[TOOL_CALLS][{"name": "get_time", "arguments": {}}] trailing',
            None,
            [("get_time", {})],
        ),
    ],
)
def test_mistral(output, content, expected):
    parsed = get_tool_parser("mistral").parse(output)
    assert parsed.content == content and calls(parsed) == expected
    assert all(MISTRAL_ID.fullmatch(call.id) for call in parsed.tool_calls)


def test_malformed_mistral_output_is_content_without_the_marker():
    for output in (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
        '[TOOL_CALLS]{"name": "get_weather", "arguments": {}}',  # not an array
        '[TOOL_CALLS][{"name": "get_weather"}]',
    ):
        parsed = get_tool_parser("mistral").parse(output)
        assert parsed == ParsedToolOutput(output.replace("[TOOL_CALLS]", ""), [])


def test_guess_tool_parser():
    assert guess_tool_parser(None) is None
    assert guess_tool_parser("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert guess_tool_parser("... <tool_call>\n{{ tool_call.name }} ...") == "hermes"
    assert guess_tool_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert guess_tool_parser("{%- elif message.role == 'ipython' %}") == "llama3_json"
    assert guess_tool_parser("{{- '[TOOL_CALLS] [' }}") == "mistral"
    assert guess_tool_parser(CHAT_TEMPLATE) == "hermes"


def test_messages_for_template_parses_json_arguments():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        ],
    }
    user = {"role": "user", "content": "hi"}
    out = messages_for_template([user, message])
    assert out[0] is user
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the input is not modified


# ----------------------------------------------------------------------------------------------- templates

CONVERSATION = [
    {"role": "system", "content": "You are the queue worker."},
    {"role": "user", "content": "What is the weather in Paris and in Lyon?"},
]
ASSISTANT_CALLS = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "call_b",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
        },
    ],
}
TOOL_RESULTS = [
    {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "call_b", "content": '{"sky": "rain"}'},
]


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("qwen2.5-instruct")


def test_qwen_template_renders_the_tools(qwen):
    prompt = qwen.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are the queue worker.\n\n# Tools\n")
    for tool in TOOLS:
        assert "\n" + json.dumps(tool, ensure_ascii=False) + "\n" in prompt
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    plain = qwen.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert "# Tools" not in plain
    assert guess_tool_parser(qwen.chat_template) == "hermes"


def test_qwen_round_trip(qwen):
    """What the template teaches (and writes for past calls) is what "hermes" parses, through the real token ids:
    <tool_call> is one added token that decoding with skip_special_tokens=True keeps."""
    start, end = qwen.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert not qwen.added_tokens_decoder[start].special and not qwen.added_tokens_decoder[end].special
    output = (
        "I will look both up.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
    )
    ids = qwen.encode(output + "<|im_end|>", add_special_tokens=False)
    assert ids.count(start) == 2 and ids.count(end) == 2
    decoded = qwen.decode(ids, skip_special_tokens=True)
    assert decoded == output
    parsed = get_tool_parser("hermes").parse(decoded)
    assert parsed.content == "I will look both up."
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]

    # the calls, sent back in OpenAI's form with their results, render as the template writes past calls
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [to_openai(c) for c in parsed.tool_calls],
    }
    messages = messages_for_template([*CONVERSATION, assistant, *TOOL_RESULTS])
    rendered = render_chat(qwen, messages)  # rose's own path; the tools do not change how past turns render
    prompt = qwen.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    expected_turns = (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n"
        '{"sky": "sunny"}\n</tool_response>\n<tool_response>\n{"sky": "rain"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert prompt.endswith(expected_turns) and rendered.prompt.endswith(expected_turns)
    # without messages_for_template, Qwen's `| tojson` would write OpenAI's JSON text as a quoted string
    raw = qwen.apply_chat_template([*CONVERSATION, ASSISTANT_CALLS], tokenize=False)
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"' in raw


def test_preset_template_with_tools(tokenizer):
    prompt = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|bos|><|system|>\nYou are the queue worker.\n\n# Tools\n")
    assert prompt.count("<|system|>") == 1  # the system message joins the tools turn
    for tool in TOOLS:
        assert "\n" + json.dumps(tool) + "\n" in prompt
    assert prompt.endswith(
        "<|user|>\nWhat is the weather in Paris and in Lyon?<|endoftext|>\n<|assistant|>\n"
    )
    no_system = tokenizer.apply_chat_template(CONVERSATION[1:], tools=TOOLS, tokenize=False)
    assert no_system.startswith("<|bos|><|system|>\n# Tools\n")

    # past calls (arguments as OpenAI's JSON text or as an object) and tool results, through rose's render_chat
    assistant = json.loads(json.dumps(ASSISTANT_CALLS))
    assistant["content"] = "Looking."
    assistant["tool_calls"][1]["function"]["arguments"] = {"city": "Lyon"}
    messages = [*CONVERSATION, assistant, *TOOL_RESULTS]
    rendered = render_chat(tokenizer, messages).prompt
    assert rendered.endswith(
        "<|assistant|>\nLooking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|endoftext|>\n'
        '<|tool|>\n{"sky": "sunny"}<|endoftext|>\n<|tool|>\n{"sky": "rain"}<|endoftext|>\n<|assistant|>\n'
    )
    # what the template writes for past calls is what "hermes" reads back
    turn = rendered.split("<|assistant|>\n")[1].split("<|endoftext|>")[0]
    parsed = get_tool_parser("hermes").parse(turn)
    assert parsed.content == "Looking."
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]


def test_preset_template_without_tools_is_unchanged(tokenizer):
    """The rendering the template had before it learned tools, for messages without tools or tool_calls."""
    old = (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
        "{% if not (loop.last and continue_final_message) %}{{ eos_token + '\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    )
    conversations = [
        CONVERSATION,
        [*CONVERSATION, {"role": "assistant", "content": "It is"}],
        [{"role": "developer", "content": "d"}, {"role": "user", "content": "é {{ x }}"}, *TOOL_RESULTS],
        [{"role": "user", "content": ""}],
    ]
    for messages in conversations:
        for options in ({"add_generation_prompt": True}, {}, {"continue_final_message": True}):
            new = tokenizer.apply_chat_template(messages, tokenize=False, **options)
            assert new == tokenizer.apply_chat_template(
                messages, chat_template=old, tokenize=False, **options
            )
