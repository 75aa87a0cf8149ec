"""Requests that can never run fail early, with a ValueError that says what is wrong."""

from __future__ import annotations

import math

import pytest
from engine_helpers import drain, greedy, make_engine

from rose.engine.engine import Engine
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams

# at least one invalid value per field; the error must name the field
INVALID = {
    "max_tokens": [0, -3, 2.5, True, "8", 2**63],
    "min_tokens": [-1, 1.5, None, 2**63],
    "temperature": [-0.1, math.nan, "hot", None, math.inf, 10**400],
    "top_k": [-2, 1.5, None, 2**63, 10**30],
    "top_p": [0.0, -0.5, 1.01, math.nan],
    "min_p": [-0.1, 1.5, math.nan],
    "repetition_penalty": [0.0, -1.0, math.nan, math.inf],
    "presence_penalty": [2.5, -2.1, math.nan, -math.inf],
    "frequency_penalty": [2.01, -3.0, None, math.inf],
    "seed": [1.5, "42", True, 2**64, -(2**63) - 1],
    "stop": [[""], [3], ["ok", None], 5],
    "stop_token_ids": [[-1], ["7"], [1.0], 7, [2**63]],
    # a string from a config file or JSON body must not silently become True
    "ignore_eos": ["false"],
    "include_stop_str_in_output": ["no"],
    "skip_special_tokens": ["false"],
    "logprobs": [-1, 2.5, "3", 2**63],
    "prompt_logprobs": [-1, 2.5, "3", 2**63, True],
    "detokenize": ["no", 0],
    "logit_bias": [{"x": 1}, {"1": 100.5}, {1: math.nan}, {-1: 0}, {True: 1}, [(1, 2)], "{}"],
    "allowed_token_ids": [[], [-1], ["3"], [1.0], 5, [True]],
    "n": [0, -1, 129, 2.0, True, "2", None],
    "bad_words": ["word", [""], [3], ["ok", None], 5, [["a"]], {"a": 1}],
    "structured_outputs": [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json": "{not json"}, "x"],
}


def test_every_field_has_invalid_cases():
    assert set(INVALID) == set(SamplingParams.field_names())


@pytest.mark.parametrize(
    ("name", "value"), [pytest.param(n, v, id=f"{n}={v!r}") for n, vals in INVALID.items() for v in vals]
)
def test_invalid_sampling_params_name_the_field(name, value):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**{name: value})


def test_stop_strings_need_detokenization():
    with pytest.raises(ValueError, match="stop needs detokenize=True"):
        SamplingParams(stop=["end"], detokenize=False)
    assert SamplingParams(stop_token_ids=[5], detokenize=False).stop_token_ids == [5]


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_valid_edge_values_are_accepted():
    p = SamplingParams(
        max_tokens=1,
        temperature=0,
        top_k=-1,
        top_p=1.0,
        min_p=1.0,
        repetition_penalty=0.01,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=0,
        stop="x",
        stop_token_ids=[0],
        logprobs=0,
    )
    assert p.top_k == 0 and p.stop == ["x"] and p.greedy
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-3).greedy


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine("tiny-gpt2", max_num_seqs=2, max_model_len=32)


@pytest.fixture(autouse=True)
def _unchanged(engine):
    """A rejected request leaves nothing behind."""
    yield
    assert engine.num_waiting == engine.num_running == 0
    assert not engine.has_unfinished()


def test_prompt_plus_max_tokens_over_max_model_len(engine):
    ids = list(range(3, 3 + 25))
    with pytest.raises(ValueError, match=r"max_model_len.*32|32.*max_model_len") as info:
        engine.add_request("long", ids, SamplingParams(max_tokens=8))
    assert "25" in str(info.value) and "8" in str(info.value)
    engine.add_request("fits", ids, greedy(7))  # 25 + 7 == 32 is allowed
    run = drain(engine)
    assert len(run.outputs["fits"].token_ids) == 7


