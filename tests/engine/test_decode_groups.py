"""Decode attention groups of the SDPA path (rose.engine.decode_groups).

These matter for the SDPA decode path (CUDA, non-float32 dtypes, ROSE_ATTENTION_BACKEND=sdpa): the engine tests here
force it; the CPU kernels read exact lengths and need none.
"""

from __future__ import annotations

import random

import pytest
from engine_helpers import drain, greedy, hf_greedy, make_engine

from rose.engine import decode_groups as decode_groups_module
from rose.engine.decode_groups import decode_groups, padded_cost
from rose.engine.presets import build_preset


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
    assert 1 < len(groups) <= decode_groups_module.MAX_GROUPS
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


@pytest.fixture
def sdpa(monkeypatch):
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", "sdpa")


def test_engine_groups_decode_attention_and_keeps_greedy_outputs(tokenizer, monkeypatch, sdpa):
    """Mixed prompt lengths admitted in arbitrary order: the SDPA path sorts the decoding sequences by length and
    splits their attention into groups, and every request still gets exactly transformers' greedy tokens."""
    engine = make_engine("tiny-llama", max_num_seqs=6, max_model_len=320)
    groups_seen: list[int] = []
    real_groups = decode_groups_module.decode_groups
    monkeypatch.setattr(
        "rose.engine.kv_cache.decode_groups",
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

    assert max(groups_seen) > 1, "decode attention never split the sequences into groups"
    reference, _ = build_preset("tiny-llama")
    for rid, ids, n in reqs:
        assert run.outputs[rid].token_ids == hf_greedy(reference, ids, n), rid
    assert engine.kv_blocks_used == 0


def _mixed_run() -> dict[str, list[int]]:
    engine = make_engine("tiny-llama", max_num_seqs=4, max_model_len=256)
    rng = random.Random(5)
    for i in range(10):
        ids = [rng.randrange(3, 8192) for _ in range(rng.choice((6, 120)))]
        engine.add_request(f"r{i}", ids, greedy(rng.randint(3, 30)))
    return {rid: out.token_ids for rid, out in drain(engine).outputs.items()}


def test_grouping_does_not_change_outputs(monkeypatch, sdpa):
    grouped = _mixed_run()
    monkeypatch.setattr(decode_groups_module, "MAX_GROUPS", 1)
    assert _mixed_run() == grouped


def test_grouped_decode_with_shared_prefix_blocks_keeps_outputs(sdpa):
    """Decode groups gathered from block tables that share prefix blocks (running and finished sequences'):
    every request still gets transformers' greedy tokens, and prefixes were reused."""
    engine = make_engine(
        "tiny-llama", max_num_seqs=8, max_model_len=320, enable_prefix_caching=True, block_size=8
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

    assert engine.get_stats()["prefix_cache_hits"] > 0
    reference, _ = build_preset("tiny-llama")
    for rid, ids, n in reqs:
        assert run.outputs[rid].token_ids == hf_greedy(reference, ids, n), rid
