"""Blocks that every layer's sliding window has passed are given back as a sequence grows.

A model with a window in every layer (tiny mistral: 8 positions) holds about a window's worth of blocks however long
its sequences grow; its tokens stay those of transformers' `generate`, also when the pool is so small that
sequences are preempted and recomputed. A model with one layer that reads the whole context gives nothing back.
"""

from __future__ import annotations

import copy
import random

import pytest
from architectures import prompt_id_range, tiny_model
from engine_helpers import drain, greedy, hf_greedy

from rose.engine.engine import Engine
from rose.engine.sampling_params import SamplingParams

WINDOW = 8  # tiny mistral's sliding window (architectures.py)


@pytest.fixture(scope="module")
def mistral():
    return tiny_model("mistral")


def _engine(model, **kwargs) -> Engine:
    """An engine on a copy of `model` (the engine owns its model; `model` stays transformers' reference)."""
    kwargs.setdefault("block_size", 4)
    return Engine(copy.deepcopy(model), None, device="cpu", dtype="float32", **kwargs)


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*prompt_id_range()) for _ in range(length)] for _ in range(n)]


def _generate_and_check(engine: Engine, model, prompts: list[list[int]], max_tokens: int, on_step=None):
    """Run `prompts` through `engine` at once; each output must be transformers' greedy tokens."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(max_tokens))
    run = drain(engine, on_step=on_step)
    for i, prompt in enumerate(prompts):
        assert run.outputs[str(i)].token_ids == hf_greedy(model, prompt, max_tokens), i
    return run


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_a_long_sequence_holds_a_windows_worth_of_blocks(mistral, backend, monkeypatch):
    monkeypatch.setenv("ROSE_ATTENTION_BACKEND", backend)  # sdpa: decode reads from the window's first block
    engine = _engine(mistral, max_num_seqs=2, max_model_len=128)
    assert engine.kv_cache_manager.drops_passed_blocks  # every layer of mistral is windowed
    prompts = _prompts(2, 20)
    prompts[1] = prompts[1][:7]  # two lengths in one decode batch
    held = []
    _generate_and_check(engine, mistral, prompts, 100, on_step=lambda e, _outs: held.append(e.kv_blocks_used))
    # each: positions (p - 8, p] and the block being written, at most 4 blocks of 4, never the 30 of 120 positions
    assert max(held[2:]) <= 2 * (-(-WINDOW // 4) + 2), held
    assert engine.kv_blocks_used == 0


def test_windowed_sequences_under_memory_pressure_keep_generates_tokens(mistral):
    prompts = _prompts(6, 8, seed=1)
    engine = _engine(mistral, max_num_seqs=6, max_model_len=48, num_gpu_blocks_override=12)
    _generate_and_check(engine, mistral, prompts, 40)
    assert engine.get_stats()["num_preemptions"] > 0
    assert engine.kv_blocks_used == 0


def test_windowed_sequences_with_prefix_caching(mistral):
    shared = _prompts(1, 24, seed=2)[0]
    prompts = [shared + tail for tail in _prompts(4, 5, seed=3)]
    engine = _engine(mistral, max_num_seqs=2, max_model_len=96, enable_prefix_caching=True)
    _generate_and_check(engine, mistral, prompts, 30)
    assert engine.get_stats()["prefix_cache_hits"] > 0


def test_a_model_with_a_global_layer_gives_nothing_back():
    engine = _engine(
        tiny_model("gemma3_text"), max_num_seqs=1, max_model_len=128
    )  # windowed and global layers
    assert not engine.kv_cache_manager.drops_passed_blocks
    engine.add_request("long", _prompts(1, 20)[0], greedy(60))
    held = []
    drain(engine, on_step=lambda e, _outs: held.append(e.kv_blocks_used))
    assert max(held) == -(-(20 + 60 - 1) // 4)


def test_n_choices_share_the_prompt_of_a_windowed_model(mistral):
    """n > 1 on a model whose windows pass blocks: the prompt's blocks are held for the later choices before the
    first gives its passed ones back; every choice is transformers' greedy output."""
    engine = _engine(mistral, max_model_len=64)
    prompt = _prompts(1, 30)[0]
    engine.add_request("n", prompt, SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o.output for o in engine.step() if o.finished})
    expected = hf_greedy(mistral, prompt, 12)
    assert [c.token_ids for c in finals["n"].outputs] == [expected] * 3
    assert engine.get_stats()["num_prefill_tokens"] == 30 + 2 * 2  # 7 blocks of 4 shared, 2 tokens each
    assert engine.kv_blocks_used == 0
