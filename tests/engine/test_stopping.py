"""When requests stop, and what text they stream: stop strings, stop tokens, EOS, lengths, deltas, UTF-8."""

from __future__ import annotations

import pytest
from engine_helpers import generate, greedy, make_engine

from rose.engine.engine import Engine
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
N = 24
PROMPTS = {
    "a": "the queue worker reads a batch job",
    "b": "bonjour merci rose",
    "c": "é à ü 中文 日本語 🌹 Ω",
    "d": "redis engine model cache",
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine("tiny-llama", max_num_seqs=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def baseline(engine) -> dict[str, list[int]]:
    """Greedy token ids of every prompt, N tokens, no stopping."""
    run = generate(engine, [(k, p, greedy(N)) for k, p in PROMPTS.items()])
    return {k: run.outputs[k].token_ids for k in PROMPTS}


def run_one(engine: Engine, prompt, params: SamplingParams, rid: str = "r"):
    run = generate(engine, [(rid, prompt, params)])
    out = run.outputs[rid]
    assert run.text(rid) == out.text, "streamed deltas do not add up to the final text"
    assert engine.num_running == engine.num_waiting == 0
    return out, run.deltas[rid]


def decoded_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Length of the decoded text after each prefix of `ids` (ASCII outputs: every prefix decodes cleanly)."""
    return [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]


def test_greedy_baseline_is_deterministic(engine, baseline):
    out, _ = run_one(engine, PROMPTS["d"], greedy(N))
    assert out.token_ids == baseline["d"]
    assert out.text == engine.tokenizer.decode(baseline["d"])


def test_max_tokens_stops_with_length(engine, baseline):
    out, _ = run_one(engine, PROMPTS["a"], greedy(5))
    assert out.token_ids == baseline["a"][:5]
    assert out.finish_reason == "length"
    assert out.metrics.num_generated_tokens == 5


def test_context_limit_when_max_tokens_is_none(engine, baseline):
    prompt_ids = engine.tokenizer.encode(PROMPTS["d"])
    out, _ = run_one(engine, prompt_ids, greedy(None))
    assert out.finish_reason == "length"
    assert len(prompt_ids) + len(out.token_ids) == MAX_MODEL_LEN
    assert out.token_ids[:N] == baseline["d"]


@pytest.mark.parametrize("key", ["b", "d"])
def test_stop_string_spanning_several_tokens(engine, baseline, key):
    tok = engine.tokenizer
    ids = baseline[key]
    text = tok.decode(ids)
    offsets = decoded_offsets(tok, ids)
    # a stop string covering the end of token j-2, all of token j-1 and the start of token j, whose first
    # occurrence is that one
    for j in range(3, len(ids) - 2):
        b = offsets[j - 1]
        stop = text[b - 2 : offsets[j] + 2]
        if text.find(stop) == b - 2:
            break
    else:
        pytest.fail("no suitable stop string in the greedy output")
    stop_end = b - 2 + len(stop)
    completing = next(k for k in range(len(ids) + 1) if offsets[k] >= stop_end)  # tokens needed to see it

    out, _ = run_one(engine, PROMPTS[key], greedy(N, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == text[: b - 2]
    assert out.token_ids == ids[:completing]

    out, _ = run_one(engine, PROMPTS[key], greedy(N, stop=[stop], include_stop_str_in_output=True))
    assert out.text == text[:stop_end]
    assert out.token_ids == ids[:completing]


def test_earliest_stop_string_wins(engine, baseline):
    tok = engine.tokenizer
    text = tok.decode(baseline["d"])
    late, early = text[30:36], text[12:16]
    assert text.find(early) < text.find(late)
    out, _ = run_one(engine, PROMPTS["d"], greedy(N, stop=[late, early]))
    assert out.text == text[: text.find(early)]
    assert out.finish_reason == "stop"


def test_stop_string_never_generated_runs_to_length(engine, baseline):
    out, _ = run_one(engine, PROMPTS["d"], greedy(N, stop=["zzzzzz"]))
    assert out.finish_reason == "length"
    assert out.token_ids == baseline["d"]


def test_held_back_text_streams_exactly(engine, baseline):
    """Deltas hold back exactly the longest tail that could still begin the stop string."""
    tok = engine.tokenizer
    ids = baseline["d"]
    peba = tok.decode([ids[3]])
    stop = peba * 2 + "!"  # " peba peba!" is never generated; " peba" and " peba peba" are
    engine.add_request("h", PROMPTS["d"], greedy(N, stop=[stop]))
    emitted = ""
    held_somewhere = False
    for k in range(1, N + 1):
        outs = [o for o in engine.step() if o.request_id == "h"]
        assert len(outs) == 1
        emitted += outs[0].new_text
        full = tok.decode(ids[:k])
        if outs[0].finished:
            assert k == N and emitted == full == outs[0].output.text
            break
        held = max((n for n in range(1, len(stop)) if full.endswith(stop[:n])), default=0)
        held_somewhere |= held > 0
        assert emitted == full[: len(full) - held], f"after token {k}"
    assert held_somewhere
    assert not engine.has_unfinished()


def test_text_held_back_at_the_end_is_released_by_length(engine, baseline):
    tok = engine.tokenizer
    ids = baseline["d"][:10]
    last = tok.decode(ids[-1:])
    out, deltas = run_one(engine, PROMPTS["d"], greedy(10, stop=[last + "!"]))
    assert out.finish_reason == "length"
    assert out.text == tok.decode(ids)
    assert deltas[-1].endswith(last)  # held back until the request ended


def test_stop_token_ids(engine, baseline):
    tok = engine.tokenizer
    ids = baseline["d"]
    stop_id = ids[3]
    first = ids.index(stop_id)
    out, _ = run_one(engine, PROMPTS["d"], greedy(N, stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[: first + 1]
    assert out.text == tok.decode(ids[:first])

    out, _ = run_one(
        engine, PROMPTS["d"], greedy(N, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    )
    assert out.token_ids == ids[: first + 1]
    assert out.text == tok.decode(ids[: first + 1])


def test_stop_token_ids_honoured_with_ignore_eos(engine, baseline):
    ids = baseline["d"]
    out, _ = run_one(engine, PROMPTS["d"], greedy(N, stop_token_ids=[ids[3]], ignore_eos=True))
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[:4]


def test_min_tokens_suppresses_stop_token(engine, baseline):
    ids = baseline["d"]
    stop_id = ids[3]
    out, _ = run_one(engine, PROMPTS["d"], greedy(N, stop_token_ids=[stop_id], min_tokens=6))
    assert out.token_ids[:3] == ids[:3]
    assert stop_id not in out.token_ids[:6]
    assert len(out.token_ids) >= 6
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_id


def test_min_tokens_defers_stop_strings(engine, baseline):
    tok = engine.tokenizer
    ids = baseline["a"]
    piece = tok.decode([ids[0]])
    assert ids[:3] == [ids[0]] * 3  # the greedy output repeats its first token
    out, _ = run_one(engine, PROMPTS["a"], greedy(N, stop=[piece]))
    assert (out.text, out.token_ids, out.finish_reason) == ("", ids[:1], "stop")
    # vLLM V1: stop strings count only in tokens after the first min_tokens (V0 checked the min_tokens-th too)
    out, _ = run_one(engine, PROMPTS["a"], greedy(N, stop=[piece], min_tokens=3))
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[:4]
    assert out.text == piece * 3


@pytest.fixture(scope="module")
def eos_engine(baseline) -> tuple[Engine, int]:
    """An engine whose model's EOS is a token the greedy run of prompt "d" produces at index 3."""
    model, tok = build_preset("tiny-llama")
    eos = baseline["d"][3]
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    engine = Engine(model, tok, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    assert eos in engine.eos_token_ids
    return engine, eos


def test_eos_stops_the_request(eos_engine, baseline):
    engine, eos = eos_engine
    ids = baseline["d"]
    out, _ = run_one(engine, PROMPTS["d"], SamplingParams(temperature=0.0, max_tokens=N))
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[:4] and out.token_ids[-1] == eos
    assert out.text == engine.tokenizer.decode(ids[:3])


def test_ignore_eos_runs_to_max_tokens(eos_engine, baseline):
    engine, _ = eos_engine
    out, _ = run_one(engine, PROMPTS["d"], SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    assert out.finish_reason == "length"
    assert out.token_ids == baseline["d"]


def test_min_tokens_suppresses_eos(eos_engine, baseline):
    engine, eos = eos_engine
    out, _ = run_one(engine, PROMPTS["d"], SamplingParams(temperature=0.0, max_tokens=N, min_tokens=6))
    assert out.token_ids[:3] == baseline["d"][:3]
    assert not set(out.token_ids[:6]) & engine.eos_token_ids
    assert len(out.token_ids) >= 6
    assert out.finish_reason == "length" or out.token_ids[-1] in engine.eos_token_ids


# ----------------------------------------------------------------------------------------------- UTF-8 streaming


def _check_deltas(deltas: list[str], final_text: str) -> None:
    assert "".join(deltas) == final_text
    for i, delta in enumerate(deltas):
        delta.encode("utf-8")  # raises on a lone surrogate
        if i < len(deltas) - 1:
            assert not delta.endswith("\ufffd"), f"delta {i} ends in an incomplete character: {delta!r}"


def test_multibyte_streaming_with_sampling(engine):
    tok = engine.tokenizer
    prompts = ["é à ü", "中文 日本語", "🌹 rose 🌹", "Ω merci é"]
    run = generate(
        engine,
        [
            (str(i), p, SamplingParams(temperature=1.5, max_tokens=32, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)
        ],
    )
    partial_tokens = 0
    for i in range(len(prompts)):
        out = run.outputs[str(i)]
        _check_deltas(run.deltas[str(i)], out.text)
        assert out.text == tok.decode(out.token_ids)
        partial_tokens += sum("\ufffd" in tok.decode([t]) for t in out.token_ids)
    assert partial_tokens > 0, "no partial-UTF-8 token was sampled: the test exercises nothing"


def test_multibyte_prompt_greedy_deltas(engine, baseline):
    out, deltas = run_one(engine, PROMPTS["c"], greedy(N))
    assert out.token_ids == baseline["c"]
    _check_deltas(deltas, out.text)
    assert out.prompt == PROMPTS["c"]


def test_detokenize_false_returns_the_same_tokens_without_text(tokenizer):
    """vLLM's `detokenize=False`: token ids only; generation is unchanged."""
    engine = make_engine("tiny-llama", max_num_seqs=2, max_model_len=64)
    prompt = "the queue worker reads"
    run = generate(engine, [("text", prompt, greedy(8)), ("ids", prompt, greedy(8, detokenize=False))])
    with_text, ids_only = run.outputs["text"], run.outputs["ids"]
    assert with_text.text and ids_only.text == ""
    assert ids_only.token_ids == with_text.token_ids
    assert all(d == "" for d in run.deltas["ids"])
