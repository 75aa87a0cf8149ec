"""Structured outputs hold on real schemas and real vocabularies (issue 24): the schema corpus
(structured_corpus.py) through the engine with Qwen2.5's 151k byte-level BPE and Phi-3's 32k SentencePiece
vocabularies, on tiny random-weight models pushed toward short outputs or toward whitespace, at temperature 1.

What must hold: every schema is accepted, but those the backend's front end is known to refuse (refused at
`add_request`, naming why); an output that finishes "stop" is valid under its schema; an output the grammar backend
wrongly allowed finishes "error" with `structured_output_error` (rose's own check), and only where the backend is
known to be loose (KNOWN_DEFECTS, each named); no output runs away in whitespace between JSON tokens.

Kept fast: Phi-3 runs the whole corpus, Qwen2.5 (whose grammar compiles and per-row sampling cost ~5x Phi-3's) a
fixed representative subset; benchmarks/structured_conformance.py runs the whole corpus everywhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import drain
from jsonschema import Draft202012Validator, validators
from real_tokenizers import load_tokenizer, pushed_model
from structured_corpus import CORPUS, FRONT_END_REFUSALS, REFUSED, longest_whitespace_gap

from rose.engine.engine import Engine
from rose.engine.grammar_backends import parse
from rose.engine.sampling_params import SamplingParams
from rose.engine.structured_check import violation
from rose.engine.structured_outputs import (
    DEFAULT_MAX_JSON_WHITESPACE,
    StructuredOutputsParams,
    resolve_backend,
)
from rose.jobs.schemas import GenerateRequest

BACKENDS = ["guidance", "xgrammar"]  # the default first
MAX_TOKENS = 256
PROMPT = "Answer in JSON:"

# Qwen2.5 runs these only: $ref / definitions / recursion, unicode, patterns, formats, number bounds, arrays,
# composition, a tool call, Kubernetes and GitHub shapes, and most kinds of xgrammar defect below. Phi-3 runs the
# whole corpus.
QWEN_SUBSET = (
    "draft7_definitions_order",
    "recursive_tree",
    "unicode_enum",
    "unicode_property_names",
    "unicode_const",
    "string_patterns",
    "format_dates",
    "number_exclusive",
    "integer_multiple_of",
    "money_cents",
    "array_unique_enum",
    "tuple_prefix_items",
    "nullable_ref_anyof",
    "anyof_scalar_union",
    "oneof_discriminated_shapes",
    "allof_beside_type",
    "tool_search_flights",
    "k8s_container",
    "k8s_deployment",
    "gh_workflow_on",
)
SUBSETS: dict[str, tuple[str, ...] | None] = {"qwen2.5-instruct": QWEN_SUBSET, "phi-3-mini-4k-instruct": None}

# What a defect looks like once rose's check has caught it (the output's structured_output_error).
DEFECT_MESSAGES = {
    # a string with maxLength / minLength (a value, or a key under propertyNames) takes raw control characters
    "control_chars": r"^not strict JSON: Invalid control character",
    # multipleOf with a fraction is dropped (xgrammar warns "multipleOf is not supported for type:number")
    "decimal_multiple_of": r"is not a multiple of",
    # allOf is dropped with everything beside it (type included): any JSON value gets through
    "all_of": r".",
    "unique_items": r"has non-unique elements",
    # the date / date-time regexes accept any day 01-31 in any month and second 60 (2021-02-30, 12:15:60)
    "calendar": r"is not a '(date|date-time)'",
    # ipv4 accepts leading zeros (01.2.3.4), which the ipv4 format forbids
    "ipv4_leading_zero": r"is not a 'ipv4'",
    # maxLength beside format or pattern is dropped: the string may run past it
    "too_long": r"is too long",
    # keywords xgrammar does not read, without a warning
    "dependent_required": r"is a dependency of",
    "not": r"should not be valid under",
    "if_then_else": r"does not match",
    "contains": r"does not contain",
    # a bounded class then an optional group holding a literal and a bounded class, in a string's `pattern`
    # ("^[a-z0-9./-]{1,20}(:[a-z0-9.]{1,8})?$"): the first class runs on past its bound, no ':' (27 characters
    # pass); the same regex as structured_outputs.regex is right, so it is xgrammar's JSON-string path
    "pattern_optional_group": r"does not match",
}

# The corpus schemas a backend may let an invalid output through for, and how (DEFECT_MESSAGES); any other "error"
# output fails the test. Derived from each schema's keywords, checked against the backend's grammar on strings, and
# seen on outputs (issue 24; benchmarks/structured_conformance.py shows them all).
KNOWN_DEFECTS: dict[str, dict[str, tuple[str, ...]]] = {
    "xgrammar": {
        "person_basic": ("control_chars", "too_long"),
        "user_profile_optional": ("control_chars",),
        "address_defs": ("control_chars",),
        "recursive_tree": ("control_chars",),
        "unicode_property_names": ("control_chars",),
        "string_lengths": ("control_chars",),
        "format_dates": ("calendar",),
        "format_network": ("ipv4_leading_zero", "too_long"),
        "money_cents": ("decimal_multiple_of",),
        "array_of_strings": ("control_chars",),
        "array_unique_enum": ("unique_items",),
        "array_unique_integers": ("unique_items",),
        "tuple_prefix_items": ("control_chars",),
        "string_map": ("control_chars",),
        "nullable_type_lists": ("control_chars",),
        "anyof_scalar_union": ("control_chars",),
        "allof_beside_type": ("all_of",),
        "allof_merge_refs": ("all_of",),
        "allof_string_pattern": ("all_of",),
        "tool_get_weather": ("control_chars",),
        "tool_search_flights": ("calendar",),
        "tool_call_choice": ("control_chars", "too_long"),
        "tool_parameters_annotated": ("control_chars", "calendar", "too_long"),
        "classification_with_confidence": ("control_chars",),
        "entities_extraction": ("control_chars",),
        "log_entry": ("control_chars", "calendar"),
        "invoice_nested": ("control_chars",),
        "k8s_container": ("pattern_optional_group",),
        "k8s_deployment": ("control_chars",),
        "gh_workflow_job": ("control_chars",),
        "gh_workflow_on": ("control_chars",),
        "dependent_required": ("dependent_required",),
        "not_keyword": ("not",),
        "if_then_else": ("if_then_else",),
        "array_contains": ("contains",),
    },
    # llguidance 1.9.1 refuses the keywords it does not implement (FRONT_END_REFUSALS): none
    "guidance": {},
}

# Where xgrammar 0.2.8 allows two whitespace runs back to back, so up to twice the bound between two JSON tokens:
# inside an empty array that has prefixItems ("[" ws ws "]"), and after a comma in an object with propertyNames or
# maxProperties. Still bounded: nothing runs away.
WIDE_GAPS: dict[str, frozenset[str]] = {
    "xgrammar": frozenset(
        {"tuple_prefix_items", "additional_properties_schema", "string_map", "log_entry", "k8s_deployment"}
    ),
}

CORPUS_BY_NAME = dict(CORPUS)
SEEDS = {name: seed for seed, (name, _) in enumerate(CORPUS)}  # a schema's seed is the same in every run


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, so the steps and the grammar compiles (the engine's pool: one thread on a CPU engine) each
    have a core of a 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def backend_kwargs(backend: str) -> dict:
    return {"structured_outputs_backend": backend}


def front_end_refusal(backend: str, schema: dict) -> str | None:
    """Why `backend`'s tokenizer-free front end refuses `schema`, or None."""
    try:
        parse(backend, StructuredOutputsParams(json=schema))
    except ValueError as exc:
        return str(exc)
    return None