def test_prompt_filling_the_context_with_max_tokens_none(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("full", list(range(3, 35)), SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("over", list(range(3, 40)), SamplingParams(max_tokens=None))


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-text", "empty-ids"])
def test_empty_prompt(engine, prompt):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", prompt, SamplingParams())


@pytest.mark.parametrize("bad", [[8192], [5, -1], [3, 10**6]])
def test_token_ids_out_of_vocab(engine, bad):
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("oov", bad, SamplingParams())


def test_stop_token_ids_out_of_vocab(engine):
    vocab = engine.vocab_size
    with pytest.raises(
        ValueError, match=rf"stop_token_ids: token ids must be in \[0, {vocab}\).*\[{vocab}\]"
    ):
        engine.add_request("oov-stop", "hello", SamplingParams(stop_token_ids=[5, vocab]))
    engine.add_request("in-vocab-stop", "hello", SamplingParams(max_tokens=2, stop_token_ids=[vocab - 1]))
    drain(engine)


def test_text_prompt_with_a_lone_surrogate(engine):
    with pytest.raises(ValueError, match=r"not valid Unicode text: a lone surrogate '\\ud800' at index 3"):
        engine.add_request("surrogate", "abc\ud800def", SamplingParams())


def test_the_largest_top_k_samples(engine):
    """top_k=2**63 made the sampler raise for the whole batch; the largest allowed value just keeps every token."""
    engine.add_request("big-k", "hello", SamplingParams(max_tokens=3, top_k=2**63 - 1, seed=1))
    assert len(drain(engine).outputs["big-k"].token_ids) == 3


def test_bad_prompt_and_params_types(engine):
    with pytest.raises(TypeError):
        engine.add_request("t", [1, "a"], SamplingParams())
    with pytest.raises(TypeError):
        engine.add_request("t", [1, True], SamplingParams())
    with pytest.raises(TypeError):
        engine.add_request("t", "hi", {"max_tokens": 3})


def test_duplicate_request_id(engine):
    engine.add_request("dup", "hello", greedy(3))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", "world", greedy(3))
    run = drain(engine)
    assert run.outputs["dup"].prompt == "hello"
    engine.add_request("dup", "world", greedy(2))  # a finished id may be reused
    assert drain(engine).outputs["dup"].prompt == "world"


def test_text_prompt_without_tokenizer():
    model, _ = build_preset("tiny-gpt2")
    engine = Engine(model, None, device="cpu", max_num_seqs=1, max_model_len=16)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("t", "hello", SamplingParams())
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        engine.add_request("t", [5, 6], SamplingParams(bad_words=["hello"]))
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["ok", "   "], r"bad_words: '   ' gives no token"),
        (["ab\ud800"], r"bad_words: 'ab\\ud800' is not valid Unicode text"),
        ([f"w{i}" for i in range(129)], "bad_words: too many words"),  # > 128 token sequences: vLLM's cap
    ],
)
def test_bad_words_the_engine_cannot_tokenize_are_refused(engine, words, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad-words", [5, 6], SamplingParams(bad_words=words))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_num_seqs=0),
        dict(max_model_len=0),
        dict(max_model_len=10**6),
        dict(max_num_seqs=4, max_num_batched_tokens=2),
    ],
)
def test_bad_engine_config(kwargs):
    model, tok = build_preset("tiny-gpt2")
    kwargs.setdefault("max_model_len", 16)
    with pytest.raises(ValueError):
        Engine(model, tok, device="cpu", **kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused_and_inside_it_steers_the_output():
    engine = make_engine("tiny-gpt2", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"logit_bias: token ids must be in \[0, \d+\).*\[99999\]"):
        engine.add_request("bad", [5, 6], SamplingParams(max_tokens=2, logit_bias={99999: 1}))
    assert not engine.has_unfinished()
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("plain", [5, 6], plain)
    engine.add_request("forced", [5, 6], SamplingParams(**{**plain.to_dict(), "logit_bias": {"42": 100}}))
    run = drain(engine)
    assert run.outputs["forced"].token_ids == [42] * 6
    assert run.outputs["plain"].token_ids != [42] * 6
    with pytest.raises(ValueError, match=r"allowed_token_ids: token ids must be in \[0, \d+\)"):
        engine.add_request("bad", [5, 6], SamplingParams(allowed_token_ids=[3, 10**6]))
