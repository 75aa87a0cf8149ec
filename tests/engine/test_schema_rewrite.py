r"""What rose does to a schema before llguidance reads it (rose.engine.schema_rewrite): objects closed where that
keeps the schema's meaning and satisfiable, \d and \w as ECMA 262's ASCII classes, data left alone."""

from __future__ import annotations

import pytest

from rose.engine.schema_rewrite import ascii_classes, ascii_patterns, closed_objects
from rose.engine.structured_check import check_constraint
from rose.engine.structured_outputs import StructuredOutputsParams

STRING, INTEGER = {"type": "string"}, {"type": "integer"}


def test_objects_that_list_properties_get_no_others_nested_ones_too():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": STRING}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy
    said = {"type": "object", "properties": {"a": STRING}, "additionalProperties": INTEGER}
    assert closed_objects(said) == said  # what the schema says of others stays


@pytest.mark.parametrize(
    "schema",
    [
        # properties beside an allOf that adds others
        {
            "type": "object",
            "properties": {"a": STRING},
            "allOf": [{"properties": {"b": INTEGER}, "required": ["b"]}],
        },
        # OpenAPI's inheritance: a $ref'd base in allOf, the parent's own properties beside it
        {
            "$defs": {"Base": {"type": "object", "properties": {"id": INTEGER}, "required": ["id"]}},
            "allOf": [{"$ref": "#/$defs/Base"}],
            "properties": {"name": STRING},
            "required": ["id", "name"],
        },
        # two $ref'd parts merged
        {
            "definitions": {"A": {"properties": {"a": STRING}}, "B": {"properties": {"b": STRING}}},
            "allOf": [{"$ref": "#/definitions/A"}, {"$ref": "#/definitions/B"}],
            "required": ["a", "b"],
        },
    ],
)
def test_schemas_combined_in_place_stay_open_and_satisfiable(schema):
    closed = closed_objects(schema)
    assert "additionalProperties" not in closed
    for where in ("$defs", "definitions"):
        for sub in closed.get(where, {}).values():
            assert "additionalProperties" not in sub
    for branch in closed.get("allOf", []):
        assert "additionalProperties" not in branch
    check_constraint(
        StructuredOutputsParams(json=schema), "structured_outputs.json", "guidance"
    )  # not refused


def test_refs_are_matched_as_json_pointers():
    """A def named `a/b` is `#/$defs/a~1b` in a $ref (RFC 6901): referred to from allOf, it stays open."""
    schema = {"$defs": {"a/b": {"properties": {"x": STRING}}}, "allOf": [{"$ref": "#/$defs/a~1b"}]}
    assert "additionalProperties" not in closed_objects(schema)["$defs"]["a/b"]


@pytest.mark.parametrize("ref", ["#/$defs/my%20def", "#/$defs/my def"])
def test_percent_encoded_refs_are_matched_as_their_names(ref):
    """A $ref is a URI fragment: "#/$defs/my%20def" names the def `my def` (RFC 6901, section 6)."""
    schema = {"$defs": {"my def": {"properties": {"x": STRING}}}, "allOf": [{"$ref": ref}]}
    assert "additionalProperties" not in closed_objects(schema)["$defs"]["my def"]


def test_a_def_used_as_a_whole_property_is_closed():
    schema = {
        "$defs": {"Addr": {"type": "object", "properties": {"city": STRING}}},
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/Addr"}},
    }
    closed = closed_objects(schema)
    assert (
        closed["$defs"]["Addr"]["additionalProperties"] is False and closed["additionalProperties"] is False
    )


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        (r"^\d{3}-\w+$", r"^[0-9]{3}-[0-9A-Za-z_]+$"),
        (r"[\d.]+", r"[0-9.]+"),
        (r"\D\W", r"[^0-9][^0-9A-Za-z_]"),
        (r"[^\d]", r"[^0-9]"),
        (r"[]\d]", r"[]0-9]"),  # a leading ']' is a literal
        (r"[a\]\d]", r"[a\]0-9]"),  # an escaped ']' does not end the class
        (r"\\d", r"\\d"),  # an escaped backslash, then a plain d
        (r"\p{L}\s", r"\p{L}\s"),
    ],
)
def test_ascii_classes(pattern, expected):
    assert ascii_classes(pattern) == expected


def test_patterns_are_rewritten_through_schema_keywords_only():
    schema = {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": r"^\d{5}$"}},
        "patternProperties": {r"^x\d$": INTEGER},
        "const": {"pattern": r"\d+"},  # data, not a schema
        "enum": [{"pattern": r"\d"}],
    }
    out = ascii_patterns(schema)
    assert out["properties"]["zip"]["pattern"] == "^[0-9]{5}$"
    assert list(out["patternProperties"]) == ["^x[0-9]$"]
    assert out["const"] == {"pattern": r"\d+"} and out["enum"] == [{"pattern": r"\d"}]
