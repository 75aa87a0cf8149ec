"""`SamplingParams.n` (rose.engine.parallel_sampling): n choices of one prompt, each the request it would be alone
with seed + index, streamed under the request's id with their `index`, finished together as one RequestOutput; the
prompt computed once and its full KV blocks shared (with and without prefix caching), also when the pool is short
and sequences are preempted; an abort ends every choice."""

from __future__ import annotations

import json

import jsonschema
import pytest
from engine_helpers import make_engine

from rose.engine.sampling_params import SamplingParams

PROMPT = list(range(10, 210))  # 200 tokens: 12 full blocks of 16 and 8 tokens more


def engine(**kwargs):
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("block_size", 16)
    kwargs.setdefault("max_num_seqs", 16)
    return make_engine("tiny-llama", **kwargs)


def run(eng, on_step=None):
    """Step `eng` to the end: {request id: final output}, and each (request id, index)'s streamed tokens, text and
    finish reason, checked against the final output."""
    finals, tokens, texts, reasons = {}, {}, {}, {}
    while eng.has_unfinished():
        outs = eng.step()
        for out in outs:
            key = (out.request_id, out.index)
            assert key not in reasons, f"{key} streamed after it finished"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            texts[key] = texts.get(key, "") + out.new_text
            if out.finish_reason is not None:
                reasons[key] = out.finish_reason
            if out.finished:
                finals[out.request_id] = out.output
            else:
                assert out.output is None
        if on_step is not None:
            on_step(eng)
    for rid, final in finals.items():
        assert [c.index for c in final.outputs] == list(range(len(final.outputs)))
        for choice in final.outputs:
            key = (rid, choice.index)
            assert tokens.get(key, []) == choice.token_ids and texts.get(key, "") == choice.text
            assert reasons[key] == choice.finish_reason
        assert final.metrics.num_generated_tokens == sum(len(c.token_ids) for c in final.outputs)
    return finals


def alone(prompt, params: SamplingParams, n: int, **kwargs) -> list[list[int]]:
    """The tokens of each choice run as its own request (seed + index), on a fresh engine."""
    eng = engine(**kwargs)
    for i in range(n):
        seed = None if params.seed is None else params.seed + i
        eng.add_request(str(i), prompt, SamplingParams(**{**params.to_dict(), "n": 1, "seed": seed}))
    finals = run(eng)
    return [finals[str(i)].token_ids for i in range(n)]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_choices_are_each_seeded_request_and_share_the_prompt(prefix_caching: bool) -> None:
    params = SamplingParams(n=8, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, logprobs=2)
    eng = engine(enable_prefix_caching=prefix_caching)
    eng.add_request("r", PROMPT, params)
    blocks: list[int] = []
    [final] = run(eng, on_step=lambda e: blocks.append(e.kv_blocks_used)).values()
    assert len(final.outputs) == 8 and final.prompt_token_ids == PROMPT
    assert [c.token_ids for c in final.outputs] == alone(PROMPT, params, 8)
    assert len({tuple(c.token_ids) for c in final.outputs}) == 8
    assert all(len(c.logprobs) == 6 for c in final.outputs)
    # the prompt once, and each other choice only its last, partial block (8 tokens)
    assert eng.get_stats()["num_prefill_tokens"] == 200 + 7 * 8
    # 12 shared full blocks + 8 choices' own last blocks, against 8 x 13 for 8 separate requests
    assert max(blocks) == 12 + 8

    separate = engine(enable_prefix_caching=prefix_caching)
    for i in range(8):
        separate.add_request(str(i), PROMPT, SamplingParams(max_tokens=6, seed=11 + i, ignore_eos=True))
    run(separate)
    expected = 200 * 8 if not prefix_caching else 200 + 7 * 8  # the prefix cache shares it too
    assert separate.get_stats()["num_prefill_tokens"] == expected


@pytest.mark.parametrize(
    ("max_tokens", "max_num_seqs"),
    [(1, 16), (6, 4)],
    ids=["first-choice-done-in-its-prefill-step", "choices-wait-for-a-slot"],
)
def test_the_prompt_is_computed_once_however_late_the_other_choices_start(max_tokens, max_num_seqs) -> None:
    """The first choice may be done before the others start (one token: it finishes in the step that computes the
    prompt; or the others wait for a free slot): the prompt's blocks are held for them until each has started."""
    params = SamplingParams(n=8, max_tokens=max_tokens, seed=2, ignore_eos=True)
    eng = engine(max_num_seqs=max_num_seqs)
    eng.add_request("r", PROMPT, params)
    final = run(eng)["r"]
    assert [c.token_ids for c in final.outputs] == alone(PROMPT, params, 8)
    assert eng.get_stats()["num_prefill_tokens"] == 200 + 7 * 8
    assert eng.kv_blocks_used == 0  # nothing held once every choice has started and finished


