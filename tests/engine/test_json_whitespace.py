"""Whitespace between the tokens of constrained JSON is bounded by default (`max_json_whitespace`, xgrammar's
`max_whitespace_cnt`): a model that leans toward whitespace, as real ones do in JSON mode, still has to finish its
JSON; unbounded (vLLM's behaviour) it fills max_tokens with whitespace. The setting reaches the engine from
rose-worker's flag and environment; the compiled-grammar cache stays within its memory budget."""

from __future__ import annotations

import json
import re
from operator import attrgetter

import jsonschema
import pytest
import torch
from engine_helpers import drain
from pydantic import ValidationError

from rose.config import WorkerSettings
from rose.engine.engine import Engine
from rose.engine.grammar import StructuredOutputManager
from rose.engine.presets import build_preset, lean_toward
from rose.engine.sampling_params import SamplingParams
from rose.engine.structured_outputs import DEFAULT_MAX_JSON_WHITESPACE, StructuredOutputsParams
from rose.worker.cli import build_engine, load_settings

SCHEMA = {
    "type": "object",
    # no free string: xgrammar 0.2.8 lets a string with maxLength take raw control characters (tabs, ...), which
    # a whitespace-leaning model then writes (issue 24); this test is about the whitespace between tokens
    "properties": {"name": {"enum": ["ann", "bob"]}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
MAX_TOKENS = 200


def whitespace_leaning_engine(**kwargs) -> Engine:
    """tiny-llama whose every row strongly prefers the tokenizer's whitespace-only tokens."""
    model, tokenizer = build_preset("tiny-llama")
    lean_toward(model, tokenizer, lambda t: bool(t) and set(t) <= set(" \t\n\r"))  # JSON's whitespace
    return Engine(
        model, tokenizer, device="cpu", dtype="float32", max_num_seqs=8, max_model_len=256, **kwargs
    )


def run(engine: Engine) -> list:
    params = StructuredOutputsParams(json=SCHEMA)
    try:
        for i in range(8):
            engine.add_request(
                f"r{i}",
                "Answer in JSON:",
                SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=params),
            )
        outputs = drain(engine).outputs
    finally:
        engine.close()
    return [outputs[f"r{i}"] for i in range(8)]


def longest_gap(text: str) -> int:
    """The longest run of whitespace between JSON tokens (string contents left out)."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return max((len(m) for m in re.findall(r"\s+", outside)), default=0)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_whitespace_leaning_model_still_finishes_its_json(backend):
    outputs = run(whitespace_leaning_engine(structured_outputs_backend=backend))
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert 0 < longest_gap(out.text) <= DEFAULT_MAX_JSON_WHITESPACE  # it did lean, up to the bound


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_unbounded_the_same_model_fills_max_tokens_with_whitespace(backend):
    outputs = run(whitespace_leaning_engine(max_json_whitespace=None, structured_outputs_backend=backend))
    assert all(out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS for out in outputs)
    assert all(longest_gap(out.text) > 5 * DEFAULT_MAX_JSON_WHITESPACE for out in outputs)


def test_a_bound_of_zero_is_refused_when_the_engine_is_built():
    with pytest.raises(ValueError, match="max_json_whitespace must be >= 1"):
        whitespace_leaning_engine(max_json_whitespace=0)


def engine_setting(monkeypatch, variable: str, env: str | None, argv: list[str], read):
    """`read(manager)` on the structured-outputs manager of the engine rose-worker builds from `argv` and the
    environment variable `variable` (unset when `env` is None)."""
    if env is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, env)
    settings, _ = load_settings([*argv, "--model", "tiny-llama", "--device", "cpu", "--max-model-len", "128"])
    assert isinstance(settings, WorkerSettings)
    engine = build_engine(settings)
    try:
        return read(engine.structured_outputs)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], None, DEFAULT_MAX_JSON_WHITESPACE),
        (["--max-json-whitespace", "0"], None, None),  # 0: no limit
        ([], "7", 7),
    ],
)
def test_rose_worker_passes_the_bound_to_its_engine(argv, env, expected, monkeypatch):
    read = attrgetter("max_json_whitespace")
    assert engine_setting(monkeypatch, "ROSE_MAX_JSON_WHITESPACE", env, argv, read) == expected


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], None, "guidance"),  # auto
        (["--structured-outputs-backend", "xgrammar"], None, "xgrammar"),
        ([], "xgrammar", "xgrammar"),
    ],
)
def test_rose_worker_passes_the_grammar_backend_to_its_engine(argv, env, expected, monkeypatch):
    read = attrgetter("backend.name")
    assert engine_setting(monkeypatch, "ROSE_STRUCTURED_OUTPUTS_BACKEND", env, argv, read) == expected


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], None, 60.0),
        (["--grammar-compile-timeout", "5"], None, 5.0),
        (["--grammar-compile-timeout", "0"], None, None),  # no limit
        ([], "2.5", 2.5),
    ],
)
def test_rose_worker_passes_the_grammar_compile_timeout_to_its_engine(argv, env, expected, monkeypatch):
    read = attrgetter("compile_timeout")
    assert engine_setting(monkeypatch, "ROSE_GRAMMAR_COMPILE_TIMEOUT", env, argv, read) == expected


def test_a_grammar_compile_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"grammar_compile_timeout must be > 0 or None \(no limit\), got -1"):
        whitespace_leaning_engine(grammar_compile_timeout=-1)
    with pytest.raises(ValidationError, match="grammar_compile_timeout"):  # the settings refuse it too
        load_settings(["--grammar-compile-timeout", "-1"])


def test_an_unknown_grammar_backend_is_refused_when_the_engine_is_built():
    with pytest.raises(
        ValueError, match="structured_outputs_backend must be auto, xgrammar or guidance, got 'outlines'"
    ):
        whitespace_leaning_engine(structured_outputs_backend="outlines")
    with pytest.raises(SystemExit):  # rose-worker's flag takes the three names only
        load_settings(["--structured-outputs-backend", "outlines"])


@pytest.mark.parametrize(("budget", "hit"), [(64 << 20, True), (1, False)])
def test_compiled_grammars_are_kept_within_the_cache_budget(budget, hit):
    """A grammar's masks grow with the whitespace bound: the cache drops the least recently used ones past its
    memory budget (the newest always stays)."""
    model, tokenizer = build_preset("tiny-llama")
    manager = StructuredOutputManager(
        tokenizer,
        model.config.vocab_size,
        [tokenizer.eos_token_id],
        torch.device("cpu"),
        cache_bytes=budget,
        backend="xgrammar",  # its compiled grammars hold the masks the budget is about
    )
    try:
        schemas = [
            {**SCHEMA, "properties": {**SCHEMA["properties"], f"k{i}": {"type": "integer"}}} for i in range(3)
        ]
        for schema in schemas:
            manager.make_request(StructuredOutputsParams(json=schema)).wait()
        compiles = manager.get_stats()["structured_output_compiles"]
        manager.make_request(StructuredOutputsParams(json=schemas[0])).wait()
        assert (manager.get_stats()["structured_output_compiles"] == compiles) is hit
    finally:
        manager.shutdown()