def test_the_corpus_is_real_json_schema_that_producers_may_send():
    names = [name for name, _ in CORPUS] + [name for name, _, _ in REFUSED]
    assert len(CORPUS) >= 50 and len(set(names)) == len(names)
    default = resolve_backend("auto")
    for name, schema in CORPUS:
        # format_checker None: a `pattern` is ECMA 262, which Python's `regex` format check would misjudge
        validators.validator_for(schema, default=Draft202012Validator).check_schema(
            schema, format_checker=None
        )
        for backend, refusals in FRONT_END_REFUSALS.items():
            refusal = front_end_refusal(backend, schema)
            if name in refusals:
                assert refusal is not None and refusals[name] in refusal, (backend, name, refusal)
            else:
                assert refusal is None, (backend, name)
        # the producer-side check runs the default backend's front end
        if name in FRONT_END_REFUSALS[default]:
            with pytest.raises(ValueError, match=re.escape(FRONT_END_REFUSALS[default][name])):
                GenerateRequest(prompt="x", structured_outputs={"json": schema})
        else:
            GenerateRequest(prompt="x", structured_outputs={"json": schema})
    assert set(QWEN_SUBSET) <= set(CORPUS_BY_NAME)
    for known in KNOWN_DEFECTS.values():
        assert set(known) <= set(CORPUS_BY_NAME)
        assert {kind for kinds in known.values() for kind in kinds} <= set(DEFECT_MESSAGES)


