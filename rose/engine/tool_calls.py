"""Tool calling (OpenAI's `tools` / `tool_choice`, as vLLM implements them): pure-Python building blocks.

* `check_tools(tools, tool_choice)` refuses a malformed request with a ValueError naming the problem.
* A named function or "required" forces calls: decode under `constraint_for`'s JSON schema (named: the function's
  `parameters`, so the text IS the arguments; "required": an array, minItems 1, of `{"name": <its enum>,
  "parameters": <its schema>}`, anyOf per tool; compile-check it with structured_check.check_constraint), then
  `parse_forced` the finished text. "auto": no constraint; `get_tool_parser(name).parse(text)` (vLLM's
  `--tool-call-parser` names; `guess_tool_parser` picks one from the chat template) extracts the calls the model
  wrote. "none": no constraint, no parsing. Model output never raises: what is not calls is content, no calls.
* Tools reach the prompt through the chat template (`apply_chat_template(..., tools=tools)`); templates write past
  calls' `function.arguments` with `| tojson`, so render `messages_for_template(messages)` (as vLLM does).

Special tokens. In Qwen2.5-Instruct (tests/data/tokenizers/qwen2.5-instruct) `<tool_call>` (151657) and
`</tool_call>` (151658) are single added tokens with `"special": false`: `skip_special_tokens=True`, the default,
keeps them (checked with `decode` and rose's IncrementalDetokenizer), so "hermes" needs no decoding change.
Llama 3.1's `<|python_tag|>` is special and dropped, but "llama3_json" parses the JSON without it. Mistral's
`[TOOL_CALLS]` is a special control token and "mistral" finds nothing without it: decode with
`skip_special_tokens=False` (vLLM's mistral parser forces that), as `ToolParser.skip_special_tokens` says.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_ALNUM = string.ascii_letters + string.digits
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_MODES = ("none", "auto", "required")
_NO_PARAMETERS = {"type": "object", "properties": {}}  # what vLLM decodes for a function without parameters
# what parsing model output that is not calls raises
_ERRORS = (ValueError, TypeError, KeyError, AttributeError, RecursionError)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI's function.arguments


@dataclass(frozen=True, slots=True)
class ParsedToolOutput:
    content: str | None  # the text that is not a call; None when there is none
    tool_calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class ToolParser:
    name: str  # vLLM's --tool-call-parser name
    parse: Callable[[str], ParsedToolOutput]
    skip_special_tokens: bool  # False: its call marker is a special token, decode without skipping them


def to_openai(tool_call: ToolCall) -> dict[str, Any]:
    """OpenAI's form of a call: {"id", "type": "function", "function": {"name", "arguments"}}."""
    function = {"name": tool_call.name, "arguments": tool_call.arguments}
    return {"id": tool_call.id, "type": "function", "function": function}


def new_tool_call_id(parser: str | None = None) -> str:
    """A new call id: "call_" and 24 random alphanumerics (OpenAI's shape); 9 alphanumerics for "mistral"."""
    prefix, length = ("", 9) if parser == "mistral" else ("call_", 24)
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))


