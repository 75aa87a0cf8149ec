"""Engine configuration and robustness: KV budget, padded vocabularies, requests that must not break a step."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import drain, generate, greedy, hf_greedy, make_engine, text_prompt
from transformers import LlamaForCausalLM

from rose.engine.attention import sdpa_backends
from rose.engine.engine import Engine
from rose.engine.llm import LLM
from rose.engine.presets import build_preset, build_tokenizer, model_from_config, tiny_llama_config
from rose.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine("tiny-gpt2", max_num_seqs=2, max_model_len=32)


def test_logprobs_beyond_the_vocabulary_do_not_break_other_requests():
    """Asking for more top logprobs than there are tokens must be rejected up front or clipped, never crash."""
    engine = make_engine("tiny-gpt2", max_num_seqs=2, max_model_len=32)
    reference = generate(engine, [("ok", "hello world", greedy(4))]).outputs["ok"]
    engine.add_request("ok", "hello world", greedy(4))
    try:
        engine.add_request("big", "hello world", greedy(4, logprobs=engine.vocab_size + 1))
    except ValueError as exc:
        assert "logprobs" in str(exc)
        drain(engine)
        return
    run = drain(engine)
    assert run.outputs["ok"].token_ids == reference.token_ids
    big = run.outputs["big"]
    assert big.logprobs is not None and all(len(lp.top) == engine.vocab_size for lp in big.logprobs)


def test_stop_token_on_the_last_allowed_token_reports_stop(engine):
    ids = generate(engine, [("g", "hello world", greedy(6))]).outputs["g"].token_ids
    out = generate(engine, [("s", "hello world", greedy(4, stop_token_ids=[ids[3]]))]).outputs["s"]
    assert out.token_ids[-1] == ids[3]
    assert len(out.token_ids) == ids.index(ids[3]) + 1
    assert out.finish_reason == "stop"


def test_get_request_and_stats(engine):
    engine.add_request("x", "hello world", greedy(3))
    seq = engine.get_request("x")
    assert seq is not None and seq.prompt == "hello world"
    stats = engine.get_stats()
    steps = stats.pop("num_steps")  # forwards run so far (the engine is the module's)
    prefilled = stats.pop("num_prefill_tokens")
    assert stats == {
        "num_running": 0,
        "num_waiting": 1,
        "num_preemptions": 0,
        "kv_blocks_used": 0,
        "kv_blocks_free": 2,
        "kv_blocks_total": 2,  # 2 sequences x 32 tokens, in blocks of 64 (the CPU default)
        "kv_block_size": 64,
        "kv_tokens_used": 0,
        "kv_tokens_total": 128,
    }
    drain(engine)
    assert engine.get_request("x") is None
    # the prompt's step gives the first token, then 2 decodes
    assert engine.get_stats()["num_steps"] == steps + 3
    assert engine.get_stats()["num_prefill_tokens"] == prefilled + len(seq.prompt_token_ids)


def test_kv_budget_sizes_the_pool_and_caps_or_rejects_max_model_len():
    model, tok = build_preset("tiny-gpt2")
    # gpt2 preset: 4 layers x 8 heads x 32 dims, K and V, float32 = 8 KiB per token
    per_token = 2 * 4 * 8 * 32 * 4
    engine = Engine(
        model, tok, device="cpu", block_size=16, max_num_seqs=2, max_kv_cache_bytes=per_token * 400
    )
    # the pool takes the budget (25 blocks of 16); one sequence may use all of it
    assert engine.kv_blocks_total == 25 and engine.max_model_len == 400
    assert engine.cache.nbytes == per_token * 400
    with pytest.raises(ValueError, match="max_model_len 500 is longer than the KV pool"):
        Engine(
            build_preset("tiny-gpt2")[0],
            tok,
            device="cpu",
            block_size=16,
            max_num_seqs=2,
            max_model_len=500,
            max_kv_cache_bytes=per_token * 400,
        )
    with pytest.raises(ValueError, match="max_kv_cache_bytes"):
        Engine(
            build_preset("tiny-gpt2")[0],
            tok,
            device="cpu",
            block_size=16,
            max_num_seqs=2,
            max_kv_cache_bytes=per_token * 10,
        )
    # a budget larger than max_num_seqs sequences of max_model_len could use: the pool stops there
    engine = Engine(
        build_preset("tiny-gpt2")[0], tok, device="cpu", block_size=16, max_num_seqs=3, max_model_len=40
    )
    assert engine.kv_blocks_total == 3 * 3


def test_padded_embedding_rows_are_never_sampled():
    """A model whose vocabulary is padded past the tokenizer: ids >= len(tokenizer) are not real tokens."""
    tokenizer = build_tokenizer()
    config = tiny_llama_config()
    config.vocab_size = len(tokenizer) + 64

    def padded_model():
        model = model_from_config(config, LlamaForCausalLM).eval()
        with torch.no_grad():
            model.lm_head.weight[len(tokenizer) + 10] = model.lm_head.weight[:50].sum(0) * 50
        return model

    reference = padded_model()
    prompt = tokenizer.encode(text_prompt(6))
    hf = hf_greedy(reference, prompt, 4)
    assert any(t >= len(tokenizer) for t in hf)  # transformers happily picks the padding row

    engine = Engine(padded_model(), tokenizer, device="cpu", max_num_seqs=1, max_model_len=32)
    assert engine.vocab_size == len(tokenizer)
    out = generate(engine, [("p", prompt, greedy(4))]).outputs["p"]
    assert all(t < len(tokenizer) for t in out.token_ids)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("bad", [len(tokenizer) + 1], greedy(2))


def test_llm_priority_length_must_match_prompts():
    model, tok = build_preset("tiny-gpt2")
    llm = LLM(model, tok, device="cpu", max_num_seqs=1, max_model_len=32)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a b", "c d", "e f"], SamplingParams(max_tokens=2), priority=[1, 0])
    assert not llm.engine.has_unfinished()


def test_engine_built_under_inference_mode_works_outside_it(tokenizer):
    """The KV store is then made of inference tensors: row moves (an abort, a finished request) must still work."""
    with torch.inference_mode():
        engine = make_engine("tiny-llama", max_num_seqs=3, max_model_len=64)
    for i in range(3):
        engine.add_request(f"r{i}", tokenizer.encode(text_prompt(4 + i, offset=i)), greedy(6))
    engine.step()
    engine.step()
    assert engine.abort("r0") is not None  # slot 0 freed: the last row moves into it
    run = drain(engine, stepped_before=True)
    assert {rid for rid, out in run.outputs.items() if out.finish_reason == "length"} == {"r1", "r2"}
    assert engine.kv_blocks_used == 0


def test_num_gpu_blocks_override_sizes_the_pool_and_the_watermark_follows_it():
    short = make_engine(
        "tiny-gpt2", max_num_seqs=4, max_model_len=64, block_size=16, num_gpu_blocks_override=6
    )
    assert short.kv_blocks_total == 6 and short.max_model_len == 64
    assert (
        short.kv_cache_manager.watermark_blocks == 1
    )  # short of 4 x 64 positions: a block kept free at admission
    whole = make_engine(
        "tiny-gpt2", max_num_seqs=4, max_model_len=64, block_size=16, num_gpu_blocks_override=16
    )
    assert (
        whole.kv_cache_manager.watermark_blocks == 0
    )  # every sequence fits at full length: it never runs short
    # with no watermark the whole pool is admitted: 4 prompts of 4 blocks each
    for i in range(4):
        whole.add_request(str(i), [5 + i] * 60, greedy(4))
    whole.step()
    assert whole.num_running == 4 and whole.kv_blocks_used == 16
    drain(whole, stepped_before=True)
    with pytest.raises(ValueError, match="num_gpu_blocks_override must be >= 1"):
        make_engine("tiny-gpt2", num_gpu_blocks_override=0)
    with pytest.raises(ValueError, match="longer than the KV pool"):
        make_engine("tiny-gpt2", max_model_len=64, block_size=16, num_gpu_blocks_override=3)


@pytest.mark.skipif(
    not Path("/proc/self/statm").exists(), reason="reads the process's resident memory on Linux"
)
def test_a_cpu_pool_takes_memory_only_for_the_blocks_used():
    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    engine = make_engine("tiny-llama", max_num_seqs=64, max_model_len=4096, max_kv_cache_bytes=2**30)
    assert engine.cache.nbytes == 2**30
    assert resident() - before < 2**30 // 4  # the model and the pool's untouched pages
    engine.add_request("a", [5] * 100, greedy(4))
    drain(engine)
    assert float(engine.cache.k[0].abs().sum()) > 0  # a real, written store
    assert all(
        float(t[-1].abs().sum()) == 0 for t in engine.cache.k + engine.cache.v
    )  # zeroed, never written


def test_cuda_steps_leave_out_cudnn_attention():
    """cuDNN's SDPA builds an execution plan for every new shape and a decode step's shapes change every step (on
    an H100 that made steps 3-4x slower): a step on CUDA runs SDPA without it, and torch's flags are back after."""
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    with sdpa_backends(torch.device("cuda")):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
    with sdpa_backends(torch.device("cpu")):
        assert cuda.cudnn_sdp_enabled() == before[0]


