"""Decode attention row groups and the sorting of KV rows by context length (rose.engine.slot_order).

These matter for the SDPA decode path (CUDA, non-float32 dtypes, ROSE_ATTENTION_BACKEND=sdpa): the engine tests here
force it; the CPU kernels read exact lengths and need neither.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import drain, greedy, hf_greedy, make_engine

from rose.engine import slot_order
from rose.engine.kv_cache import KVCache
from rose.engine.layer_spec import LayerSpec
from rose.engine.presets import build_preset
from rose.engine.slot_order import decode_groups, padded_cost, plan_reorder


def _check_cover(lengths: list[int], groups: list[tuple[int, int, int]]) -> None:
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    for (a, b, longest), nxt in zip(groups, groups[1:] + [None], strict=True):
        assert a < b and longest == max(lengths[a:b])
        if nxt is not None:
            assert nxt[0] == b


def test_equal_lengths_are_one_group():
    assert decode_groups([100] * 64) == [(0, 64, 100)]
    assert decode_groups([]) == []


def test_sorted_mixed_lengths_split_into_tight_groups():
    rng = random.Random(0)
    lengths = sorted((rng.randint(16, 1000) for _ in range(64)), reverse=True)
    groups = decode_groups(lengths)
    _check_cover(lengths, groups)
    assert 1 < len(groups) <= slot_order.MAX_GROUPS
    one_call = len(lengths) * max(lengths)
    assert padded_cost(lengths) < 0.75 * one_call


def test_a_split_that_saves_little_is_not_made():
    # cutting off the last row would save 1 position per row: far below what one more call costs
    lengths = [50] * 7 + [49]
    assert decode_groups(lengths) == [(0, 8, 50)]


def test_unsorted_groups_still_cover_every_row_with_its_own_max():
    rng = random.Random(1)
    lengths = [rng.randint(1, 500) for _ in range(100)]
    _check_cover(lengths, decode_groups(lengths))


def test_plan_reorder_sorts_longest_first_when_it_pays():
    lengths = [10, 600, 12, 580, 15, 590, 11, 620]
    order = plan_reorder(lengths, [n - 1 for n in lengths])
    assert order is not None
    assert [lengths[i] for i in order] == sorted(lengths, reverse=True)
    assert plan_reorder(sorted(lengths, reverse=True), lengths) is None


def test_plan_reorder_skips_a_sort_that_copies_more_than_it_saves():
    # one short row among long ones costs little padding; sorting would move most rows
    lengths = [300] * 3 + [290] + [300] * 12
    assert plan_reorder(lengths, lengths) is None


def test_move_rows_applies_a_permutation():
    # two layers of different geometry (K and V head dims differ in the second)
    specs = [LayerSpec(2, 2, 3, 3), LayerSpec(4, 1, 5, 2)]
    cache = KVCache(specs, 4, 8, torch.float32, torch.device("cpu"))
    for t in cache.k + cache.v:
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in cache.k + cache.v]
    # rows 0 -> 2, 2 -> 1, 1 -> 0 (a cycle: every source must be read before it is overwritten)
    cache.move_rows([0, 2, 1], [2, 1, 0], 5)
    for old, new in zip(before, cache.k + cache.v, strict=True):
        torch.testing.assert_close(new[2, :, :5], old[0, :, :5])
        torch.testing.assert_close(new[1, :, :5], old[2, :, :5])
        torch.testing.assert_close(new[0, :, :5], old[1, :, :5])
        torch.testing.assert_close(new[3], old[3])


@pytest.fixture
def sdpa(monkeypatch):
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "sdpa")


@pytest.fixture
def moved(monkeypatch) -> list[int]:
    """How many rows each re-sort of the KV store moved."""
    counts: list[int] = []
    real_move_rows = KVCache.move_rows

    def spy(self, src, dst, length):
        counts.append(len(src))
        real_move_rows(self, src, dst, length)

    monkeypatch.setattr(KVCache, "move_rows", spy)
    return counts


def test_engine_sorts_rows_and_keeps_greedy_outputs(tokenizer, monkeypatch, sdpa, moved):
    """Mixed prompt lengths admitted in arbitrary order: the engine sorts rows, splits decode attention into groups,
    and every request still gets exactly transformers' greedy tokens."""
    engine = make_engine("tiny-llama", max_num_seqs=6, max_model_len=320)
    groups_seen: list[int] = []
    real_groups = slot_order.decode_groups
    monkeypatch.setattr(
        "rose.engine.model_runner.decode_groups",
        lambda lengths: groups_seen.append(len(g := real_groups(lengths))) or g,
    )
    rng = random.Random(3)
    prompt_lens = [8, 150, 12, 160, 20, 140, 9, 170]
    reqs = []
    for i, n in enumerate(prompt_lens):
        ids = [rng.randrange(3, 8192) for _ in range(n)]
        reqs.append((f"r{i}", ids, rng.randint(4, 24)))
        engine.add_request(f"r{i}", ids, greedy(reqs[-1][2]))
    run = drain(engine)

    assert moved, "the rows were never re-sorted"
    assert max(groups_seen) > 1, "decode attention never split the rows into groups"
    reference, _ = build_preset("tiny-llama")
    for rid, ids, n in reqs:
        assert run.outputs[rid].token_ids == hf_greedy(reference, ids, n), rid
    assert engine.kv_slots_used == 0


def _mixed_run() -> dict[str, list[int]]:
    engine = make_engine("tiny-llama", max_num_seqs=4, max_model_len=256)
    rng = random.Random(5)
    for i in range(10):
        ids = [rng.randrange(3, 8192) for _ in range(rng.choice((6, 120)))]
        engine.add_request(f"r{i}", ids, greedy(rng.randint(3, 30)))
    return {rid: out.token_ids for rid, out in drain(engine).outputs.items()}


def test_sorting_and_grouping_do_not_change_outputs(monkeypatch, sdpa):
    with_sorting = _mixed_run()
    monkeypatch.setattr(slot_order, "REORDER_HORIZON", 0)
    monkeypatch.setattr(slot_order, "MAX_GROUPS", 1)
    assert _mixed_run() == with_sorting


def test_row_sorting_with_prefix_caching_keeps_outputs(sdpa, moved):
    """Rows re-sorted while the prefix cache copies prefixes from running rows and keeps finished ones in spare
    rows: every request still gets transformers' greedy tokens, and prefixes were reused."""
    engine = make_engine(
        "tiny-llama", max_num_seqs=8, max_model_len=320, enable_prefix_caching=True, prefix_block_size=8
    )
    rng = random.Random(11)
    shared = [rng.randrange(3, 8192) for _ in range(96)]
    reqs = []
    for i in range(16):
        if i % 2:
            ids = shared + [rng.randrange(3, 8192) for _ in range(rng.randint(4, 40))]
        else:
            ids = [rng.randrange(3, 8192) for _ in range(rng.randint(5, 12))]
        reqs.append((f"r{i}", ids, rng.randint(3, 20)))
        engine.add_request(f"r{i}", ids, greedy(reqs[-1][2]))
    run = drain(engine)

    assert moved, "the rows were never re-sorted"
    assert engine.get_stats()["prefix_cache_hits"] > 0
    reference, _ = build_preset("tiny-llama")
    for rid, ids, n in reqs:
        assert run.outputs[rid].token_ids == hf_greedy(reference, ids, n), rid
