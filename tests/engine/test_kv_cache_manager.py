"""rose.engine.kv_cache_manager: the one owner of blocks. Admission takes a prefill's blocks whole or not at all,
above the watermark; growth takes nothing when short; freeing gives every held block back; a step's computed blocks
are cached for prefix hits and passed blocks (windowed models) go back at once."""

from __future__ import annotations

from rose.engine.block_pool import BlockPool
from rose.engine.kv_cache_manager import KVCacheManager
from rose.engine.outputs import RequestMetrics
from rose.engine.sampling_params import SamplingParams
from rose.engine.sequence import PASSED_BLOCK, Sequence


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(), 8, RequestMetrics(0.0), None)


def test_admission_is_whole_or_nothing_and_keeps_the_watermark():
    kv = KVCacheManager(BlockPool(6, 4), watermark_blocks=2)
    seq = _seq(list(range(17)))  # 5 blocks
    assert kv.allocate_prefill(seq, watermark=True) is None  # 6 free - 2 kept < 5
    assert seq.block_ids == [] and kv.num_free == 6
    assert kv.allocate_prefill(seq, watermark=False) == 0  # an idle engine admits without the watermark
    assert len(seq.block_ids) == 5 and kv.num_free == 1


def test_growth_takes_nothing_when_short_and_free_gives_everything_back():
    kv = KVCacheManager(BlockPool(3, 4))
    a, b = _seq(list(range(8)), "a"), _seq(list(range(3)), "b")
    assert kv.allocate_prefill(a, watermark=False) == 0 and kv.allocate_prefill(b, watermark=False) == 0
    assert kv.num_free == 0
    assert kv.allocate_slots(b, 4)  # position 3 is still in b's first block
    assert not kv.allocate_slots(b, 5) and len(b.block_ids) == 1
    kv.free(a)
    assert a.block_ids == [] and kv.num_free == 2
    assert kv.allocate_slots(b, 12) and len(b.block_ids) == 3 and kv.num_used == 3


def test_computed_blocks_are_found_by_the_next_request_with_the_prefix():
    kv = KVCacheManager(BlockPool(8, 4), enable_prefix_caching=True)
    first = _seq(list(range(10)), "first")
    kv.allocate_prefill(first, watermark=False)
    first.num_computed_tokens = 10  # the scheduler's write, after the step
    kv.cache_blocks(first)
    computed = first.block_ids[:2]
    kv.free(first)
    second = _seq(list(range(9)) + [99], "second")
    assert kv.allocate_prefill(second, watermark=False) == 8  # two full blocks of the shared prefix
    assert second.block_ids[:2] == computed and kv.pool.refs(computed[0]) == 1
    assert kv.get_stats()["prefix_cache_hit_tokens"] == 8


def test_passed_blocks_go_back_as_a_window_moves_on():
    # every layer sees 4 positions back: a query at p reads from p - 3 on
    kv = KVCacheManager(BlockPool(8, 4), first_needed=lambda p: max(0, p - 3))
    assert kv.drops_passed_blocks
    seq = _seq(list(range(16)))
    kv.allocate_prefill(seq, watermark=False)
    seq.num_computed_tokens = 16
    kv.cache_blocks(seq)
    assert seq.block_ids[:3] == [PASSED_BLOCK] * 3 and seq.num_dropped_blocks == 3
    assert kv.num_used == 1 and kv.num_tokens_held(seq) == 4
    kv.free(seq)
    assert kv.num_free == 8 and seq.num_dropped_blocks == 0
