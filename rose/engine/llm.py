"""Offline API (vLLM's `LLM`): a thin loop over `Engine`."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from rose.engine.engine import Engine
from rose.engine.outputs import RequestOutput
from rose.engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate for many prompts at once with continuous batching.

    >>> llm = LLM(model="tiny-llama", device="cpu")
    >>> outs = llm.generate(["Hello", "Bonjour"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        tokenizer: Any = None,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.engine = Engine(
            model,
            tokenizer,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            **engine_kwargs,
        )
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts: pass one, or one per prompt"
                )
        ids = [str(next(self._ids)) for _ in prompt_list]
        added = []
        try:
            for i, (rid, prompt, params) in enumerate(zip(ids, prompt_list, params_list, strict=True)):
                self.engine.add_request(rid, prompt, params, priority=priority[i] if priority else 0)
                added.append(rid)
            results = self._run(set(ids), use_tqdm)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise
        return [results[rid] for rid in ids]

    def _run(self, ids: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while len(results) < len(ids) and self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    results[out.request_id] = out.output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return results

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated (runs the engine; other queued requests advance too)."""
        rid = str(next(self._ids))
        (normalized,) = _normalize_prompts([prompt])
        self.engine.add_request(rid, normalized, sampling_params or SamplingParams())
        try:
            done = False
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    if out.new_text:
                        yield out.new_text
                    done = out.finished
        finally:
            if not done:
                self.engine.abort(rid)


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        else:
            out.append(p if isinstance(p, str) else list(p))
    return out
