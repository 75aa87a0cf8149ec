"""Prefix caching by shared blocks: reused K/V gives the same tokens as recomputing it, a hit copies nothing, cached
blocks are reference-counted and evicted least recently used first, and the cache reports its hits."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import drain, greedy, make_engine

from rose.engine.block_pool import BlockPool
from rose.engine.kv_cache import KVCache
from rose.engine.layer_spec import LayerSpec
from rose.engine.prefix_cache import PrefixCache, block_hashes
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
        "tiny-llama", max_num_seqs=4, max_model_len=128, enable_prefix_caching=True, block_size=16
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
        block_size=8,
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


def test_lru_evicts_the_least_recently_used_blocks():
    # a pool of 10 blocks of 8: each request takes 5 (36-token prompt + 2 tokens), so b's evict a's cached blocks
    engine = make_engine(
        "tiny-llama",
        max_num_seqs=1,
        max_model_len=40,
        max_kv_cache_bytes=10 * 8 * 4096,  # tiny-llama: 4 KiB of K/V per token
        enable_prefix_caching=True,
        block_size=8,
    )
    assert engine.kv_blocks_total == 5  # capped at max_num_seqs x max_model_len
    a, b = _shared_prefix_prompts(1, 32, 4, seed=1)[0], _shared_prefix_prompts(1, 32, 4, seed=2)[0]
    _run(engine, [a], [greedy(2)])
    _run(engine, [b], [greedy(2)])  # takes every block: a's cached K/V is gone
    _run(engine, [a[:32] + [7, 7, 7]], [greedy(2)])
    stats = engine.get_stats()
    assert stats["prefix_cache_evicted_blocks"] >= 4
    assert stats["prefix_cache_hits"] == 0
    _run(engine, [a[:32] + [9, 9, 9]], [greedy(2)])  # the previous request cached a's prefix again
    assert engine.get_stats()["prefix_cache_hits"] == 1


def test_a_hit_shares_the_blocks_and_copies_nothing(monkeypatch):
    engine = make_engine(
        "tiny-llama", max_num_seqs=2, max_model_len=64, enable_prefix_caching=True, block_size=8
    )
    copies = []
    for name in ("copy_", "index_copy_"):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            copies.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    prompt = _shared_prefix_prompts(1, 24, 3, seed=4)[0]
    engine.add_request("a", prompt, greedy(20))
    engine.step()
    a = engine.get_request("a")
    engine.add_request("b", prompt[:24] + [5, 6], greedy(2))
    engine.step()
    b = engine.get_request("b")
    assert b.block_ids[:3] == a.block_ids[:3]  # the prompt's 3 full blocks, held by both
    assert all(engine.kv_cache_manager.pool.refs(block) == 2 for block in a.block_ids[:3])
    assert b.num_computed_tokens == 24 + 2 and b.output_token_ids  # only its own 2 tokens were computed
    assert copies == []  # no K/V was copied for the hit
    assert engine.get_stats()["prefix_cache_hit_tokens"] == 24
    drain(engine, stepped_before=True)
    assert engine.kv_blocks_used == 0  # every reference given back


def test_block_pool_refcounts_and_eviction_order():
    pool = BlockPool(4, 2)
    first = pool.allocate(2)
    second = pool.allocate(2)
    assert pool.allocate(1) is None and pool.num_free == 0
    for i, block in enumerate(first):
        pool.cache(block, 100 + i, (i, i))
    pool.share(first)  # a second holder
    pool.free(first)
    assert pool.num_free == 0 and pool.refs(first[0]) == 1
    pool.free(first)  # cached, nobody holds them: free, still found
    pool.free(second)  # uncached: handed out first
    assert pool.num_free == 4
    assert pool.lookup([100, 101], [(0, 0), (1, 1)]) == first
    assert pool.lookup([100, 101], [(0, 0), (1, 2)]) == first[:1]  # tokens differ: no hit past them
    assert sorted(pool.allocate(2)) == sorted(second) and pool.num_evicted == 0
    # then the cached blocks, the sequence's last block first (least likely to be shared)
    assert pool.allocate(1) == [first[1]] and pool.num_evicted == 1
    assert pool.lookup([100, 101], [(0, 0), (1, 1)]) == first[:1]
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([first[1], first[1]])


def test_the_store_is_shaped_in_blocks():
    # two layers of their own geometry (K and V head dims may differ): [num_blocks, block_size, kv_heads, dim]
    specs = [LayerSpec(8, 4, 32, 32), LayerSpec(6, 2, 16, 8)]
    cache = KVCache(specs, 3, 4, torch.float32, torch.device("cpu"))
    assert [tuple(k.shape) for k in cache.k] == [(3, 4, 4, 32), (3, 4, 2, 16)]
    assert [tuple(v.shape) for v in cache.v] == [(3, 4, 4, 32), (3, 4, 2, 8)]
    per_token = KVCache.bytes_per_token(specs, torch.float32)
    assert per_token == (4 * 64 + 2 * 24) * 4
    assert cache.nbytes == 3 * 4 * per_token and cache.num_blocks == 3 and cache.block_size == 4


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
    pool = BlockPool(4, 4)
    wanted = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    hashes = block_hashes(wanted, 4)
    # blocks indexed under wanted's hashes but holding other tokens (a forced collision)
    impostors = pool.allocate(2)
    pool.cache(impostors[0], hashes[0], (1, 2, 3, 4))
    pool.cache(impostors[1], hashes[1], (0, 0, 0, 0))

    class _Seq:
        all_token_ids = wanted
        num_prefill_tokens = len(wanted)
        block_hashes = hashes

    assert PrefixCache(pool).lookup(_Seq()) == impostors[:1]  # the true first block only


def test_block_hashes_chain_over_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same second block, different first block: different hash
