"""Runs rose's engine (`rose.engine.llm.LLM`) over a benchmark workload."""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rose.bench.common import RunResult, make_result, sync
from rose.bench.workload import Workload

logger = logging.getLogger(__name__)


@dataclass
class RoseConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # None: the engine's default
    max_model_len: int | None = None  # None: the workload's longest request (prompt + max_tokens), rounded up
    warmup_requests: int = 8
    # the transformers baselines return token ids only; so does rose unless asked (vLLM's --disable-detokenize)
    detokenize: bool = False
    device: str = "cpu"  # as the engine takes them ('auto': CUDA when available)
    dtype: str = "float32"
    structured_outputs_backend: str = "auto"


def _filtered_kwargs(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop None values and keys `fn` does not accept (the engine's constructor is still evolving)."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = {}
    for key, value in kwargs.items():
        if value is None:
            continue
        if takes_any or key in params:
            out[key] = value
        else:
            logger.warning("rose LLM does not accept %s=%r; ignored", key, value)
    return out


def build_llm(model: Any, tokenizer: Any, cfg: RoseConfig, max_model_len: int | None) -> Any:
    from rose.engine.llm import LLM

    kwargs = _filtered_kwargs(
        LLM.__init__,
        {
            "device": cfg.device,
            "dtype": cfg.dtype,
            "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "structured_outputs_backend": cfg.structured_outputs_backend,
        },
    )
    return LLM(model, tokenizer, **kwargs), kwargs


def greedy_params(max_tokens: int, detokenize: bool = True) -> Any:
    from rose.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=detokenize)


def _generate(llm: Any, workload: Workload, detokenize: bool = True) -> dict[str, list[int]]:
    prompts = [list(r.prompt_token_ids) for r in workload.requests]
    params = [greedy_params(r.max_tokens, detokenize) for r in workload.requests]
    outs = llm.generate(prompts, params)
    if len(outs) != len(workload):
        raise RuntimeError(f"rose returned {len(outs)} outputs for {len(workload)} requests")
    return {r.request_id: list(o.token_ids) for r, o in zip(workload.requests, outs, strict=True)}


def run_rose(model: Any, tokenizer: Any, workload: Workload, cfg: RoseConfig | None = None) -> RunResult:
    """Time `LLM.generate` on the whole workload at once (after building the engine and warming it up).

    Without detokenization the engine gets no tokenizer (vLLM's `skip_tokenizer_init`): like the baselines it then
    samples over the model's whole vocabulary, also where the tokenizer is smaller (`qwen2.5-0.5b`)."""
    cfg = cfg or RoseConfig()
    max_model_len = cfg.max_model_len
    if max_model_len is None:
        max_model_len = -(-workload.max_total_len // 64) * 64 + 64
    with torch.inference_mode():
        llm, kwargs = build_llm(model, tokenizer if cfg.detokenize else None, cfg, max_model_len)
        device = llm.engine.device
        if cfg.warmup_requests > 0:
            _generate(llm, workload.head(cfg.warmup_requests, "warmup-"), cfg.detokenize)
        sync(device)
        start = time.perf_counter()
        outputs = _generate(llm, workload, cfg.detokenize)
        sync(device)
        wall = time.perf_counter() - start
    logger.info("rose: %.2f s", wall)
    settings = {**asdict(cfg), "llm_kwargs": kwargs, "tokenizer": cfg.detokenize}
    return make_result("rose", workload, outputs, wall, settings=settings)
