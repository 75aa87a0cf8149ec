import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.engine.sampling_params import SamplingParams
from rose.jobs.schemas import GenerateRequest, ValidationError, format_validation_error


def message(**kwargs) -> str:
    with pytest.raises(ValidationError) as info:
        GenerateRequest(**kwargs)
    return format_validation_error(info.value)


def test_every_sampling_field_is_accepted_with_the_same_default():
    req = GenerateRequest(prompt="hi")
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        assert f.name in GenerateRequest.model_fields, f.name
        assert getattr(req, f.name) == getattr(defaults, f.name), f.name
    assert req.to_sampling_params() == defaults


def test_fields_reach_sampling_params():
    params = GenerateRequest(
        prompt="hi", max_tokens=5, temperature=0.0, top_k=3, stop="x", seed=7
    ).to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.stop, params.seed) == (
        5,
        0.0,
        3,
        ["x"],
        7,
    )


def test_unknown_field_is_named():
    assert "unknown field 'max_token'" in message(prompt="hi", max_token=5)


def test_unknown_field_names_the_closest_known_one():
    """The worker's message (format_validation_error) suggests the field a typo meant; nothing when none is close."""
    assert message(prompt="hi", max_token=5) == (
        "invalid rose.jobs.generate arguments: unknown field 'max_token' (did you mean 'max_tokens'?)"
    )
    assert "unknown field 'temprature' (did you mean 'temperature'?)" in message(prompt="hi", temprature=0.5)
    assert "unknown field 'stop_tokens_ids' (did you mean 'stop_token_ids'?)" in message(
        prompt="hi", stop_tokens_ids=[1]
    )
    assert message(prompt="hi", zzzz=1) == "invalid rose.jobs.generate arguments: unknown field 'zzzz'"
    with pytest.raises(ValidationError) as info:
        GenerateRequest(prompt="hi", job_timout=5)
    assert "(did you mean 'job_timeout'?)" in format_validation_error(info.value, also=["job_timeout"])
    assert "did you mean" not in format_validation_error(info.value)


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "a", "prompt_token_ids": [1]}])
def test_exactly_one_prompt(kwargs):
    assert "exactly one of 'prompt'" in message(**kwargs)


def test_empty_prompts_rejected():
    assert "'prompt' is empty" in message(prompt="")
    assert "'prompt_token_ids' is empty" in message(prompt_token_ids=[])
    assert "non-negative" in message(prompt_token_ids=[1, -2])


def test_sampling_range_errors_name_the_field():
    assert "temperature" in message(prompt="a", temperature=-1)
    assert "top_p" in message(prompt="a", top_p=0)
    assert "min_tokens" in message(prompt="a", max_tokens=2, min_tokens=3)


def test_out_of_range_numbers_name_the_field():
    # each passed validation before and made the engine step raise for the whole batch (or the sampler misbehave)
    assert "top_k" in message(prompt="bad", top_k=2**63)
    assert "temperature" in message(prompt="a", temperature=float("inf"))
    assert "repetition_penalty" in message(prompt="a", repetition_penalty=float("inf"))
    assert "stop_token_ids" in message(prompt="a", stop_token_ids=[2**64])
    assert "max_tokens" in message(prompt="a", max_tokens=2**70)


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"prompt": "abc\ud800def"}, r"prompt[3] ('\ud800')"),
        ({"messages": [{"role": "user", "content": "hi \udc00"}]}, "messages[0].content[3]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, ".text[0]"),
        ({"prompt": "ok", "stop": ["end", "x\udfff"]}, "stop[1][1]"),
        ({"prompt": "ok", "bad_words": ["fine", "no\ud800"]}, "bad_words[1][2]"),
    ],
)
def test_lone_surrogates_are_named(kwargs, where):
    text = message(**kwargs)
    assert where in text and "not valid Unicode text" in text and "lone surrogate" in text
    # JSON's escaped pair decodes to one code point: fine
    assert (
        GenerateRequest(prompt=json.loads('"a pair \\ud83d\\ude00 is fine"')).prompt
        == "a pair \U0001f600 is fine"
    )


def test_token_ids_only_jobs():
    assert GenerateRequest(prompt="a", detokenize=False).to_sampling_params().detokenize is False
    assert "stop needs detokenize=True" in message(prompt="a", stop="x", detokenize=False)


def test_types_are_strict():
    assert "max_tokens" in message(prompt="a", max_tokens="5")
    assert "prompt" in message(prompt=5)
    assert "metadata" in message(prompt="a", metadata=[1, 2])


def test_metadata_and_token_prompt():
    req = GenerateRequest(prompt_token_ids=[1, 2, 3], metadata={"user": "u1", "n": [1]})
    assert req.engine_prompt() == [1, 2, 3]
    assert req.metadata == {"user": "u1", "n": [1]}


@given(st.integers(min_value=1, max_value=10_000), st.floats(min_value=0, max_value=5, allow_nan=False))
def test_valid_values_round_trip(max_tokens, temperature):
    req = GenerateRequest(prompt="p", max_tokens=max_tokens, temperature=temperature)
    again = GenerateRequest(**req.model_dump(exclude_unset=True))
    assert again.to_sampling_params() == req.to_sampling_params()