def test_every_step_runs_under_the_engines_sdpa_backends(monkeypatch):
    """The model's forward (every layer's SDPA call) runs inside `sdpa_backends` of the engine's device."""
    import contextlib

    from rose.engine import model_runner

    entered: list[torch.device] = []

    @contextlib.contextmanager
    def recording(device):
        entered.append(device)
        yield

    monkeypatch.setattr(model_runner, "sdpa_backends", recording)
    engine = make_engine("tiny-llama", max_num_seqs=2, max_model_len=32)
    run = generate(engine, [("a", "hello world", greedy(3))])
    assert len(run.outputs["a"].token_ids) == 3
    assert entered and all(device == engine.device for device in entered)


@pytest.mark.parametrize("n", [1, 2])
def test_abort_drops_what_a_failed_step_left_undelivered_for_the_request(monkeypatch, n):
    """A step that raises after finishing a request (its grammar failed to compile) keeps that output for the next
    step (`Engine.step`). Aborting the request returns it and drops it: a request added again under the same id
    never receives it (n = 2: the choices' outputs, under their child ids, alike)."""
    engine = make_engine("tiny-llama", max_num_seqs=4, max_model_len=64)

    def failing(grammar):
        raise RuntimeError("no grammar today")

    monkeypatch.setattr(engine.structured_outputs.backend, "compile", failing)
    constrained = SamplingParams(max_tokens=4, n=n, structured_outputs={"regex": "z+"})
    engine.add_request("doomed", "hello", constrained)
    engine.add_request("other", "hello world", greedy(3))  # a batch to run: the step reaches the forward
    deadline = time.monotonic() + 30
    waiting = engine.scheduler.waiting_for_grammar()
    assert len(waiting) == n
    while not (engine.structured_outputs.failures_due and all(s.structured.error for s in waiting)):
        assert time.monotonic() < deadline, "the compile never failed"
        time.sleep(0.01)

    execute, calls = engine.runner.execute, []

    def broken_once(batch):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("the forward broke")
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", broken_once)
    with pytest.raises(RuntimeError, match="the forward broke"):
        engine.step()  # finished "doomed" ("error"), then raised: its output is left for the next step
    assert engine.get_request("doomed") is None and engine.has_unfinished()

    aborted = engine.abort("doomed")
    assert aborted is not None and aborted.request_id == "doomed"
    assert [c.finish_reason for c in aborted.outputs] == ["error"] * n
    assert all("no grammar today" in (c.error or "") for c in aborted.outputs)
    assert engine.abort("doomed") is None  # nothing left of it

    engine.add_request("doomed", "hello", greedy(3, n=n))  # the same id again, a request that runs
    delivered, finals = [], {}
    for _ in range(20):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            delivered.append(out)
            if out.finished:
                assert out.request_id not in finals, "finished twice"
                finals[out.request_id] = out.output
    assert len(calls) > 1 and not engine.has_unfinished() and engine.kv_blocks_used == 0
    mine = [out for out in delivered if out.request_id == "doomed"]
    assert mine and all(out.finish_reason in (None, "length") for out in mine)
    assert sum(len(out.new_token_ids) for out in mine) == 3 * n
    assert [(c.finish_reason, len(c.token_ids)) for c in finals["doomed"].outputs] == [("length", 3)] * n
    assert finals["other"].finish_reason == "length" and len(finals["other"].token_ids) == 3