@pytest.mark.parametrize(("name", "schema", "verdicts"), REFUSED, ids=[name for name, _, _ in REFUSED])
def test_valid_schemas_a_grammar_engine_cannot_read_are_refused_at_its_front_end(name, schema, verdicts):
    validators.validator_for(schema, default=Draft202012Validator).check_schema(schema, format_checker=None)
    for backend, reason in verdicts.items():
        refusal = front_end_refusal(backend, schema)
        if reason is None:
            assert refusal is None, (backend, refusal)
        else:
            assert refusal is not None and reason in refusal, (backend, refusal)


@pytest.mark.parametrize("push", ["short", "whitespace"])
@pytest.mark.parametrize("tokenizer_name", list(SUBSETS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_corpus_holds_on_a_real_vocabulary(backend, tokenizer_name, push, record_property):
    kwargs = backend_kwargs(backend)
    tokenizer = load_tokenizer(tokenizer_name)
    subset = SUBSETS[tokenizer_name]
    refusals = FRONT_END_REFUSALS.get(backend, {})
    chosen = [(name, CORPUS_BY_NAME[name]) for name in subset] if subset else CORPUS
    schemas = [(name, schema) for name, schema in chosen if name not in refusals]
    engine = Engine(
        pushed_model(tokenizer, push),
        tokenizer,
        device="cpu",
        dtype="float32",
        max_num_seqs=len(schemas),
        max_model_len=MAX_TOKENS + 32,
        **kwargs,
    )
    params = {}
    try:
        for name, schema in schemas:
            params[name] = SamplingParams(
                temperature=1.0,
                seed=SEEDS[name],
                max_tokens=MAX_TOKENS,
                structured_outputs=StructuredOutputsParams(json=schema),
            )
            engine.add_request(name, PROMPT, params[name])  # compiles: no ValueError
        for name, schema in chosen:
            if name in refusals:  # refused where it is added, naming why, as at the producer
                refused = SamplingParams(
                    max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema)
                )
                with pytest.raises(ValueError, match=re.escape(refusals[name])):
                    engine.add_request(f"refused {name}", PROMPT, refused)
        outputs = drain(engine).outputs
    finally:
        engine.close()

    known = KNOWN_DEFECTS.get(backend, {})
    wide = WIDE_GAPS.get(backend, frozenset())
    unexpected = []
    caught = []
    for name, _ in schemas:
        out = outputs[name]
        where = f"{name}: {out.finish_reason} {out.text!r:.300}"
        if out.finish_reason == "stop":
            found = violation(params[name].structured_outputs, out.text)
            if found is not None:  # the engine's own check must have turned it into "error"
                unexpected.append(f"{where}\n    reported stop but breaks its schema: {found}")
        elif out.finish_reason == "error":
            error = out.structured_output_error
            kinds = known.get(name, ())
            if error is None:  # not a schema violation: a compile failure, a refused token
                unexpected.append(f"{where}\n    failed: {out.error}")
            elif not any(re.search(DEFECT_MESSAGES[kind], error) for kind in kinds):
                unexpected.append(f"{where}\n    violation not known for {backend}: {error}")
            else:
                caught.append(f"{name}: {error}")
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS, where
        bound = DEFAULT_MAX_JSON_WHITESPACE * (2 if name in wide else 1)
        if longest_whitespace_gap(out.text) > bound:
            unexpected.append(f"{where}\n    whitespace run {longest_whitespace_gap(out.text)} > {bound}")
    lengths = sorted(name for name, _ in schemas if outputs[name].finish_reason == "length")
    record_property("outputs", len(schemas))
    record_property("length", len(lengths))
    record_property("length_schemas", lengths)
    record_property("caught", caught)
    assert not unexpected, "\n".join(unexpected)
    # with the whitespace bound, most outputs end well within max_tokens (unbounded, a whitespace push fills them)
    assert len(lengths) <= len(schemas) // 4, lengths
