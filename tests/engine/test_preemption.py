"""Admission by free blocks and preemption by recompute when decoding sequences outgrow the pool.

A preempted request gives its blocks back and is prefilled again (prompt and generated tokens) when readmitted: its
greedy output equals an unpreempted run's, its stream has every token and text delta exactly once, and its seeded
sampling draws what it would have drawn alone.
"""

from __future__ import annotations

import random

import pytest
from engine_helpers import drain, greedy, make_engine

from rose.engine.sampling_params import SamplingParams

TOKEN_BYTES = 4096  # tiny-llama: 4 layers x 4 KV heads x 32 dims, K and V, float32


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 8192) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def _engine(pool_tokens: int | None, **kwargs):
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_model_len", 96)
    kwargs.setdefault("block_size", 16)  # the tests count in blocks of 16
    if pool_tokens is not None:
        kwargs["max_kv_cache_bytes"] = pool_tokens * TOKEN_BYTES
    return make_engine("tiny-llama", **kwargs)


def _run(engine, prompts, params, priorities=None):
    for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), ids, sp, priority=priorities[i] if priorities else 0)
    return drain(
        engine
    )  # checks each request's streamed tokens, logprobs and text add up to its final output


def test_greedy_under_memory_pressure_equals_an_unconstrained_run():
    prompts = _prompts(12, seed=1)
    params = [greedy(20 + i % 3 * 10) for i in range(12)]
    free = _run(_engine(None), prompts, params)
    tight = _engine(128)  # 8 blocks of 16: far fewer than the 12 requests will hold at their longest
    pressed = _run(tight, prompts, params)
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0
    assert set(pressed.outputs) == set(free.outputs) == {str(i) for i in range(12)}
    for rid, out in free.outputs.items():
        assert pressed.outputs[rid].token_ids == out.token_ids, rid
        assert pressed.outputs[rid].text == out.text, rid
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_a_preempted_stream_has_each_token_once():
    engine = _engine(96, max_num_seqs=4)
    prompts = _prompts(4, seed=2)
    run = _run(engine, prompts, [greedy(40, logprobs=2) for _ in prompts])
    assert engine.get_stats()["num_preemptions"] > 0
    for rid, out in run.outputs.items():
        assert len(out.token_ids) == 40 and len(out.logprobs) == 40
        # one step output per token (drain already checked they concatenate to the final output)
        per_step = [o for step in run.step_outputs for o in step if o.request_id == rid]
        assert sum(len(o.new_token_ids) for o in per_step) == 40
        assert "".join(o.new_text for o in per_step) == out.text


def test_seeded_sampling_is_reproducible_across_preemptions():
    prompts = _prompts(8, seed=3)
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=50 + i, max_tokens=30, ignore_eos=True)
        for i in range(8)
    ]
    free = _run(_engine(None), prompts, params)
    tight = _engine(112)
    pressed = _run(tight, prompts, params)
    assert tight.get_stats()["num_preemptions"] > 0
    for rid, out in free.outputs.items():
        assert pressed.outputs[rid].token_ids == out.token_ids, rid


def test_the_least_important_request_is_preempted():
    engine = _engine(96, max_num_seqs=4)
    prompts = _prompts(4, seed=4)
    priorities = [0, 0, 5, 0]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, greedy(40), priority=priorities[i])
    first_victims: list[set[str]] = []

    def preempted(engine, _outs):
        if not first_victims:
            counts = {str(i): engine.get_request(str(i)) for i in range(4)}
            victims = {rid for rid, seq in counts.items() if seq is not None and seq.num_preemptions}
            if victims:
                first_victims.append(victims)

    run = drain(engine, on_step=preempted)
    assert first_victims == [{"2"}]  # the one request of lower priority goes first
    assert set(run.outputs) == {"0", "1", "2", "3"}
    assert run.outputs["2"].metrics.num_preemptions >= 1
    assert (
        sum(out.metrics.num_preemptions for out in run.outputs.values())
        == engine.get_stats()["num_preemptions"]
    )


def test_admission_is_by_free_blocks_not_by_the_batch_cap():
    # the cap allows 16; 10 blocks of 16 hold the prompts of only some of the 40-token requests
    engine = _engine(160, max_num_seqs=16, max_num_batched_tokens=512)
    rng = random.Random(5)
    for i in range(8):
        engine.add_request(str(i), [rng.randrange(3, 8192) for _ in range(40)], greedy(4))
    engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 5  # 3 blocks each: 9 of 10 held
    assert engine.kv_blocks_used == 9
    drain(engine, stepped_before=True)
    # short prompts: many more sequences than the pool has room for at max_model_len
    for i in range(16):
        engine.add_request(f"s{i}", [rng.randrange(3, 8192) for _ in range(8)], greedy(4))
    engine.step()
    assert engine.num_running == 9 > 160 // 96  # 10 blocks, one of them the watermark
    drain(engine, stepped_before=True)


def test_num_admittable_counts_blocks_and_the_batch_cap():
    engine = _engine(160, max_num_seqs=6)
    assert engine.num_admittable(40) == 3  # 10 blocks, 3 per request
    assert engine.num_admittable(8) == 6  # the batch cap
    engine.add_request("a", [5] * 40, greedy(2))
    assert engine.num_admittable(40) == 2  # the waiting request's 3 blocks are spoken for
    engine.step()
    assert engine.num_admittable(40) == 2 and engine.num_admittable() == 2  # default: the mean prompt (40)
    drain(engine, stepped_before=True)
    assert engine.num_admittable(40) == 3


def test_an_idle_engine_always_admits_one_request():
    """Long prompts seen so far must not make an idle engine refuse work for good (a worker's intake asks it)."""
    engine = _engine(1600, max_num_seqs=2, max_model_len=1600)  # 100 blocks, a watermark of 1
    engine.add_request("long", [5] * 1590, greedy(1))  # the mean prompt is now 100 blocks
    drain(engine)
    assert not engine.has_unfinished() and engine.num_admittable() == 1
    engine.add_request("short", [5] * 8, greedy(4))
    engine.step()
    assert engine.num_admittable(8) == 1  # once busy, blocks and the batch cap decide


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_preemption_with_prefix_caching_keeps_outputs(backend, monkeypatch):
    """Recompute after preemption finds the preempted request's own cached blocks (and shared prefixes)."""
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", backend)
    rng = random.Random(6)
    shared = [rng.randrange(3, 8192) for _ in range(32)]
    prompts = [shared + [rng.randrange(3, 8192) for _ in range(rng.randint(2, 12))] for _ in range(8)]
    params = [greedy(30) for _ in prompts]
    free = _run(_engine(None), prompts, params)
    tight = _engine(144, enable_prefix_caching=True)
    pressed = _run(tight, prompts, params)
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    # readmissions are counted apart: the hit rate of new requests is not inflated by memory pressure
    assert stats["prefix_cache_queries"] == len(prompts)
    assert stats["prefix_cache_preempted_queries"] == stats["num_preemptions"]
    assert 0 < stats["prefix_cache_preempted_hits"] <= stats["prefix_cache_preempted_queries"]
    for rid, out in free.outputs.items():
        assert pressed.outputs[rid].token_ids == out.token_ids, rid
