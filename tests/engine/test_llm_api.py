"""The offline `LLM` API: prompt forms, output order and fields, logprobs, streaming, no-tokenizer models."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, hf_greedy, text_prompt

from rose.engine.llm import LLM
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams

PRESET = "tiny-llama"


@pytest.fixture(scope="module")
def reference():
    return build_preset(PRESET)[0]


@pytest.fixture(scope="module")
def llm() -> LLM:
    model, tok = build_preset(PRESET)
    return LLM(model, tok, device="cpu", max_num_seqs=3, max_model_len=64, max_num_batched_tokens=16)


@pytest.fixture(autouse=True)
def _empty_after(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished(), "generate() left requests behind"


def test_generate_single_string(llm, reference):
    tok = llm.get_tokenizer()
    prompt = text_prompt(7)
    outs = llm.generate(prompt, greedy(6))
    assert len(outs) == 1
    out = outs[0]
    assert out.prompt == prompt
    assert out.prompt_token_ids == tok.encode(prompt)
    assert out.token_ids == hf_greedy(reference, out.prompt_token_ids, 6)
    assert out.text == tok.decode(out.token_ids)
    assert out.finish_reason == "length" and out.finished
    assert isinstance(out.request_id, str)


def test_generate_list_of_strings_in_input_order(llm, reference):
    tok = llm.get_tokenizer()
    prompts = [text_prompt(n, n) for n in (2, 25, 9, 4, 17)]
    params = [greedy(n) for n in (12, 3, 9, 1, 5)]  # later prompts finish first
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [12, 3, 9, 1, 5]
    assert len({o.request_id for o in outs}) == len(prompts)
    for o, p in zip(outs, params, strict=True):
        assert o.token_ids == hf_greedy(reference, tok.encode(o.prompt), p.max_tokens)


def test_generate_token_id_prompts(llm):
    tok = llm.get_tokenizer()
    texts = [text_prompt(5, 1), text_prompt(3, 8)]
    ids = [tok.encode(t) for t in texts]
    by_ids = llm.generate(ids, greedy(5))
    by_text = llm.generate(texts, greedy(5))
    for a, b, i in zip(by_ids, by_text, ids, strict=True):
        assert a.prompt is None
        assert a.prompt_token_ids == i
        assert (a.token_ids, a.text) == (b.token_ids, b.text)
    (flat,) = llm.generate(ids[0], greedy(5))  # one flat list of ints is one prompt
    assert flat.token_ids == by_ids[0].token_ids
    dicts = llm.generate([{"prompt": texts[0]}, {"prompt_token_ids": ids[1]}], greedy(5))
    assert [d.token_ids for d in dicts] == [b.token_ids for b in by_text]


def test_generate_empty_list(llm):
    assert llm.generate([], greedy(3)) == []


def test_mismatched_sampling_params_length(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a b", "c d", "e f"], [greedy(2), greedy(2)])
    with pytest.raises(ValueError):
        llm.generate({"neither": 1}, greedy(2))


def test_failed_add_aborts_what_was_added(llm):
    ok = text_prompt(3)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([ok, list(range(3, 70))], greedy(4))
    assert llm.engine.num_waiting == llm.engine.num_running == 0


def test_metrics(llm):
    tok = llm.get_tokenizer()
    prompts = [text_prompt(20), text_prompt(3)]
    outs = llm.generate(prompts, [greedy(4), greedy(7)])
    for prompt, out in zip(prompts, outs, strict=True):
        m = out.metrics
        assert m.num_prompt_tokens == len(tok.encode(prompt)) == len(out.prompt_token_ids)
        assert m.num_generated_tokens == len(out.token_ids)
        assert None not in (m.first_scheduled_time, m.first_token_time, m.finished_time)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token is not None and m.time_to_first_token >= 0


def test_logprobs_match_transformers(llm, reference):
    prompt = text_prompt(9, 4)
    (out,) = llm.generate(prompt, greedy(6, logprobs=3))
    assert out.logprobs is not None and len(out.logprobs) == 6
    full = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.inference_mode():
        logits = reference(full).logits[0]
    n = len(out.prompt_token_ids)
    expected = torch.log_softmax(logits[n - 1 : n - 1 + 6].float(), dim=-1)
    for i, (lp, token) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(expected[i, token].item(), abs=1e-3)
        assert len(lp.top) == 3
        assert max(lp.top, key=lp.top.get) == token  # greedy: the chosen token is the most likely
        top_ids = expected[i].topk(3).indices.tolist()
        assert list(lp.top) == top_ids
        for t, v in lp.top.items():
            assert v == pytest.approx(expected[i, t].item(), abs=1e-3)
    (plain,) = llm.generate(prompt, greedy(6))
    assert plain.logprobs is None
    (zero,) = llm.generate(prompt, greedy(2, logprobs=0))
    assert zero.logprobs is not None and [lp.top for lp in zero.logprobs] == [{}, {}]


def test_stream_concatenates_to_generate_text(llm):
    for prompt, params in [
        (text_prompt(6), greedy(10)),
        ("🌹 中文 é", SamplingParams(temperature=1.5, seed=3, max_tokens=24, ignore_eos=True)),
    ]:
        (expected,) = llm.generate(prompt, params)
        deltas = list(llm.stream(prompt, params))
        assert all(deltas)
        assert "".join(deltas) == expected.text
        for d in deltas[:-1]:
            assert not d.endswith("\ufffd")


def test_stream_closed_early_aborts(llm):
    gen = llm.stream(text_prompt(4), greedy(30))
    next(gen)
    assert llm.engine.num_running == 1
    gen.close()
    assert not llm.engine.has_unfinished()


def test_priority_in_generate():
    model, tok = build_preset("tiny-gpt2")
    llm = LLM(model, tok, device="cpu", max_num_seqs=1, max_model_len=32)
    outs = llm.generate([text_prompt(3)] * 3, greedy(2), priority=[2, 0, 1])
    m = [o.metrics for o in outs]
    assert m[1].finished_time <= m[2].first_scheduled_time
    assert m[2].finished_time <= m[0].first_scheduled_time


def test_model_without_tokenizer_serves_token_ids(llm):
    model, _ = build_preset(PRESET)
    bare = LLM(model, device="cpu", max_num_seqs=2, max_model_len=64)
    assert bare.get_tokenizer() is None
    tok = llm.get_tokenizer()
    ids = [tok.encode(text_prompt(5)), tok.encode(text_prompt(8, 3))]
    outs = bare.generate(ids, greedy(6))
    with_tok = llm.generate(ids, greedy(6))
    for a, b in zip(outs, with_tok, strict=True):
        assert a.text == ""
        assert a.token_ids == b.token_ids
        assert a.finish_reason == "length"
    with pytest.raises(ValueError, match="tokenizer"):
        bare.generate("some text", greedy(2))


def test_llm_from_preset_name():
    llm = LLM("tiny-gpt2", device="cpu", max_num_seqs=1, max_model_len=32)
    (out,) = llm.generate("hello world", greedy(3))
    assert len(out.token_ids) == 3 and out.text == llm.get_tokenizer().decode(out.token_ids)


@pytest.mark.timeout(20)  # the stream used to spin forever on empty steps: fail fast instead
def test_interleaved_streams_each_get_their_whole_text():
    """Two streams consumed alternately: every step's output must reach the stream it belongs to."""
    model, tok = build_preset("tiny-gpt2")
    llm = LLM(model, tok, device="cpu", max_num_seqs=4, max_model_len=64)
    pa, pb = text_prompt(5), text_prompt(7, 3)
    (ea,) = llm.generate(pa, greedy(8))
    (eb,) = llm.generate(pb, greedy(4))
    ga, gb = llm.stream(pa, greedy(8)), llm.stream(pb, greedy(4))
    got_a, got_b = next(ga), next(gb)
    got_a += "".join(ga)  # runs the engine until a finishes; b (shorter) finishes meanwhile
    assert got_a == ea.text
    assert llm.engine.num_running == 0
    got_b += "".join(gb)  # b's remaining text must still come out, and the generator must end
    assert got_b == eb.text


@pytest.mark.timeout(20)  # the stream used to spin forever on empty steps: fail fast instead
def test_generate_while_a_stream_is_open():
    model, tok = build_preset("tiny-gpt2")
    llm = LLM(model, tok, device="cpu", max_num_seqs=4, max_model_len=64)
    ps, pg = text_prompt(6, 2), text_prompt(4, 9)
    (es,) = llm.generate(ps, greedy(5))
    stream = llm.stream(ps, greedy(5))
    first = next(stream)
    (g,) = llm.generate(pg, greedy(10))  # runs the engine: the stream's request finishes in here
    assert g.finish_reason == "length"
    assert first + "".join(stream) == es.text


def test_bfloat16_engine_and_progress_bar():
    llm = LLM("tiny-gpt2", device="cpu", dtype="bfloat16", max_num_seqs=2, max_model_len=32)
    assert llm.engine.cache.k[0].dtype == torch.bfloat16
    outs = llm.generate(["hello world", "bonjour"], greedy(4), use_tqdm=True)
    assert [len(o.token_ids) for o in outs] == [4, 4]
    assert all(o.text == llm.get_tokenizer().decode(o.token_ids) for o in outs)
