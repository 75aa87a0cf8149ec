"""A conformance corpus of JSON schemas shaped like the ones real producers send (API payloads, function calls,
Kubernetes and GitHub-workflow snippets, extraction results), written for rose's tests and benchmarks.

`CORPUS` is a list of (name, schema): each schema is valid under its metaschema and accepted by xgrammar 0.2.8's
front end. Every free string is bounded (maxLength, enum or pattern), every array has maxItems and every recursion
is optional, so a random-weight model can finish each within ~200 tokens: what a schema allows, not what a model
says, is under test.

`FRONT_END_REFUSALS[backend]` names the corpus schemas a grammar backend's front end refuses (the producer-side check,
`rose.jobs.schemas.GenerateRequest`, runs the default backend's) and a substring of why. `REFUSED` lists valid
schemas kept out of `CORPUS` because xgrammar refuses them, with each backend's verdict.
"""

from __future__ import annotations

import re
from typing import Any

Schema = dict[str, Any]

DRAFT_07 = "http://json-schema.org/draft-07/schema#"
DRAFT_2020 = "https://json-schema.org/draft/2020-12/schema"

# shared pieces, as real schemas reuse them
_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_SHORT_TEXT = {"type": "string", "maxLength": 40}
_K8S_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]{0,14}[a-z0-9])?$"}
_K8S_LABELS = {
    "type": "object",
    "propertyNames": {"pattern": "^[a-z]{1,10}$"},
    "additionalProperties": {"type": "string", "maxLength": 12},
    "maxProperties": 3,
}


def _obj(properties: dict[str, Schema], required: list[str] | None = None, **extra: Any) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required is not None:
        schema["required"] = required
    return {**schema, **extra}