def check_tools(tools: Any, tool_choice: Any = None) -> None:
    """Raise ValueError naming what is wrong with OpenAI-format `tools` / `tool_choice` (None: not given)."""
    names = set()
    if tools is not None:
        if not isinstance(tools, list | tuple) or not tools:
            raise ValueError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}")
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise ValueError(f"{where} must be an object {{'type': 'function', 'function': {{...}}}}")
            if tool.get("type") != "function":
                raise ValueError(f"{where}.type {tool.get('type')!r} is an unknown tool type: use 'function'")
            function = tool.get("function")
            if not isinstance(function, dict):
                raise ValueError(f"{where}.function must be an object with a 'name'")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}.function.name is missing")
            if not _NAME.fullmatch(name):
                raise ValueError(f"{where}.function.name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
            if name in names:
                raise ValueError(f"{where}.function.name {name!r} is a duplicate: tool names must be unique")
            names.add(name)
            for key, kind in (("description", str), ("strict", bool)):
                if function.get(key) is not None and not isinstance(function[key], kind):
                    raise ValueError(f"{where}.function.{key} must be a {kind.__name__}")
            params = function.get("parameters")
            if params is not None and (
                not isinstance(params, dict) or (params and params.get("type") != "object")
            ):
                got = params.get("type") if isinstance(params, dict) else type(params).__name__
                raise ValueError(
                    f"{where}.function.parameters must be a JSON Schema of type 'object', got {got!r}"
                )
    if tool_choice is None:
        return
    if tools is None:
        raise ValueError("'tool_choice' was given without 'tools'")
    name = _named(tool_choice)
    if name is not None and name not in names:
        raise ValueError(f"tool_choice names an unknown tool {name!r}: tools are {', '.join(sorted(names))}")


def _named(tool_choice: Any) -> str | None:
    """The function a tool_choice names, None for a mode; ValueError for anything else."""
    if tool_choice is None or tool_choice in _MODES:
        return None
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise ValueError(f"tool_choice.type must be 'function', got {tool_choice.get('type')!r}")
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]:
            return function["name"]
        raise ValueError("tool_choice.function.name is missing")
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
        f"got {tool_choice!r}"
    )


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in tools or ()}


def constraint_for(tools: Any, tool_choice: Any) -> dict[str, Any] | None:
    """The JSON schema a forced tool_choice decodes under (vLLM's `_get_json_schema_from_tool`); None for
    "auto" / "none" / no tools. A copy: the tools are not modified."""
    check_tools(tools, tool_choice)
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    functions = _functions(tools)
    name = _named(tool_choice)
    if name is not None:
        return copy.deepcopy(functions[name].get("parameters") or _NO_PARAMETERS)
    defs: dict[str, dict[str, Any]] = {}
    items = []
    for name, function in functions.items():
        params = copy.deepcopy(function.get("parameters") or _NO_PARAMETERS)
        for key in ("$defs", "definitions"):  # "#/$defs/X" refs resolve at the root: hoist them there
            if isinstance(params.get(key), dict):
                for def_name, schema in params.pop(key).items():
                    if defs.setdefault(key, {}).setdefault(def_name, schema) != schema:
                        raise ValueError(f"tools define {key}/{def_name} differently: 'required' needs one")
        properties = {"name": {"type": "string", "enum": [name]}, "parameters": params}
        items.append({"properties": properties, "required": ["name", "parameters"]})
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}, **defs}


