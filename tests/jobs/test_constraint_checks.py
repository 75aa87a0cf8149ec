"""A constraint the worker's grammar engine would refuse is refused where the job is made (GenerateRequest: Client,
AsyncClient, rose submit, rose batch and the worker's intake all validate with it), naming the field the user sent:
a JSON Schema invalid under its metaschema, a schema / regex / grammar the default backend (llguidance) cannot
compile, an unsupported keyword named."""

from __future__ import annotations

import json
import re

import pytest

from rose.cli.openai_batch import CHAT_URL, OpenAIFormat
from rose.jobs.client import Client, InvalidRequest
from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def refusal(**fields) -> str:
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt="x", **fields)
    return format_validation_error(info.value).removeprefix("invalid rose.jobs.generate arguments: ")


@pytest.mark.parametrize(
    "fields, expected",
    [
        (
            {"structured_outputs": {"regex": "[a-"}},
            "structured_outputs.regex is invalid: * unclosed character class*",
        ),
        (
            {"structured_outputs": {"grammar": "root ::= foo"}},
            "structured_outputs.grammar is invalid: *Rule 'foo' not found",
        ),
        (
            {"structured_outputs": {"json": {"type": "object", "required": 5}}},
            "structured_outputs.json is invalid: not a valid JSON Schema: 5 is not of type 'array' (at $.required)",
        ),
        (
            {"response_format": schema_format({"properties": {"a": {"type": "nonsense"}}})},
            "response_format.json_schema.schema is invalid: not a valid JSON Schema: 'nonsense' is not valid under "
            "any of the given schemas (at $.properties.a.type)",
        ),
        (
            {"response_format": schema_format([1])},
            "response_format.json_schema.schema must be a JSON schema (an object), got [1]",
        ),
        (  # valid JSON Schema, but a pattern the grammar engine cannot compile
            {"response_format": schema_format({"type": "string", "pattern": "[a"})},
            "response_format.json_schema.schema is invalid: * unclosed character class*",
        ),
        (
            {"structured_outputs": {"json": {"type": "object", "if": {"required": ["a"]}, "then": {}}}},
            'structured_outputs.json is invalid: Unimplemented keys: ["if", "then"]',
        ),
        (
            {"structured_outputs": {"json": {"type": "string", "format": "colour"}}},
            "structured_outputs.json is invalid: Unknown format: colour",
        ),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_naming_the_field_sent(fields, expected):
    """`*`: what xgrammar's wording may change (a position, the end of a sentence)."""
    pattern = ".*".join(re.escape(part) for part in expected.split("*"))
    assert re.fullmatch(pattern, refusal(**fields)), refusal(**fields)


@pytest.mark.parametrize(
    "constraint",
    [
        {
            "json": {"type": "string", "pattern": "^(?<year>[0-9]{4})-[0-9]{2}$"}
        },  # ECMA 262, not Python's dialect
        {"json": {"type": "string", "format": "uri"}},
        {"json": {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}},
        {"json": {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {}, "type": "object"}},
        {"regex": "[0-9]{3}-[0-9]{4}"},
        {"regex": r"\p{L}+"},  # Unicode classes: llguidance takes them (xgrammar 0.2.8 does not)
        {"grammar": 'root ::= "yes" | "no"'},
        {"choice": ["a", "b"]},
        {"json_object": True},
    ],
)
def test_what_compiles_is_accepted(constraint):
    assert GenerateRequest(prompt="x", structured_outputs=constraint).constraint() is not None


def test_client_refuses_before_enqueueing(fake_r):
    client = Client(fake_r, queue="rose")
    bad = schema_format({"type": "object", "properties": {"a": {"minLength": "3"}}})
    with pytest.raises(
        InvalidRequest, match=r"^invalid rose.jobs.generate arguments: response_format\.json_schema"
    ):
        client.chat([{"role": "user", "content": "hi"}], response_format=bad)
    with pytest.raises(InvalidRequest, match=r"structured_outputs\.regex is invalid"):
        client.submit_many(["fine", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}])
    assert fake_r.llen("rq:queue:rose") == 0


def test_a_batch_line_with_a_bad_schema_is_a_400_naming_its_param():
    line = {
        "custom_id": "c1",
        "method": "POST",
        "url": CHAT_URL,
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": schema_format({"type": "object", "required": "a"}),
        },
    }
    fmt = OpenAIFormat()
    entry = fmt.parse(1, json.dumps(line), {})
    assert entry.request is None
    error = fmt.invalid_line(entry)["response"]["body"]["error"]
    assert error["param"] == "response_format.json_schema.schema" and error["code"] == "invalid_value"
    assert error["message"].startswith(
        "response_format.json_schema.schema is invalid: not a valid JSON Schema"
    )


def test_a_worker_checks_with_its_own_backend():
    """rose-worker --structured-outputs-backend xgrammar validates jobs with xgrammar's front end (the intake passes
    its backend as validation context): a keyword llguidance refuses and xgrammar reads is taken there."""
    fields = {
        "prompt": "x",
        "structured_outputs": {"json": {"type": "object", "propertyNames": {"maxLength": 3}}},
    }
    assert "Unimplemented keys" in refusal(structured_outputs=fields["structured_outputs"])
    request = GenerateRequest.model_validate(fields, context={"structured_outputs_backend": "xgrammar"})
    assert request.constraint() is not None
    with pytest.raises(ValidationError, match=r"structured_outputs\.regex is invalid: Regex parsing error"):
        GenerateRequest.model_validate(
            {"prompt": "x", "structured_outputs": {"regex": r"\p{L}"}},
            context={"structured_outputs_backend": "xgrammar"},
        )
