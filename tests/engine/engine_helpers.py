"""Helpers shared by the engine tests: tiny preset models, a transformers greedy reference, run loops."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
import torch

from rose.engine.engine import Engine
from rose.engine.outputs import RequestMetrics, RequestOutput, StepOutput
from rose.engine.presets import build_preset
from rose.engine.sampling_params import SamplingParams
from rose.engine.sequence import Sequence

torch.set_num_threads(2)

WORDS = (
    "the queue worker reads a batch job and the engine streams tokens back to redis while the model "
    "keeps its cache warm for every prompt in the batch of text hello world bonjour merci rose"
).split()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    """Greedy params that always run exactly `max_tokens` tokens unless told otherwise."""
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def text_prompt(num_words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(num_words))


def make_engine(preset: str, **kwargs) -> Engine:
    model, tokenizer = build_preset(preset)
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    return Engine(model, tokenizer, **kwargs)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation of exactly `max_new_tokens` tokens: EOS is an ordinary token, as the
    engine's `ignore_eos` makes it (never stopped at, never masked)."""
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=[],
            pad_token_id=2,
        )
    return out[0, len(prompt_ids) :].tolist()


@dataclass
class Run:
    """Everything a drained engine produced."""

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    deltas: dict[str, list[str]] = field(default_factory=dict)
    step_outputs: list[list[StepOutput]] = field(default_factory=list)
    finish_order: list[str] = field(default_factory=list)

    def text(self, request_id: str) -> str:
        return "".join(self.deltas.get(request_id, []))


def drain(engine: Engine, max_steps: int = 10_000, on_step=None, stepped_before: bool = False) -> Run:
    """Step the engine until it has nothing left; collect outputs and every text delta.

    Checks that each finished request's deltas add up to its final output, unless the caller already stepped
    the engine itself (`stepped_before`), in which case the early deltas are not here to add up.
    """
    run = Run()
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        outs = engine.step()
        run.step_outputs.append(outs)
        for out in outs:
            run.deltas.setdefault(out.request_id, []).append(out.new_text)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
            if out.finished:
                final = out.output
                assert final is not None and final.finish_reason == out.finish_reason
                assert final.metrics.num_generated_tokens == len(final.token_ids)
                if not stepped_before:
                    assert "".join(run.deltas[out.request_id]) == final.text
                    assert tokens[out.request_id] == final.token_ids
                    assert logprobs.get(out.request_id) == (final.logprobs or None)
                run.outputs[out.request_id] = final
                run.finish_order.append(out.request_id)
            else:
                assert out.output is None and out.finish_reason is None
        if on_step is not None:
            on_step(engine, outs)
    else:
        pytest.fail(f"engine still busy after {max_steps} steps")
    return run


def generate(engine: Engine, requests: Iterable[tuple[str, str | list[int], SamplingParams]]) -> Run:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    return drain(engine)


def fake_seq(
    params: SamplingParams,
    prompt: Iterable[int] = (3,),
    output: Iterable[int] = (),
    seed: int | None = None,
) -> Sequence:
    """A Sequence as the sampler sees it (no engine needed)."""
    generator = None
    if seed is not None:
        generator = torch.Generator()
        generator.manual_seed(seed)
    return Sequence(
        request_id="fake",
        prompt=None,
        prompt_token_ids=list(prompt),
        params=params,
        max_tokens=params.max_tokens or 16,
        metrics=RequestMetrics(arrival_time=0.0),
        detokenizer=None,
        generator=generator,
        output_token_ids=list(output),
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


BYTE_CHARS = _bytes_to_unicode()


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `text` (what a model emitting partial characters produces)."""
    ids = [tokenizer.convert_tokens_to_ids(BYTE_CHARS[b]) for b in text.encode("utf-8")]
    assert all(isinstance(i, int) and i > 2 for i in ids)
    return ids
