"""Greedy outputs match transformers' `generate`, request by request, under continuous batching.

Four slots, ten requests of varied lengths (so requests are admitted mid-flight and finish at different steps,
which moves KV rows to keep slots compact) and a 16-token step budget (so long prompts are prefilled in chunks
while other requests decode).
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import drain, greedy, hf_greedy, text_prompt
from transformers import Qwen2ForCausalLM

from rose.engine.engine import Engine
from rose.engine.presets import build_preset, model_from_config, tiny_qwen2_config

MAX_NUM_SEQS = 4
STEP_BUDGET = 16
MAX_MODEL_LEN = 96


def _requests(tokenizer) -> list[tuple[str, list[int], int]]:
    """(request id, prompt ids, max_tokens): lengths from 1 to ~45 tokens, several longer than the step budget."""
    rng = random.Random(1234)
    reqs = []
    for i, words in enumerate([3, 40, 1, 12, 28, 6, 33, 2, 19, 9]):
        if i % 3 == 2:  # some prompts as raw token ids, including ids the text corpus rarely produces
            ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(words + 4)]
        else:
            ids = tokenizer.encode(text_prompt(words, offset=i * 5))
        reqs.append((f"req-{i}", ids, 5 + (i * 7) % 11))
    return reqs


class _Watcher:
    """Checks the KV-store invariants after every step and records that the interesting schedules happened."""

    def __init__(self, engine: Engine) -> None:
        self.k_ptrs = [t.data_ptr() for t in engine.cache.k]
        self.v_ptrs = [t.data_ptr() for t in engine.cache.v]
        self.saw_chunk_beside_decode = False
        self.saw_admission_after_finish = False
        self.finished_any = False
        self.max_slots = 0

    def __call__(self, engine: Engine, outs) -> None:
        assert [t.data_ptr() for t in engine.cache.k] == self.k_ptrs, "the K store was reallocated"
        assert [t.data_ptr() for t in engine.cache.v] == self.v_ptrs, "the V store was reallocated"
        running = engine.scheduler.running
        assert len(running) <= MAX_NUM_SEQS
        held = [b for s in running for b in s.block_ids]
        assert len(held) == len(set(held)) == engine.kv_blocks_used, "a block is held twice, or leaked"
        for s in running:  # each sequence holds the blocks of what it computes next, no more
            assert len(s.block_ids) == -(
                -max(s.num_prefill_tokens, s.num_computed_tokens) // engine.block_size
            )
        self.max_slots = max(self.max_slots, len(running))
        partial = [s for s in running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
        decoding = [s for s in running if s.output_token_ids]
        if partial and decoding:
            self.saw_chunk_beside_decode = True
        if self.finished_any and any(s.num_computed_tokens and not s.output_token_ids for s in running):
            self.saw_admission_after_finish = True
        if any(o.finished for o in outs):
            self.finished_any = True


@pytest.mark.parametrize(
    ("preset", "step_budget"),
    [
        ("tiny-llama", STEP_BUDGET),
        ("tiny-qwen2", STEP_BUDGET),
        ("tiny-gpt2", STEP_BUDGET),
        ("tiny-gpt2", MAX_NUM_SEQS),
    ],  # the smallest budget allowed: prompts advance a token or so per step
)
def test_greedy_matches_transformers_generate(preset, step_budget, tokenizer):
    model, tok = build_preset(preset)
    reference, _ = build_preset(preset)
    engine = Engine(
        model,
        tok,
        device="cpu",
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=step_budget,
    )
    reqs = _requests(tokenizer)
    assert any(len(ids) > step_budget for _, ids, _ in reqs)
    for rid, ids, n in reqs:
        engine.add_request(rid, ids, greedy(n))
    watcher = _Watcher(engine)
    run = drain(engine, on_step=watcher)

    assert watcher.saw_chunk_beside_decode, "no step prefilled a prompt chunk while another request decoded"
    assert watcher.saw_admission_after_finish, "no request was admitted into a slot freed mid-flight"
    if step_budget > MAX_NUM_SEQS:  # with the minimal budget, an unfinished prompt takes what decodes leave
        assert watcher.max_slots == MAX_NUM_SEQS
    assert engine.num_running == engine.num_waiting == engine.kv_blocks_used == 0
    assert set(run.outputs) == {rid for rid, _, _ in reqs}
    for rid, ids, n in reqs:
        out = run.outputs[rid]
        assert out.prompt_token_ids == ids
        assert out.finish_reason == "length"
        assert out.token_ids == hf_greedy(reference, ids, n), f"{preset} {rid} differs from transformers"


def _sliding_qwen2(sliding: bool):
    config = tiny_qwen2_config()
    if sliding:
        fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
        fields.update(use_sliding_window=True, sliding_window=8, max_window_layers=2)
        config = type(config)(**fields)
        assert config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return model_from_config(config, Qwen2ForCausalLM).eval()


@pytest.mark.parametrize("hf_attention", ["sdpa", "eager"])
def test_sliding_window_qwen2_matches_transformers(hf_attention, tokenizer):
    prompts = [tokenizer.encode(text_prompt(w, offset=w)) for w in (4, 14, 25, 9)]
    max_tokens = 14
    engine = Engine(
        _sliding_qwen2(True),
        tokenizer,
        device="cpu",
        dtype="float32",
        max_num_seqs=2,
        max_model_len=64,
        max_num_batched_tokens=12,
    )
    run = drain_requests(engine, prompts, max_tokens)

    reference = _sliding_qwen2(True)
    reference.set_attn_implementation(hf_attention)
    for i, ids in enumerate(prompts):
        assert run.outputs[str(i)].token_ids == hf_greedy(reference, ids, max_tokens), f"request {i}"


def test_sliding_window_changes_the_output(tokenizer):
    """Guards the test above: with a window of 8 the outputs must differ from full attention."""
    prompts = [tokenizer.encode(text_prompt(w, offset=w)) for w in (14, 25)]
    outs = {}
    for sliding in (True, False):
        engine = Engine(
            _sliding_qwen2(sliding),
            tokenizer,
            device="cpu",
            dtype="float32",
            max_num_seqs=2,
            max_model_len=64,
        )
        run = drain_requests(engine, prompts, 14)
        outs[sliding] = [run.outputs[str(i)].token_ids for i in range(len(prompts))]
    assert outs[True] != outs[False]


def drain_requests(engine: Engine, prompts: list[list[int]], max_tokens: int):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, greedy(max_tokens))
    return drain(engine)


def test_kv_blocks_hold_each_sequence_after_others_leave(tokenizer):
    """Sequences never move: after a request leaves, a later one's blocks hold exactly the K/V its tokens produce
    (those of a fresh engine that computed the same tokens), whatever blocks it got."""
    model, tok = build_preset("tiny-llama")
    engine = Engine(model, tok, device="cpu", dtype="float32", max_num_seqs=3, max_model_len=64, block_size=4)
    prompts = [tokenizer.encode(text_prompt(w, offset=w)) for w in (3, 5, 7)]
    for i, (ids, n) in enumerate(zip(prompts, (2, 20, 20), strict=True)):
        engine.add_request(str(i), ids, greedy(n))
    ptr = engine.cache.k[0].data_ptr()
    while engine.get_request("0") is not None:
        engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["1", "2"]
    assert engine.cache.k[0].data_ptr() == ptr
    for _ in range(6):  # past a block boundary: blocks freed by "0" are reused
        engine.step()
    seq = engine.get_request("2")
    n = seq.num_computed_tokens
    fresh = Engine(
        build_preset("tiny-llama")[0],
        tok,
        device="cpu",
        dtype="float32",
        max_num_seqs=1,
        max_model_len=64,
        block_size=4,
    )
    fresh.add_request("x", seq.all_token_ids[:n], greedy(1))
    fresh.step()
    x = fresh.scheduler.running[0] if fresh.scheduler.running else None
    fresh_blocks = x.block_ids if x is not None else list(range(-(-n // 4)))
    for layer in range(len(engine.cache.k)):
        for store, fresh_store in ((engine.cache.k, fresh.cache.k), (engine.cache.v, fresh.cache.v)):
            mine = store[layer][seq.block_ids].flatten(0, 1)[:n]
            theirs = fresh_store[layer][fresh_blocks].flatten(0, 1)[:n]
            torch.testing.assert_close(mine, theirs)
    drain(engine, stepped_before=True)
    assert engine.kv_blocks_used == 0