def test_an_abort_before_every_choice_started_lets_the_held_prompt_go() -> None:
    eng = engine(max_num_seqs=2)
    eng.add_request("r", PROMPT, SamplingParams(n=6, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.kv_blocks_used > 0
    out = eng.abort("r")
    assert len(out.outputs) == 6 and eng.kv_blocks_used == 0 and not eng.has_unfinished()


def test_greedy_choices_are_the_same_and_the_request_id_is_the_parents() -> None:
    eng = engine()
    eng.add_request("g", PROMPT[:40], SamplingParams(n=3, max_tokens=5, temperature=0, ignore_eos=True))
    eng.add_request("single", PROMPT[:40], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finals = run(eng)
    assert set(finals) == {"g", "single"}
    assert [c.token_ids for c in finals["g"].outputs] == [finals["single"].token_ids] * 3
    assert finals["g"].text == finals["g"].outputs[0].text and finals["g"].finished


def test_choices_that_finish_at_once_or_under_preemption_are_still_their_seeded_requests() -> None:
    # max_tokens 1: the first choice finishes in the step that computes the prompt, before the others start
    quick = SamplingParams(n=4, max_tokens=1, seed=3, ignore_eos=True)
    eng = engine()
    eng.add_request("q", PROMPT, quick)
    assert [c.token_ids for c in run(eng)["q"].outputs] == alone(PROMPT, quick, 4)
    # a pool of 20 blocks: 4 choices of 200 + 40 tokens (12 shared blocks + 3 each) cannot all grow; some are
    # preempted and recomputed
    long = SamplingParams(n=4, max_tokens=40, seed=5, ignore_eos=True)
    eng = engine(num_gpu_blocks_override=20)
    eng.add_request("p", PROMPT, long)
    final = run(eng)["p"]
    assert eng.get_stats()["num_preemptions"] > 0
    assert [c.token_ids for c in final.outputs] == alone(PROMPT, long, 4)
    assert eng.kv_blocks_used == 0


def test_abort_ends_every_choice() -> None:
    eng = engine()
    eng.add_request("a", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    out = eng.abort("a")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3 and len(out.outputs) == 3
    assert not eng.has_unfinished() and eng.kv_blocks_used == 0
    assert eng.abort("a") is None
    eng.add_request("a", PROMPT, SamplingParams(n=2, max_tokens=2))  # the id is free again
    assert len(run(eng)["a"].outputs) == 2


def test_constrained_choices_each_follow_the_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    eng = engine(disable_any_whitespace=True)
    params = SamplingParams(n=3, max_tokens=40, seed=2, structured_outputs={"json": schema})
    eng.add_request("c", "json please", params)
    final = run(eng)["c"]
    for choice in final.outputs:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.text), schema)
    eng.close()


@pytest.mark.parametrize("n", [0, -1, 129, 2.0, True, "2"])
def test_bad_n_is_refused(n) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams.n must be an integer in \[1, 128\]"):
        SamplingParams(n=n)


def test_a_request_whose_choice_id_is_taken_is_refused_whole() -> None:
    eng = engine()
    eng.add_request("1_x", PROMPT[:10], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="'1_x' \\(a choice of 'x'\\)"):
        eng.add_request("x", PROMPT[:10], SamplingParams(n=2, max_tokens=2))
    assert set(run(eng)) == {"1_x"}


def test_an_idle_engine_lets_a_held_prompt_go_when_the_next_request_needs_its_blocks() -> None:
    """The blocks held for a choice not admitted yet are given back when nothing runs and the head of the queue
    (here a preempted request) cannot be admitted without them: the engine never waits on itself."""
    eng = make_engine(
        "tiny-llama",
        block_size=4,
        num_gpu_blocks_override=13,
        max_num_batched_tokens=5,
        max_num_seqs=4,
        max_model_len=44,
    )
    eng.add_request("A", [11], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.add_request("B", list(range(100, 140)), SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3))
    finals = {}
    for _ in range(500):  # it used to step forever, every request waiting
        if not eng.has_unfinished():
            break
        finals.update((o.request_id, o.output) for o in eng.step() if o.finished)
    assert set(finals) == {"A", "B"}
    assert len(finals["A"].token_ids) == 30 and len(finals["B"].outputs) == 2
    assert eng.kv_blocks_used == 0
