"""`SamplingParams.prompt_logprobs` (vLLM's): one entry per prompt token, None for the first, each the raw
log-softmax of the model's logits at the position before it, with the top-N and vLLM's rank; equal to transformers'
forward over the prompt whatever the chunking, with prefix caching on (such requests compute their whole prompt),
with n choices (one list, the prompt computed once), after preemption (no entry twice)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import drain, greedy, make_engine

from rose.engine.logprobs import token_logprobs
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams

PRESET = "tiny-llama"
PROMPT = list(range(10, 110))  # 100 tokens


@pytest.fixture(scope="module")
def expected():
    """transformers' log-softmax over PROMPT: row p predicts token p + 1."""
    model = build_preset(PRESET)[0]
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(entries, expected, k: int, prompt=PROMPT) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for t in range(1, len(prompt)):
        e, row = entries[t], expected[t - 1]
        assert e.token_id == prompt[t]
        assert e.logprob == pytest.approx(row[prompt[t]].item(), abs=1e-4)
        # vLLM's rank: the tokens at least as likely (itself included), up to rounding against torch's log-softmax
        value = row[prompt[t]]
        assert int((row > value + 1e-4).sum()) + 1 <= e.rank <= int((row >= value - 1e-4).sum())
        assert list(e.top) == row.topk(k).indices.tolist() if k else e.top == {}
        for token, value in e.top.items():
            assert value == pytest.approx(row[token].item(), abs=1e-4)


@pytest.mark.parametrize("chunk", [16, 37, 512])
def test_prompt_logprobs_equal_transformers_whatever_the_chunks(expected, chunk):
    eng = make_engine(PRESET, max_model_len=256, max_num_batched_tokens=chunk, block_size=16, max_num_seqs=4)
    eng.add_request("a", PROMPT, greedy(3, prompt_logprobs=4))
    eng.add_request("b", PROMPT[:40], greedy(3))  # beside it, asking for nothing
    run = drain(eng)
    check(run.outputs["a"].prompt_logprobs, expected, 4)
    assert run.outputs["b"].prompt_logprobs is None
    assert run.outputs["a"].logprobs is None  # only the prompt's were asked


def test_prefix_caching_does_not_skip_the_prompt_of_a_request_that_wants_its_logprobs(expected):
    eng = make_engine(PRESET, max_model_len=256, block_size=16, enable_prefix_caching=True)
    eng.add_request("warm", PROMPT, greedy(2))
    drain(eng)  # the prompt's blocks are now cached
    hits = eng.get_stats()["prefix_cache_hit_tokens"]
    eng.add_request("a", PROMPT, greedy(2, prompt_logprobs=0))
    run = drain(eng)
    check(run.outputs["a"].prompt_logprobs, expected, 0)
    assert eng.get_stats()["prefix_cache_hit_tokens"] == hits  # it read nothing from the cache
    eng.add_request("c", PROMPT, greedy(2))  # one without prompt_logprobs still hits
    drain(eng)
    assert eng.get_stats()["prefix_cache_hit_tokens"] > hits


def test_n_choices_report_the_prompt_once(expected):
    eng = make_engine(PRESET, max_model_len=256, block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
    eng.add_request(
        "a", PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=2)
    )
    finals = [o.output for _ in range(500) if eng.has_unfinished() for o in eng.step() if o.finished]
    (out,) = finals
    assert len(out.outputs) == 3
    check(out.prompt_logprobs, expected, 2)
    assert eng.get_stats()["num_prefill_tokens"] < 2 * len(PROMPT)  # the prompt was computed once


def test_preempted_requests_take_each_entry_once(expected):
    # 12 blocks of 16: three prompts of 40 tokens admitted together, then growing to 100 tokens each
    eng = make_engine(PRESET, max_model_len=160, block_size=16, num_gpu_blocks_override=12, max_num_seqs=3)
    prompt = PROMPT[:40]
    for rid in "abc":
        eng.add_request(rid, prompt, greedy(60, prompt_logprobs=1))
    run = drain(eng)
    assert sum(o.metrics.num_preemptions for o in run.outputs.values()) > 0
    for rid in "abc":
        check(run.outputs[rid].prompt_logprobs, expected, 1, prompt)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("keeps_logits", [True, False], ids=["logits_to_keep", "all_logits"])
def test_a_prompt_preempted_mid_prefill_resumes_its_entries_at_another_chunk_boundary(
    expected, n, keeps_logits
):
    """B's prompt is preempted part way (its entries stop inside a chunk) and recomputed in chunks that start
    elsewhere: every entry once, none missing; also for a model that computes every position's logits."""
    eng = make_engine(
        PRESET,
        block_size=4,
        num_gpu_blocks_override=12,
        max_num_batched_tokens=9,
        max_num_seqs=4,
        max_model_len=48,
    )
    eng.runner.keeps_logits = keeps_logits
    eng.add_request("A", [11, 12, 13, 14], greedy(30))
    prompt = PROMPT[:40]
    eng.add_request(
        "B", prompt, SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=1)
    )
    finals = {}
    for _ in range(500):
        if not eng.has_unfinished():
            break
        finals.update((o.request_id, o.output) for o in eng.step() if o.finished)
    assert finals["B"].metrics.num_preemptions > 0
    check(finals["B"].prompt_logprobs, expected, 1, prompt)


def test_a_one_token_prompt_has_one_empty_entry():
    eng = make_engine(PRESET, max_model_len=64)
    eng.add_request("a", [42], greedy(2, prompt_logprobs=3))
    assert drain(eng).outputs["a"].prompt_logprobs == [None]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, r"prompt_logprobs must be an integer in \[0, 2\*\*63\)"),
        (True, "prompt_logprobs must be"),
        (2.0, "must be"),
    ],
)
def test_bad_prompt_logprobs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(prompt_logprobs=value)


def test_more_than_max_logprobs_is_refused_by_the_engine():
    eng = make_engine(PRESET, max_model_len=64, max_logprobs=5)
    with pytest.raises(
        ValueError, match=r"prompt_logprobs must be <= 5 \(the engine's max_logprobs\), got 6"
    ):
        eng.add_request("a", [1, 2, 3], greedy(2, prompt_logprobs=6))
    assert not eng.has_unfinished()


def test_ranks_count_over_the_logprobs_as_reported():
    """Logits that differ may round to one logprob: the rank counts the reported values (vLLM counts over its
    log-softmax), so a token tied in logprob with a slightly larger logit ranks after it."""
    logits = torch.tensor([[20.0, 0.0, -1e-6, -1.5e-6]])
    [entry] = token_logprobs(logits, [2], [4], ranks=True)
    assert entry.logprob == entry.top[3]  # tokens 2 and 3: one logprob
    assert entry.rank == 4