def parse_forced(text: str, tools: Any, tool_choice: Any, *, parser: str | None = None) -> ParsedToolOutput:
    """The calls in an output decoded under `constraint_for(tools, tool_choice)` (named or "required"); ids in
    `parser`'s style. Text that is not such an output (cut short, say) is content with no calls."""
    check_tools(tools, tool_choice)
    name = _named(tool_choice)
    if name is None and tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not force calls: parse with get_tool_parser")
    functions = _functions(tools)
    try:
        value = json.loads(text)
        if name is not None:
            calls = [ToolCall(new_tool_call_id(parser), name, _arguments(value))]
        else:
            if not isinstance(value, list) or not value:
                raise ValueError("not a non-empty array")
            calls = []
            for item in value:
                if not isinstance(item, dict) or item.get("name") not in functions:
                    raise ValueError("not a call of one of the tools")
                calls.append(ToolCall(new_tool_call_id(parser), item["name"], _arguments(item["parameters"])))
    except _ERRORS:
        return ParsedToolOutput(text, [])
    return ParsedToolOutput(None, calls)


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` where an assistant message's tool_calls carry `function.arguments` as an object (JSON
    text that is not an object is left as it is): chat templates write arguments with `| tojson`."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_with_object_arguments(call) for call in calls]}
        out.append(message)
    return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            return call
        if isinstance(arguments, dict):
            return {**call, "function": {**function, "arguments": arguments}}
    return call


def _arguments(value: Any) -> str:
    """A call's arguments as JSON object text: an object, or a string holding one (as some models write)."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("arguments are not a JSON object")
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, parser: str, keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """One call from a decoded {"name", <keys[0]> or ...}; ValueError when `obj` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("not a call: no name")
    key = next((k for k in keys if k in obj), None)
    if key is None:
        raise ValueError("not a call: no arguments")
    return ToolCall(new_tool_call_id(parser), obj["name"], _arguments(obj[key]))


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _parse_hermes(text: str) -> ParsedToolOutput:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number; the last may be unclosed."""
    if "<tool_call>" not in text:
        return ParsedToolOutput(text, [])
    try:
        calls = [_call(json.loads(closed or open_), "hermes") for closed, open_ in _HERMES.findall(text)]
    except _ERRORS:
        return ParsedToolOutput(text, [])
    return ParsedToolOutput(_HERMES.sub("", text).strip() or None, calls)


_PYTHON_TAG = "<|python_tag|>"
_SEPARATOR, _SPACE = re.compile(r"\s*;\s*(?=\{)"), re.compile(r"\s*")


def _parse_llama3_json(text: str) -> ParsedToolOutput:
    """An optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` ("arguments" too), several
    separated by ';'. As vLLM, the first '{' starts the calls when there is no tag."""
    start = text.find(_PYTHON_TAG)
    pos = start + len(_PYTHON_TAG) if start >= 0 else text.find("{")
    if pos < 0:
        return ParsedToolOutput(text, [])
    start = pos if start < 0 else start
    decoder, calls = json.JSONDecoder(), []
    try:
        while True:
            pos = _SPACE.match(text, pos).end()
            obj, pos = decoder.raw_decode(text, pos)
            calls.append(_call(obj, "llama3_json", ("arguments", "parameters")))
            separator = _SEPARATOR.match(text, pos)
            if separator is None:
                break
            pos = separator.end()
    except _ERRORS:
        return ParsedToolOutput(text, [])
    return ParsedToolOutput((text[:start] + text[pos:]).strip() or None, calls)


_TOOL_CALLS = "[TOOL_CALLS]"
_ARRAY = re.compile(r"\[\s*\{.*\}\s*\]", re.DOTALL)


def _parse_mistral(text: str) -> ParsedToolOutput:
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B Instruct v0.3's format). As vLLM, an
    output with the marker that does not parse is content without the marker."""
    if _TOOL_CALLS not in text:
        return ParsedToolOutput(text, [])
    body = text.replace(_TOOL_CALLS, "").strip()
    try:
        try:
            value = json.loads(body)
        except ValueError:
            value = json.loads(_ARRAY.search(body).group(0))  # the array amid other text
        if not isinstance(value, list) or not value:
            raise ValueError("not a non-empty array")
        calls = [_call(obj, "mistral") for obj in value]
    except _ERRORS:
        return ParsedToolOutput(body, [])
    return ParsedToolOutput(text.split(_TOOL_CALLS)[0].strip() or None, calls)


_PARSERS = {
    "hermes": ToolParser("hermes", _parse_hermes, skip_special_tokens=True),
    "llama3_json": ToolParser("llama3_json", _parse_llama3_json, skip_special_tokens=True),
    "mistral": ToolParser("mistral", _parse_mistral, skip_special_tokens=False),
}
TOOL_PARSERS = tuple(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """The parser vLLM's `--tool-call-parser <name>` names; ValueError listing the known names."""
    try:
        return _PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tool parser {name!r}: known are {', '.join(TOOL_PARSERS)}") from None


def guess_tool_parser(chat_template: str | None) -> str | None:
    """The parser for a chat template's own call format, from its text; None when it shows none."""
    markers = (("<tool_call>", "hermes"), (_PYTHON_TAG, "llama3_json"), ("ipython", "llama3_json"))
    markers += ((_TOOL_CALLS, "mistral"),)
    text = chat_template if isinstance(chat_template, str) else ""
    return next((name for marker, name in markers if marker in text), None)
