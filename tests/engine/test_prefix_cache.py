"""Prefix caching: reused K/V gives the same tokens as recomputing it, and the cache reports its hits."""

from __future__ import annotations

import random

from engine_helpers import greedy, make_engine

from rose.engine.prefix_cache import PrefixCache, RetainedRow, block_hashes
from rose.engine.sampling_params import SamplingParams


def _run(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
    return [done[str(i)] for i in range(len(prompts))]


def _shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 8192) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 8192) for _ in range(suffix_len)] for _ in range(n)]


def test_shared_prefix_outputs_identical_and_prefix_computed_once():
    prompts = _shared_prefix_prompts(12, 80, 7)
    params = [greedy(6 + i % 4) for i in range(12)]
    off = _run(make_engine("tiny-llama", max_num_seqs=4, max_model_len=128), prompts, params)
    engine = make_engine(
        "tiny-llama", max_num_seqs=4, max_model_len=128, enable_prefix_caching=True, prefix_block_size=16
    )
    on = _run(engine, prompts, params)
    assert on == off
    stats = engine.get_stats()
    assert stats["prefix_cache_queries"] == 12
    # requests arriving together wait for the first to compute the prefix, then all reuse its 80 tokens
    assert stats["prefix_cache_hits"] == 11
    assert stats["prefix_cache_hit_tokens"] == 11 * 80


def test_prefix_reused_from_a_finished_request_and_from_its_generated_tokens():
    engine = make_engine(
        "tiny-gpt2",
        max_num_seqs=2,
        max_model_len=256,
        enable_prefix_caching=True,
        prefix_cache_slots=2,
        prefix_block_size=8,
    )
    reference = make_engine("tiny-gpt2", max_num_seqs=2, max_model_len=256)
    first = _shared_prefix_prompts(1, 40, 0, seed=3)[0]
    (out1,) = _run(engine, [first], [greedy(20)])
    # a second turn: the first prompt, what was generated, and a new message
    second = first + out1 + [11, 12, 13, 14, 15]
    (out2,) = _run(engine, [second], [greedy(10)])
    (ref2,) = _run(reference, [second], [greedy(10)])
    assert out2 == ref2
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] == 1
    # the finished row held prompt + output - 1 computed tokens: 59, i.e. 7 full blocks of 8
    assert stats["prefix_cache_hit_tokens"] == 56


def test_lru_budget_evicts_the_least_recently_used_row():
    engine = make_engine(
        "tiny-llama",
        max_num_seqs=1,
        max_model_len=128,
        enable_prefix_caching=True,
        prefix_cache_slots=1,
        prefix_block_size=8,
    )
    a, b = _shared_prefix_prompts(1, 32, 4, seed=1)[0], _shared_prefix_prompts(1, 32, 4, seed=2)[0]
    _run(engine, [a], [greedy(2)])
    _run(engine, [b], [greedy(2)])  # takes the only spare row: a's K/V is gone
    _run(engine, [a[:32] + [7, 7, 7]], [greedy(2)])
    assert engine.prefix_cache.stats.evicted >= 1
    assert engine.get_stats()["prefix_cache_hits"] == 0


def test_sampled_requests_with_cache_match_without():
    prompts = _shared_prefix_prompts(6, 48, 5, seed=9)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True)
        for i in range(6)
    ]
    off = _run(make_engine("tiny-qwen2", max_num_seqs=3, max_model_len=96), prompts, params)
    on = _run(
        make_engine("tiny-qwen2", max_num_seqs=3, max_model_len=96, enable_prefix_caching=True),
        prompts,
        params,
    )
    assert on == off


def test_hash_collision_never_reuses_other_tokens():
    cache = PrefixCache(block_size=4, first_spare_slot=2, num_spare_slots=1)
    wanted = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # a row whose index entries claim wanted's hashes but whose tokens differ (a forced collision)
    impostor = RetainedRow(slot=2, token_ids=[1, 2, 3, 4, 0, 0, 0, 0])
    for h in block_hashes(wanted, 4):
        cache._index[h] = impostor

    class _Seq:
        prompt_token_ids = wanted
        num_prompt_tokens = len(wanted)
        block_hashes = block_hashes(wanted, 4)

    assert cache.match(_Seq()) is None


def test_block_hashes_chain_over_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same second block, different first block: different hash
