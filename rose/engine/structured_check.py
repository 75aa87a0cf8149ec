"""Checks of structured outputs, before and after: a constraint that cannot compile is refused where the job is
made (`check_constraint`), and rose's guarantee holds on every output (`violation`).

**Before.** `check_constraint` refuses what the worker's grammar engine would refuse, at the producer (Client,
AsyncClient, rose submit, rose batch: they validate jobs with rose.jobs.schemas) and again in the worker, naming
the field the user sent (`response_format.json_schema.schema`, `structured_outputs.regex`, ...): a JSON Schema that
is not valid under its metaschema (jsonschema), a schema, regex or grammar the default grammar engine cannot
compile (its tokenizer-free front end: the parser a worker with the default backend runs, so the same verdict and
the keyword it does not support named). Verdicts are cached by constraint: a producer of a million jobs with one
schema checks it once.

**After.** A JSON-constrained request that finishes `stop` produced strict JSON, valid under its schema: checked
on the finished text, before the engine reports it.

A grammar backend turns a schema into token masks and can get the schema wrong: xgrammar 0.2.8 lets a `maxLength`
string take raw control characters, lets a `multipleOf: 0.01` number run to more decimals, and lets `allOf` beside
`type` through (issue 24's corpus). So the mask is not trusted: the text is parsed as strict JSON (no raw control
characters in strings, no NaN / Infinity, no repeated key in an object) and validated with `jsonschema` under the
schema's own draft (its `$schema`; 2020-12 when it names none), `format` included where jsonschema can check it.
`json_object` asks for a JSON object and nothing more. A regex, choice or grammar constraint is not checked: its mask is the definition.

`violation` names what is wrong ("$.price: 24.11652 is not a multiple of 0.01"), or returns None. A schema the
checker itself cannot use (an unresolvable `$ref`, say) is logged once and not checked: the grammar compiled it, and a
checker's failure is not the output's.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from decimal import Decimal
from typing import Any

from rose.engine.structured_outputs import StructuredOutputsParams, resolve_backend

logger = logging.getLogger(__name__)

MAX_MESSAGE = 300  # characters of jsonschema's message kept: it quotes the offending value, which may be long


def check_constraint(params: StructuredOutputsParams, where: str, backend: str = "auto") -> None:
    """Raise ValueError("<where> is invalid: <why>") when the constraint cannot compile (with `backend`)."""
    problem = _problem(params.key, resolve_backend(backend))
    if problem is not None:
        raise ValueError(f"{where} is invalid: {problem}")


@functools.lru_cache(maxsize=1024)
def _problem(key: tuple[str, str], backend: str) -> str | None:
    from rose.engine.grammar_backends import parse

    kind, spec = key
    if kind == "json":
        from jsonschema import Draft202012Validator, validators
        from jsonschema.exceptions import SchemaError

        schema = json.loads(spec)
        try:
            # no format checks: the metaschema's `regex` format is Python's dialect, a `pattern` is ECMA 262's
            validators.validator_for(schema, default=Draft202012Validator).check_schema(
                schema, format_checker=None
            )
        except SchemaError as exc:
            return f"not a valid JSON Schema: {exc.message} (at {exc.json_path})"
    if kind not in ("json", "regex", "grammar"):
        return None
    value = json.loads(spec) if kind == "json" else spec
    try:
        parse(backend, StructuredOutputsParams(**{kind: value}))
    except ImportError:  # a producer without the engine's packages: the worker checks it
        return None
    except ValueError as exc:  # "structured_outputs.<kind> is invalid: <why>"
        return str(exc).partition(" is invalid: ")[2] or str(exc)
    return None


def violation(params: StructuredOutputsParams, text: str) -> str | None:
    """What makes `text` break its JSON constraint, or None (valid, or not a JSON constraint)."""
    if params.json is None and not params.json_object:
        return None
    try:
        instance = json.loads(text, parse_constant=_not_json, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        return f"not strict JSON: {exc}"
    if params.json is None:
        return None if isinstance(instance, dict) else f"not a JSON object: a {type(instance).__name__}"
    spec = params.key[1]
    validator = _validator(spec)
    if validator is None:
        return None
    try:
        from jsonschema.exceptions import best_match

        error = best_match(validator.iter_errors(instance))
    except (
        Exception
    ) as exc:  # the checker, not the output: a $ref it cannot resolve, a regex it cannot compile
        _unchecked(spec, repr(exc))
        return None
    if error is None:
        return None
    message = error.message if len(error.message) <= MAX_MESSAGE else error.message[:MAX_MESSAGE] + "..."
    return f"{error.json_path}: {message}"


def _multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """`multipleOf` in decimal, as the JSON text writes numbers: jsonschema divides floats, and 0.07 / 0.01 is
    7.000000000000001 there, which would fail a valid output."""
    if not validator.is_type(instance, "number"):
        return
    from jsonschema.exceptions import ValidationError

    quotient = Decimal(repr(instance)) / Decimal(repr(divisor))
    if quotient != quotient.to_integral_value():
        yield ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


_LEAP_SECOND = re.compile(r"(T\d{2}:\d{2}:)60", re.IGNORECASE)


@functools.lru_cache(maxsize=8)
def _format_checker(drafts: Any) -> Any:
    """The draft's format checks, but a `date-time` may hold a leap second (`23:59:60Z`, RFC 3339's 5.6), which
    jsonschema's refuses: a grammar that allows it has not erred."""
    import copy

    checker = copy.deepcopy(drafts)
    found = checker.checkers.get("date-time")
    if found is not None:
        check, raises = found

        @checker.checks("date-time", raises=raises)
        def date_time(instance: object) -> bool:
            return check(_LEAP_SECOND.sub(r"\g<1>59", instance) if isinstance(instance, str) else instance)

    return checker


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose names are unique (RFC 8259's SHOULD; a repeated key reads differently from parser to parser:
    an extraction with two `price`s has no price)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        repeated = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"duplicate key {repeated!r}")
    return out


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@functools.lru_cache(maxsize=256)
def _validator(spec: str) -> Any:
    """A validator of the schema's own draft, formats checked; built once per schema (requests share schemas)."""
    from jsonschema import Draft202012Validator, validators

    schema = json.loads(spec)
    try:
        cls = validators.validator_for(schema, default=Draft202012Validator)
        exact = validators.extend(cls, {"multipleOf": _multiple_of})
        return exact(schema, format_checker=_format_checker(cls.FORMAT_CHECKER))
    except Exception as exc:
        _unchecked(spec, repr(exc))
        return None


@functools.lru_cache(maxsize=64)
def _unchecked(spec: str, error: str) -> None:  # cached: logged once per schema and error
    logger.warning(
        "structured outputs: a schema the checker cannot use is not checked (%s): %.200s", error, spec
    )
