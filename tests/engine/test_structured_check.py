"""The structured-outputs guarantee: a JSON-constrained output that finishes `stop` is strict JSON valid under its
schema, or the engine says what it breaks (finish_reason "error", `structured_output_error`, the text kept).

The grammar backend is not trusted: xgrammar 0.2.8 lets a string with `maxLength` take raw control characters, so a
model that leans toward them writes JSON that `json.loads` rejects; the engine catches it."""

from __future__ import annotations

import logging

import pytest
from engine_helpers import drain

from rose.engine.engine import Engine
from rose.engine.presets import build_preset, lean_toward
from rose.engine.sampling_params import SamplingParams
from rose.engine.structured_check import violation
from rose.engine.structured_outputs import StructuredOutputsParams

CAPPED_STRING = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 4}},
    "required": ["s"],
    "additionalProperties": False,
}


def json_(schema) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema)


@pytest.mark.parametrize(
    "schema, text, expected",
    [
        (CAPPED_STRING, '{"s": "ok"}', None),
        (CAPPED_STRING, '{"s": "kari\x07"}', "not strict JSON: Invalid control character"),
        (CAPPED_STRING, '{"s": "toolong"}', "$.s: 'toolong' is too long"),
        (CAPPED_STRING, "3", "$: 3 is not of type 'object'"),
        ({"type": "number"}, "NaN", "not strict JSON: NaN is not JSON"),
        ({"type": "object"}, '{"a": 1, "b": {"c": 2, "c": 3}}', "not strict JSON: duplicate key 'c'"),
        ({"type": "number"}, "Infinity", "not strict JSON: Infinity is not JSON"),
        ({"type": "string", "allOf": [{"pattern": "^https?://"}]}, "[1]", "$: [1] is not of type 'string'"),
        ({"type": "string", "format": "email"}, '"no-at-sign"', "$: 'no-at-sign' is not a 'email'"),
        ({"type": "string", "format": "email"}, '"a@b.c"', None),
        ({"type": "number", "multipleOf": 0.01}, "-24.11652", "$: -24.11652 is not a multiple of 0.01"),
        # decimal, as the text writes it: 0.07 / 0.01 is 7.000000000000001 in floats
        ({"type": "number", "multipleOf": 0.01}, "0.07", None),
        ({"type": "number", "multipleOf": 0.01}, "19.99", None),
        ({"type": "integer", "multipleOf": 3}, "10", "$: 10 is not a multiple of 3"),
        (
            {
                "$defs": {"n": {"type": "integer", "minimum": 1}},
                "type": "array",
                "items": {"$ref": "#/$defs/n"},
            },
            "[1, 0]",
            "$[1]: 0 is less than the minimum of 1",
        ),
        # the schema's own draft: draft-04's boolean exclusiveMaximum, draft-07's `definitions`
        (
            {"$schema": "http://json-schema.org/draft-04/schema#", "maximum": 5, "exclusiveMaximum": True},
            "5",
            "$: 5 is greater than or equal to the maximum of 5",
        ),
        (
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "definitions": {"e": {"enum": ["a", "b"]}},
                "properties": {"k": {"$ref": "#/definitions/e"}},
            },
            '{"k": "c"}',
            "$.k: 'c' is not one of ['a', 'b']",
        ),
        ({"type": "object"}, '  {"unicode": "日本語 ✓"}\n', None),
    ],
)
def test_violation_names_what_breaks_the_schema(schema, text, expected):
    found = violation(json_(schema), text)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.startswith(expected), found


def test_json_object_asks_for_an_object_and_nothing_more():
    params = StructuredOutputsParams(json_object=True)
    assert violation(params, '{"any": [1, "thing"]}') is None
    assert violation(params, "[1]") == "not a JSON object: a list"
    assert violation(params, '{"a": 1').startswith("not strict JSON")


def test_other_constraints_are_their_masks():
    for params in (
        StructuredOutputsParams(regex="[a-z]+"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='root ::= "x"'),
    ):
        assert violation(params, "not json {") is None


def test_a_schema_the_checker_cannot_use_is_logged_not_blamed_on_the_output(caplog):
    params = json_({"$ref": "#/$defs/missing"})
    with caplog.at_level(logging.WARNING, logger="rose.engine.structured_check"):
        assert violation(params, "1") is None
        assert violation(params, "2") is None
    logged = [r for r in caplog.records if "cannot use" in r.getMessage()]
    assert len(logged) == 1  # once per schema and error