CORPUS: list[tuple[str, Schema]] = [
    # ------------------------------------------------------------------ basic records
    (
        "person_basic",
        _obj(
            {
                "name": _NAME,
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "format": "email", "maxLength": 40},
            },
            ["name", "age"],
            additionalProperties=False,
        ),
    ),
    (
        "user_profile_optional",
        _obj(
            {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                "display_name": _SHORT_TEXT,
                "bio": {"type": "string", "maxLength": 60},
                "verified": {"type": "boolean"},
                "followers": {"type": "integer", "minimum": 0},
            },
            ["username"],
            additionalProperties=False,
        ),
    ),
    (
        "all_optional_settings",
        _obj(
            {
                "theme": {"enum": ["light", "dark", "system"]},
                "font_size": {"type": "integer", "minimum": 8, "maximum": 32},
                "notifications": {"type": "boolean"},
                "language": {"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"},
            },
            additionalProperties=False,
        ),
    ),
    (
        "boolean_flags",
        _obj(
            {k: {"type": "boolean"} for k in ("is_active", "is_admin", "has_2fa", "email_opt_in")},
            ["is_active", "is_admin", "has_2fa", "email_opt_in"],
            additionalProperties=False,
        ),
    ),
    # ------------------------------------------------------------------ $ref with $defs / definitions
    (
        "address_defs",
        {
            "$schema": DRAFT_2020,
            "$defs": {
                "address": _obj(
                    {
                        "street": _SHORT_TEXT,
                        "city": _NAME,
                        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                        "country": {"enum": ["US", "FR", "DE", "JP", "BR"]},
                    },
                    ["street", "city", "country"],
                    additionalProperties=False,
                )
            },
            "type": "object",
            "properties": {
                "billing": {"$ref": "#/$defs/address"},
                "shipping": {"$ref": "#/$defs/address"},
            },
            "required": ["billing"],
            "additionalProperties": False,
        },
    ),
    (
        "draft7_definitions_order",
        {
            "$schema": DRAFT_07,
            "definitions": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "line": {
                    "type": "object",
                    "properties": {
                        "sku": {"$ref": "#/definitions/sku"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "lines": {
                    "type": "array",
                    "items": {"$ref": "#/definitions/line"},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["order_id", "lines"],
            "additionalProperties": False,
        },
    ),
    (
        "draft7_nested_refs",
        {
            "$schema": DRAFT_07,
            "definitions": {
                "money": {
                    "type": "object",
                    "properties": {
                        "amount": {"type": "integer", "minimum": 0, "maximum": 1000000},
                        "currency": {"$ref": "#/definitions/currency"},
                    },
                    "required": ["amount", "currency"],
                    "additionalProperties": False,
                },
                "currency": {"enum": ["USD", "EUR", "JPY"]},
            },
            "type": "object",
            "properties": {
                "subtotal": {"$ref": "#/definitions/money"},
                "tax": {"$ref": "#/definitions/money"},
            },
            "required": ["subtotal", "tax"],
            "additionalProperties": False,
        },
    ),
    (
        "recursive_tree",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "label": {"type": "string", "maxLength": 8},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    },
                    "required": ["label"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    # ------------------------------------------------------------------ enum / const, unicode
    (
        "enum_status",
        _obj(
            {
                "status": {"enum": ["open", "in_progress", "blocked", "done"]},
                "priority": {"type": "integer", "enum": [1, 2, 3, 5, 8]},
            },
            ["status", "priority"],
            additionalProperties=False,
        ),
    ),
    (
        "enum_mixed_types",
        _obj(
            {"answer": {"enum": ["yes", "no", 0, 1, True, None]}, "unit": {"const": "n/a"}},
            ["answer", "unit"],
            additionalProperties=False,
        ),
    ),
    (
        "unicode_enum",
        _obj(
            {
                "dish": {"enum": ["crème brûlée", "phở", "寿司", "smørrebrød", "pão de queijo"]},
                "rating": {"enum": ["★", "★★", "★★★"]},
            },
            ["dish", "rating"],
            additionalProperties=False,
        ),
    ),
    (
        "unicode_property_names",
        _obj(
            {
                "名前": {"type": "string", "maxLength": 10},
                "größe_cm": {"type": "integer", "minimum": 50, "maximum": 250},
                "año": {"type": "integer", "minimum": 1900, "maximum": 2100},
                "ciudad": {"enum": ["Bogotá", "São Paulo", "Zürich"]},
            },
            ["名前", "größe_cm", "año"],
            additionalProperties=False,
        ),
    ),
    (
        "unicode_const",
        _obj(
            {
                "marker": {"const": "✓ confirmé"},
                "emoji": {"const": "🌹"},
                "escapes": {"const": 'quote " and backslash \\ and tab \t'},
            },
            ["marker", "emoji", "escapes"],
            additionalProperties=False,
        ),
    ),
    ("top_level_enum", {"enum": ["positive", "negative", "neutral"]}),
    ("top_level_const_object", {"const": {"ok": True, "code": 200}}),
    # ------------------------------------------------------------------ strings: pattern, format, length
    (
        "string_patterns",
        _obj(
            {
                "phone": {"type": "string", "pattern": "^\\+[1-9][0-9]{6,12}$"},
                "color": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
                "slug": {"type": "string", "pattern": "^[a-z0-9]{1,8}(-[a-z0-9]{1,8}){0,3}$"},
                "semver": {
                    "type": "string",
                    "pattern": "^(0|[1-9][0-9]{0,2})\\.(0|[1-9][0-9]{0,2})\\.(0|[1-9][0-9]{0,2})$",
                },
            },
            ["phone", "color", "slug", "semver"],
            additionalProperties=False,
        ),
    ),
    (
        "string_lengths",
        _obj(
            {
                "code": {"type": "string", "minLength": 3, "maxLength": 8},
                "initials": {"type": "string", "minLength": 2, "maxLength": 3},
                "note": {"type": "string", "maxLength": 30},
            },
            ["code", "initials"],
            additionalProperties=False,
        ),
    ),
    (
        "format_dates",
        _obj(
            {
                "birthday": {"type": "string", "format": "date"},
                "created_at": {"type": "string", "format": "date-time"},
            },
            ["birthday", "created_at"],
            additionalProperties=False,
        ),
    ),
    (
        "format_network",
        _obj(
            {
                "id": {"type": "string", "format": "uuid"},
                "host_ip": {"type": "string", "format": "ipv4"},
                "homepage": {"type": "string", "format": "uri", "maxLength": 40},
                "contact": {"type": "string", "format": "email", "maxLength": 40},
            },
            ["id", "host_ip", "homepage", "contact"],
            additionalProperties=False,
        ),
    ),
    ("top_level_uuid", {"type": "string", "format": "uuid"}),
    # ------------------------------------------------------------------ numbers
    (
        "number_ranges",
        _obj(
            {
                "latitude": {"type": "number", "minimum": -90, "maximum": 90},
                "longitude": {"type": "number", "minimum": -180, "maximum": 180},
                "altitude_m": {"type": "integer", "minimum": -500, "maximum": 9000},
            },
            ["latitude", "longitude"],
            additionalProperties=False,
        ),
    ),
    (
        "number_exclusive",
        _obj(
            {
                "probability": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "temperature_k": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                "count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
            },
            ["probability", "temperature_k", "count"],
            additionalProperties=False,
        ),
    ),
    (
        "integer_multiple_of",
        _obj(
            {
                "minutes": {"type": "integer", "multipleOf": 15, "minimum": 0, "maximum": 240},
                "batch": {"type": "integer", "multipleOf": 8, "minimum": 8, "maximum": 512},
            },
            ["minutes", "batch"],
            additionalProperties=False,
        ),
    ),
    (
        "money_cents",
        _obj(
            {
                "price": {"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 10000},
                "currency": {"enum": ["USD", "EUR", "GBP"]},
            },
            ["price", "currency"],
            additionalProperties=False,
        ),
    ),
    ("top_level_integer_range", {"type": "integer", "minimum": -1000, "maximum": 1000}),
    # ------------------------------------------------------------------ arrays
    (
        "array_of_strings",
        _obj(
            {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 1,
                    "maxItems": 4,
                }
            },
            ["tags"],
            additionalProperties=False,
        ),
    ),
    (
        "array_unique_enum",
        _obj(
            {
                "weekdays": {
                    "type": "array",
                    "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                    "uniqueItems": True,
                    "minItems": 1,
                    "maxItems": 5,
                }
            },
            ["weekdays"],
            additionalProperties=False,
        ),
    ),
    (
        "array_unique_integers",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "uniqueItems": True,
            "maxItems": 4,
        },
    ),
    (
        "tuple_prefix_items",
        _obj(
            {
                "coordinates": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "number", "minimum": -180, "maximum": 180},
                        {"type": "number", "minimum": -90, "maximum": 90},
                    ],
                    "items": False,
                    "minItems": 2,
                },
                "row": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "string", "maxLength": 6},
                        {"type": "integer"},
                        {"type": "boolean"},
                    ],
                    "items": {"type": "null"},
                    "maxItems": 4,
                },
            },
            ["coordinates", "row"],
            additionalProperties=False,
        ),
    ),
    (
        "top_level_array_of_objects",
        {
            "type": "array",
            "items": _obj(
                {"id": {"type": "integer", "minimum": 0}, "done": {"type": "boolean"}},
                ["id", "done"],
                additionalProperties=False,
            ),
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    (
        "matrix_2x2",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -9, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    # ------------------------------------------------------------------ additionalProperties
    (
        "additional_properties_schema",
        _obj(
            {"total": {"type": "integer", "minimum": 0}},
            ["total"],
            propertyNames={"pattern": "^[a-z]{1,8}$"},
            additionalProperties={"type": "integer", "minimum": 0, "maximum": 99},
            maxProperties=4,
        ),
    ),
    (
        "string_map",
        {
            "type": "object",
            "propertyNames": {"maxLength": 10},
            "additionalProperties": {"type": "string", "maxLength": 12},
            "maxProperties": 3,
        },
    ),
    # ------------------------------------------------------------------ nullable
    (
        "nullable_type_lists",
        _obj(
            {
                "middle_name": {"type": ["string", "null"], "maxLength": 16},
                "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 130},
                "score": {"type": ["number", "null"]},
                "tags": {"type": ["array", "null"], "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            ["middle_name", "age", "score", "tags"],
            additionalProperties=False,
        ),
    ),
    (
        "nullable_ref_anyof",
        {
            "$defs": {
                "point": _obj(
                    {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    ["x", "y"],
                    additionalProperties=False,
                )
            },
            "type": "object",
            "properties": {"origin": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]}},
            "required": ["origin"],
            "additionalProperties": False,
        },
    ),
    # ------------------------------------------------------------------ composition
    (
        "anyof_scalar_union",
        _obj(
            {
                "value": {
                    "anyOf": [{"type": "string", "maxLength": 10}, {"type": "number"}, {"type": "boolean"}]
                }
            },
            ["value"],
            additionalProperties=False,
        ),
    ),
    (
        "oneof_discriminated_shapes",
        {
            "oneOf": [
                _obj(
                    {
                        "kind": {"const": "circle"},
                        "radius": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                    },
                    ["kind", "radius"],
                    additionalProperties=False,
                ),
                _obj(
                    {
                        "kind": {"const": "rect"},
                        "width": {"type": "integer", "minimum": 1, "maximum": 100},
                        "height": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    ["kind", "width", "height"],
                    additionalProperties=False,
                ),
            ]
        },
    ),
    (
        "oneof_beside_type",
        {
            "type": "object",
            "properties": {
                "payment": {
                    "type": "object",
                    "oneOf": [
                        _obj(
                            {
                                "method": {"const": "card"},
                                "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                            },
                            ["method", "last4"],
                            additionalProperties=False,
                        ),
                        _obj(
                            {
                                "method": {"const": "iban"},
                                "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{4,12}$"},
                            },
                            ["method", "iban"],
                            additionalProperties=False,
                        ),
                    ],
                }
            },
            "required": ["payment"],
            "additionalProperties": False,
        },
    ),
    (
        "allof_beside_type",
        {
            "$defs": {
                "timestamps": _obj({"created": {"type": "integer", "minimum": 0}}, ["created"]),
                "named": _obj({"name": {"type": "string", "maxLength": 12}}, ["name"]),
            },
            "type": "object",
            "allOf": [{"$ref": "#/$defs/timestamps"}, {"$ref": "#/$defs/named"}],
            "properties": {"created": {"type": "integer"}, "name": {"type": "string"}},
            "additionalProperties": False,
        },
    ),
    (
        "allof_merge_refs",
        {
            "$defs": {
                "base": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999}}, ["id"]),
                "extra": _obj({"kind": {"enum": ["a", "b"]}}, ["kind"]),
            },
            "allOf": [{"$ref": "#/$defs/base"}, {"$ref": "#/$defs/extra"}],
        },
    ),
    (
        "allof_string_pattern",
        _obj(
            {
                "url": {
                    "type": "string",
                    "maxLength": 30,
                    "allOf": [{"pattern": "^https://"}, {"pattern": "\\.org/"}],
                }
            },
            ["url"],
            additionalProperties=False,
        ),
    ),
    # ------------------------------------------------------------------ function calling (Glaive / OpenAI tools)
    (
        "tool_get_weather",
        _obj(
            {
                "name": {"const": "get_current_weather"},
                "arguments": _obj(
                    {
                        "location": {
                            "type": "string",
                            "description": "City and country, e.g. Paris, FR",
                            "maxLength": 30,
                        },
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                    },
                    ["location"],
                    additionalProperties=False,
                ),
            },
            ["name", "arguments"],
            additionalProperties=False,
        ),
    ),
    (
        "tool_search_flights",
        _obj(
            {
                "name": {"const": "search_flights"},
                "arguments": _obj(
                    {
                        "origin": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA code"},
                        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "departure_date": {"type": "string", "format": "date"},
                        "passengers": {"type": "integer", "minimum": 1, "maximum": 9, "default": 1},
                        "cabin": {"enum": ["economy", "premium_economy", "business", "first"]},
                    },
                    ["origin", "destination", "departure_date"],
                    additionalProperties=False,
                ),
            },
            ["name", "arguments"],
            additionalProperties=False,
        ),
    ),
    (
        "tool_call_choice",
        {
            "title": "ToolCall",
            "anyOf": [
                _obj(
                    {
                        "name": {"const": "calculate_tip"},
                        "arguments": _obj(
                            {
                                "bill": {"type": "number", "minimum": 0, "maximum": 10000},
                                "percent": {"type": "integer", "minimum": 0, "maximum": 100},
                            },
                            ["bill", "percent"],
                            additionalProperties=False,
                        ),
                    },
                    ["name", "arguments"],
                    additionalProperties=False,
                ),
                _obj(
                    {
                        "name": {"const": "send_email"},
                        "arguments": _obj(
                            {
                                "to": {"type": "string", "format": "email", "maxLength": 30},
                                "subject": {"type": "string", "maxLength": 30},
                            },
                            ["to", "subject"],
                            additionalProperties=False,
                        ),
                    },
                    ["name", "arguments"],
                    additionalProperties=False,
                ),
                _obj({"name": {"const": "no_tool"}}, ["name"], additionalProperties=False),
            ],
        },
    ),
    (
        "tool_parameters_annotated",
        {
            "title": "create_calendar_event",
            "description": "Create an event in the user's calendar.",
            "type": "object",
            "properties": {
                "title": {"type": "string", "title": "Title", "maxLength": 30, "examples": ["Standup"]},
                "start": {"type": "string", "format": "date-time", "description": "RFC 3339 start time"},
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480, "default": 30},
                "attendees": {
                    "type": "array",
                    "items": {"type": "string", "format": "email", "maxLength": 30},
                    "maxItems": 3,
                    "default": [],
                },
                "reminder": {"type": "boolean", "default": True},
            },
            "required": ["title", "start"],
            "additionalProperties": False,
        },
    ),
    # ------------------------------------------------------------------ extraction / classification outputs
    (
        "classification_with_confidence",
        _obj(
            {
                "label": {"enum": ["spam", "ham", "phishing"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "reasons": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
            },
            ["label", "confidence"],
            additionalProperties=False,
        ),
    ),
    (
        "entities_extraction",
        _obj(
            {
                "entities": {
                    "type": "array",
                    "items": _obj(
                        {
                            "text": {"type": "string", "minLength": 1, "maxLength": 16},
                            "type": {"enum": ["PERSON", "ORG", "LOC", "DATE"]},
                            "start": {"type": "integer", "minimum": 0, "maximum": 9999},
                        },
                        ["text", "type", "start"],
                        additionalProperties=False,
                    ),
                    "maxItems": 3,
                }
            },
            ["entities"],
            additionalProperties=False,
        ),
    ),
    (
        "log_entry",
        _obj(
            {
                "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                "timestamp": {"type": "string", "format": "date-time"},
                "message": {"type": "string", "maxLength": 50},
                "context": {
                    "type": "object",
                    "propertyNames": {"pattern": "^[a-z_]{1,10}$"},
                    "additionalProperties": {"type": ["string", "integer", "boolean"], "maxLength": 10},
                    "maxProperties": 2,
                },
            },
            ["level", "timestamp", "message"],
            additionalProperties=False,
        ),
    ),
    # ------------------------------------------------------------------ nesting 3-4 levels
    (
        "invoice_nested",
        _obj(
            {
                "invoice": _obj(
                    {
                        "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                        "customer": _obj(
                            {
                                "name": _NAME,
                                "address": _obj(
                                    {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                    ["city"],
                                    additionalProperties=False,
                                ),
                            },
                            ["name", "address"],
                            additionalProperties=False,
                        ),
                        "total_cents": {"type": "integer", "minimum": 0},
                    },
                    ["number", "customer", "total_cents"],
                    additionalProperties=False,
                )
            },
            ["invoice"],
            additionalProperties=False,
        ),
    ),
    (
        "deep_config_4_levels",
        _obj(
            {
                "server": _obj(
                    {
                        "http": _obj(
                            {
                                "tls": _obj(
                                    {
                                        "enabled": {"type": "boolean"},
                                        "min_version": {"enum": ["1.2", "1.3"]},
                                    },
                                    ["enabled"],
                                    additionalProperties=False,
                                ),
                                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            },
                            ["tls", "port"],
                            additionalProperties=False,
                        )
                    },
                    ["http"],
                    additionalProperties=False,
                )
            },
            ["server"],
            additionalProperties=False,
        ),
    ),
    # ------------------------------------------------------------------ Kubernetes-like
    (
        "k8s_container",
        _obj(
            {
                "name": _K8S_NAME,
                "image": {"type": "string", "pattern": "^[a-z0-9./-]{1,20}(:[a-z0-9.]{1,8})?$"},
                "ports": {
                    "type": "array",
                    "items": _obj(
                        {
                            "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "protocol": {"enum": ["TCP", "UDP", "SCTP"], "default": "TCP"},
                        },
                        ["containerPort"],
                        additionalProperties=False,
                    ),
                    "maxItems": 2,
                },
                "resources": _obj(
                    {
                        "limits": _obj(
                            {
                                "cpu": {"type": "string", "pattern": "^[0-9]{1,3}m?$"},
                                "memory": {"type": "string", "pattern": "^[0-9]{1,4}(Mi|Gi)$"},
                            },
                            additionalProperties=False,
                        )
                    },
                    additionalProperties=False,
                ),
            },
            ["name", "image"],
            additionalProperties=False,
        ),
    ),
    (
        "k8s_deployment",
        _obj(
            {
                "apiVersion": {"const": "apps/v1"},
                "kind": {"const": "Deployment"},
                "metadata": _obj(
                    {"name": _K8S_NAME, "labels": _K8S_LABELS}, ["name"], additionalProperties=False
                ),
                "spec": _obj(
                    {
                        "replicas": {"type": "integer", "minimum": 0, "maximum": 10},
                        "selector": _obj(
                            {"matchLabels": _K8S_LABELS}, ["matchLabels"], additionalProperties=False
                        ),
                        "strategy": _obj(
                            {"type": {"enum": ["RollingUpdate", "Recreate"]}},
                            ["type"],
                            additionalProperties=False,
                        ),
                    },
                    ["selector"],
                    additionalProperties=False,
                ),
            },
            ["apiVersion", "kind", "metadata", "spec"],
            additionalProperties=False,
        ),
    ),
    (
        "k8s_service_int_or_string",
        _obj(
            {
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "targetPort": {
                    "anyOf": [
                        {"type": "integer", "minimum": 1, "maximum": 65535},
                        {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,14}$"},
                    ]
                },
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
            },
            ["port", "targetPort"],
            additionalProperties=False,
        ),
    ),
    # ------------------------------------------------------------------ GitHub-workflow-like
    (
        "gh_workflow_job",
        _obj(
            {
                "runs-on": {"enum": ["ubuntu-latest", "macos-latest", "windows-latest"]},
                "timeout-minutes": {"type": "integer", "minimum": 1, "maximum": 360},
                "steps": {
                    "type": "array",
                    "items": {
                        "anyOf": [
                            _obj(
                                {"uses": {"type": "string", "pattern": "^[a-z-]{1,12}/[a-z-]{1,12}@v[0-9]$"}},
                                ["uses"],
                                additionalProperties=False,
                            ),
                            _obj(
                                {
                                    "name": {"type": "string", "maxLength": 20},
                                    "run": {"type": "string", "maxLength": 30},
                                },
                                ["run"],
                                additionalProperties=False,
                            ),
                        ]
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            ["runs-on", "steps"],
            additionalProperties=False,
        ),
    ),
    (
        "gh_workflow_on",
        _obj(
            {
                "on": {
                    "anyOf": [
                        {"enum": ["push", "pull_request", "workflow_dispatch"]},
                        {
                            "type": "array",
                            "items": {"enum": ["push", "pull_request"]},
                            "minItems": 1,
                            "maxItems": 2,
                        },
                        _obj(
                            {
                                "push": _obj(
                                    {
                                        "branches": {
                                            "type": "array",
                                            "items": {"type": "string", "maxLength": 12},
                                            "maxItems": 2,
                                        }
                                    },
                                    additionalProperties=False,
                                ),
                                "schedule": {
                                    "type": "array",
                                    "items": _obj(
                                        {"cron": {"type": "string", "pattern": "^[0-9*/ ,-]{9,20}$"}},
                                        ["cron"],
                                        additionalProperties=False,
                                    ),
                                    "maxItems": 1,
                                },
                            },
                            additionalProperties=False,
                        ),
                    ]
                },
                "permissions": {
                    "anyOf": [
                        {"enum": ["read-all", "write-all"]},
                        _obj({"contents": {"enum": ["read", "write", "none"]}}, additionalProperties=False),
                    ]
                },
            },
            ["on"],
            additionalProperties=False,
        ),
    ),
    # ------------------------------------------------------------------ real-world keywords a grammar may not enforce
    (
        "dependent_required",
        _obj(
            {
                "credit_card": {"type": "string", "pattern": "^[0-9]{4}$"},
                "billing_zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            dependentRequired={"credit_card": ["billing_zip"]},
            additionalProperties=False,
        ),
    ),
    (
        "not_keyword",
        _obj(
            {"code": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1, 2, 3, 4]}}},
            ["code"],
            additionalProperties=False,
        ),
    ),
    (
        "if_then_else",
        _obj(
            {
                "country": {"enum": ["US", "CA"]},
                "postal_code": {"type": "string", "pattern": "^[0-9A-Z]{5,6}$"},
            },
            ["country", "postal_code"],
            additionalProperties=False,
            **{
                "if": {"properties": {"country": {"const": "US"}}},
                "then": {"properties": {"postal_code": {"pattern": "^[0-9]{5}$"}}},
                "else": {"properties": {"postal_code": {"pattern": "^[A-Z][0-9][A-Z][0-9][A-Z][0-9]$"}}},
            },
        ),
    ),
    (
        "array_contains",
        {
            "type": "array",
            "items": {"enum": ["read", "write", "admin"]},
            "contains": {"const": "read"},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
]


# llguidance 1.9.1 refuses, by name, the keywords it does not implement (xgrammar 0.2.8 drops them silently).
_UNIMPLEMENTED = "Unimplemented keys"
FRONT_END_REFUSALS: dict[str, dict[str, str]] = {
    "xgrammar": {},
    "guidance": {
        "array_unique_enum": f'{_UNIMPLEMENTED}: ["uniqueItems"]',
        "array_unique_integers": f'{_UNIMPLEMENTED}: ["uniqueItems"]',
        "additional_properties_schema": f'{_UNIMPLEMENTED}: ["propertyNames"]',
        "string_map": f'{_UNIMPLEMENTED}: ["propertyNames"]',
        "log_entry": f'{_UNIMPLEMENTED}: ["propertyNames"]',
        "k8s_deployment": f'{_UNIMPLEMENTED}: ["propertyNames"]',
        "dependent_required": f'{_UNIMPLEMENTED}: ["dependentRequired"]',
        "not_keyword": f'{_UNIMPLEMENTED}: ["not"]',
        "if_then_else": f'{_UNIMPLEMENTED}: ["else", "if", "then"]',
        "array_contains": f'{_UNIMPLEMENTED}: ["contains"]',
    },
}

# (name, schema, {backend: a substring of its front end's refusal, or None where it accepts the schema})
REFUSED: list[tuple[str, Schema, dict[str, str | None]]] = [
    # draft-04's boolean exclusiveMinimum (valid there, still emitted by some generators, e.g. older OpenAPI)
    (
        "draft4_boolean_exclusive_minimum",
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "number",
            "minimum": 0,
            "exclusiveMinimum": True,
        },
        {"xgrammar": "Value must be a number", "guidance": None},
    ),
    # draft-07's tuple form of `items` (an array of schemas) with additionalItems
    (
        "draft7_items_array_tuple",
        {
            "$schema": DRAFT_07,
            "type": "array",
            "items": [{"type": "number"}, {"type": "string", "maxLength": 5}],
            "additionalItems": False,
        },
        {"xgrammar": "items must be a boolean or an object", "guidance": None},
    ),
    # an integer bound that is not a whole number is valid JSON Schema (integers in [0.5, 10.5])
    (
        "integer_fractional_bounds",
        {"type": "integer", "minimum": 0.5, "maximum": 10.5},
        {"xgrammar": "must be a whole number", "guidance": None},
    ),
    # ECMA 262 regexes real schemas use: Unicode property escapes, backreferences
    (
        "pattern_unicode_letter_class",
        {"type": "string", "pattern": "^\\p{L}{1,10}$"},
        {"xgrammar": "Unicode character class escape sequence is not supported", "guidance": None},
    ),
    (
        "pattern_backreference",
        {"type": "string", "pattern": "^(['\"])[a-z]{1,5}\\1$"},
        {"xgrammar": "Backreference is not supported", "guidance": "backreferences are not supported"},
    ),
]


# a string literal, or the unterminated one an output cut by max_tokens ends in
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)')


def longest_whitespace_gap(text: str) -> int:
    """The longest run of whitespace between JSON tokens of `text` (string contents left out): what the engine's
    JSON whitespace bound limits."""
    outside = _JSON_STRING.sub('""', text)
    return max((len(m) for m in re.findall(r"\s+", outside)), default=0)
