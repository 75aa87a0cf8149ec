"""Checking a drawn token against its grammar (and masking only a refused one) gives every request the tokens that
masking every row first gives it: the corpus through the engine both ways, with a real vocabulary, on models pushed
toward short outputs and toward whitespace, with greedy rows, seeded temperature draws, and rows that must be masked
first (top-p, logprobs) in the same batches; on both grammar backends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_helpers import drain
from real_tokenizers import load_tokenizer, pushed_model
from structured_corpus import CORPUS, FRONT_END_REFUSALS

from rose.engine.engine import Engine
from rose.engine.sampling_params import SamplingParams
from rose.engine.structured_outputs import StructuredOutputsParams

TOKENIZER = "phi-3-mini-4k-instruct"
SCHEMAS = 15
MAX_TOKENS = 64


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sampling(index: int, schema: dict) -> SamplingParams:
    so = StructuredOutputsParams(json=schema)
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=index),
        dict(temperature=0.7, seed=index, repetition_penalty=1.3),
        dict(temperature=1.0, seed=index, top_p=0.9),  # masked first either way
        dict(temperature=0.0, logprobs=2),  # masked first either way
    ]
    return SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=so, **kinds[index % len(kinds)])


def run(backend: str, push: str, mask_first: bool) -> tuple[dict, dict, dict]:
    tokenizer = load_tokenizer(TOKENIZER)
    refusals = FRONT_END_REFUSALS.get(backend, {})
    schemas = [(name, schema) for name, schema in CORPUS if name not in refusals][:SCHEMAS]
    engine = Engine(
        pushed_model(tokenizer, push),
        tokenizer,
        device="cpu",
        dtype="float32",
        max_num_seqs=len(schemas) + 1,
        max_model_len=MAX_TOKENS + 32,
        structured_outputs_backend=backend,
        seed=3,
    )
    manager = engine.structured_outputs
    manager.mask_first = mask_first
    try:
        # compiled before the requests come: they then share their steps alike in both runs (the forward's float
        # rounding depends on the batch)
        for _, schema in schemas:
            manager.make_request(StructuredOutputsParams(json=schema)).wait(timeout=60)
        for i, (name, schema) in enumerate(schemas):
            engine.add_request(name, "Answer in JSON:", sampling(i, schema))
        free = SamplingParams(temperature=1.0, seed=99, max_tokens=MAX_TOKENS)
        engine.add_request("free", "Say anything:", free)
        result = drain(engine)
        stats = engine.get_stats()
    finally:
        engine.close()
    tokens = {rid: out.token_ids for rid, out in result.outputs.items()}
    logprobs = {rid: out.logprobs for rid, out in result.outputs.items() if out.logprobs}
    return tokens, logprobs, stats


@pytest.mark.parametrize("push", ["short", "whitespace"])
@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_checking_drawn_tokens_draws_what_masking_first_draws(backend, push):
    first_tokens, first_logprobs, first = run(backend, push, mask_first=True)
    after_tokens, after_logprobs, after = run(backend, push, mask_first=False)
    assert after_tokens == first_tokens
    assert after_logprobs == first_logprobs
    assert first["structured_output_checked_rows"] == 0
    checked, refused = after["structured_output_checked_rows"], after["structured_output_refused_rows"]
    # the pushed models stray from their grammars often, but not at every token
    assert 0 < refused < checked
    assert after["structured_output_masked_rows"] < first["structured_output_masked_rows"]