def control_leaning_engine(backend: str) -> Engine:
    """tiny-llama whose every row strongly prefers raw control characters (U+0000-U+001F but JSON's whitespace)."""
    model, tokenizer = build_preset("tiny-llama")
    lean_toward(model, tokenizer, lambda t: len(t) == 1 and ord(t) < 0x20 and t not in " \t\n\r")
    return Engine(
        model,
        tokenizer,
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_model_len=128,
        structured_outputs_backend=backend,
    )


def run_control_leaning(backend: str) -> dict:
    engine = control_leaning_engine(backend)
    try:
        constrained = SamplingParams(temperature=0, max_tokens=100, structured_outputs=json_(CAPPED_STRING))
        engine.add_request("bad", "Answer in JSON:", constrained)
        engine.add_request("free", "Answer in JSON:", SamplingParams(temperature=0, max_tokens=3))
        return drain(engine).outputs
    finally:
        engine.close()


def test_an_output_the_grammar_let_through_is_not_reported_as_a_clean_stop():
    """xgrammar 0.2.8 lets the capped string take raw control characters: caught, reported, the text kept."""
    outputs = run_control_leaning("xgrammar")
    bad = outputs["bad"]
    assert bad.finish_reason == "error"
    value = bad.text.rsplit('"', 2)[
        1
    ]  # the text kept as generated: the capped string, all control characters
    assert bad.text.endswith('"}') and len(value) == 4 and all(ord(c) < 0x20 for c in value)
    assert bad.structured_output_error.startswith("not strict JSON: Invalid control character")
    assert bad.error == f"structured_outputs: the output breaks its constraint: {bad.structured_output_error}"
    assert outputs["free"].finish_reason == "length" and outputs["free"].structured_output_error is None


def test_llguidance_keeps_the_same_model_to_strict_json():
    """The default backend masks raw control characters in strings: the same model writes valid JSON."""
    out = run_control_leaning("guidance")["bad"]
    assert out.finish_reason == "stop" and out.structured_output_error is None
    assert violation(json_(CAPPED_STRING), out.text) is None


def readme_schema() -> dict:
    """The JSON schema of the README's client example, read from the README itself."""
    import ast
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    source = re.search(r"^schema = (\{.*?\})\s*(?:#.*)?$\n(?!\s)", readme, re.S | re.M)
    assert source, "the README's schema example"
    return ast.literal_eval(re.sub(r"#[^\n]*", "", source.group(1)))


def test_the_readmes_json_example_finishes_valid_on_the_default_preset():
    """`client.chat(..., max_tokens=128, response_format=json_schema)` on rose-worker's default model (tiny-llama,
    random weights) at the default temperature: every output ends and validates (its strings are bounded)."""
    from rose.config import WorkerSettings
    from rose.engine.llm import LLM

    schema = readme_schema()
    assert schema["properties"]["name"]["maxLength"] <= 40
    llm = LLM(WorkerSettings().model, device="cpu", max_model_len=256)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    messages = [{"role": "user", "content": "Extract: Ada Lovelace, 36."}]
    params = [
        SamplingParams(
            max_tokens=128, seed=seed, structured_outputs=StructuredOutputsParams.from_response_format(fmt)
        )
        for seed in range(8)
    ]
    outputs = llm.chat([messages] * 8, params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        assert violation(StructuredOutputsParams(json=schema), out.text) is None


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_the_stop_tokens_text_and_the_jobs_own_stops_are_not_blamed_on_the_grammar(backend):
    """The check reads the output the grammar produced: with include_stop_str_in_output (and special tokens kept)
    the EOS text after the JSON is left out of it; a stop string of the job's own cuts the JSON short, which is
    the job's choice (finish "stop", not checked), not the grammar's escape."""
    from engine_helpers import make_engine

    engine = make_engine("tiny-llama", max_model_len=128, structured_outputs_backend=backend)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    try:
        constraint = json_(schema)
        engine.add_request(
            "eos-text",
            "Answer:",
            SamplingParams(
                temperature=0,
                max_tokens=40,
                structured_outputs=constraint,
                include_stop_str_in_output=True,
                skip_special_tokens=False,
            ),
        )
        engine.add_request(
            "cut",
            "Answer:",
            SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint, stop=[":"]),
        )
        outputs = drain(engine).outputs
    finally:
        engine.close()
    eos = outputs["eos-text"]
    assert eos.finish_reason == "stop" and eos.structured_output_error is None
    eos_text = engine.tokenizer.decode([eos.token_ids[-1]], skip_special_tokens=False)
    assert eos_text and eos.text.endswith(eos_text)  # the EOS text is in the output, after valid JSON
    assert violation(constraint, eos.text.removesuffix(eos_text)) is None
    cut = outputs["cut"]
    assert cut.finish_reason == "stop" and cut.structured_output_error is None
    assert cut.text.startswith("{") and cut.text.endswith('"n"')  # cut before its colon
