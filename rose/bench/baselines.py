"""transformers' own ways to serve a batch of requests, as fair baselines.

- Static batching: `model.generate` over fixed batches of `batch_size` left-padded prompts, greedy, ignoring EOS;
  each batch runs to the largest `max_tokens` in it, and a request is credited only with the tokens it asked for.
- transformers' continuous batching: `model.init_continuous_batching(...)` + one `add_request` per request with its
  own `max_new_tokens`, EOS disabled, results collected until all finish. On CPU the cache size (`num_blocks`) and
  the per-step token budget (`max_batch_tokens`) must be set by hand: the defaults size the cache from "free
  memory" and the block-diagonal mask buffer as max_batch_tokens x cache tokens (gigabytes).

Both run on the model's device, static batching under `torch.inference_mode()`, and are warmed up on a few
requests first. On CPU both use SDPA attention. On CUDA, continuous batching gets transformers' best available
attention (an installed flash-attn 3, else flash-attn 2, else SDPA: what its `auto_switch_to_flash` picks, minus
the Hub kernels fallback, which needs a network) and its own choice of CUDA graphs and async batching. Clocks are
read after `torch.cuda.synchronize()` on CUDA.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from rose.bench.common import RunResult, make_result, sync
from rose.bench.workload import Workload

logger = logging.getLogger(__name__)


@dataclass
class StaticBatchingConfig:
    batch_size: int = 16
    sort_by_length: bool = False  # submission order by default, as a plain batch job would run
    cache_implementation: str | None = None  # None: transformers' default (DynamicCache)
    warmup_batches: int = 1


# Defaults per device type where the config says None. CPU: measured on the 2-core VM (see the fields).
_CB_DEFAULTS = {
    "cpu": {"max_batch_tokens": 512, "max_requests_per_batch": 24},
    "cuda": {"max_batch_tokens": 2048, "max_requests_per_batch": 0},
}


@dataclass
class HFContinuousBatchingConfig:
    page_size: int = 64
    num_blocks: int | None = None  # None: enough pages for every request of the workload at once, plus slack
    max_batch_tokens: int | None = None  # None: 512 on CPU, 2048 (rose's default token budget) on CUDA
    # Concurrent requests per step. On CPU transformers packs every request into one row and attends over all their
    # cached tokens with a block-diagonal mask, so a step costs ~ batch x total cached tokens; on this workload
    # 16-32 was measured fastest (vs 128: ~1.7x slower). None: 24 on CPU, all on CUDA; 0: all (capped at 1024).
    max_requests_per_batch: int | None = None
    allow_block_sharing: bool = False  # random prompts share no prefix; hashing blocks only costs time
    warmup_requests: int = 8


def best_cb_attention(device: torch.device) -> str | None:
    """The attention transformers' continuous batching should run with on `device` (None: keep the model's)."""
    if device.type != "cuda":
        return None  # CPU: SDPA, as measured
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    if is_flash_attn_3_available():
        return "flash_attention_3"
    if is_flash_attn_2_available():
        return "flash_attention_2"
    return "sdpa"


def _pad_id(model: Any) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def _static_batches(workload: Workload, cfg: StaticBatchingConfig) -> list[list[int]]:
    order = list(range(len(workload)))
    if cfg.sort_by_length:
        order.sort(key=lambda i: (workload.requests[i].prompt_len, workload.requests[i].max_tokens))
    return [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]


def _generate_static(model: Any, workload: Workload, batch: list[int], cfg: StaticBatchingConfig) -> dict:
    reqs = [workload.requests[i] for i in batch]
    pad_id = _pad_id(model)
    ids, mask = _left_pad([r.prompt_token_ids for r in reqs], pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    max_new = max(r.max_tokens for r in reqs)
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new,
        min_new_tokens=None,
        do_sample=False,
        eos_token_id=[],  # ignore EOS: an empty list disables the EOS stopping criterion
        pad_token_id=pad_id,
        use_cache=True,
        cache_implementation=cfg.cache_implementation,
    )
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
    new = out[:, ids.shape[1] :].tolist()
    return {r.request_id: toks for r, toks in zip(reqs, new, strict=True)}


def run_static_batching(model: Any, workload: Workload, cfg: StaticBatchingConfig | None = None) -> RunResult:
    """Time `model.generate` over the workload in fixed batches (after warming up on the first batch)."""
    cfg = cfg or StaticBatchingConfig()
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    batches = _static_batches(workload, cfg)
    padded_slots = 0
    with torch.inference_mode():
        for batch in batches[: cfg.warmup_batches]:
            _generate_static(model, workload, batch, cfg)
        outputs: dict[str, list[int]] = {}
        sync(model.device)
        start = time.perf_counter()
        for batch in batches:
            outputs.update(_generate_static(model, workload, batch, cfg))
        sync(model.device)
        wall = time.perf_counter() - start
    for batch in batches:
        padded_slots += len(batch) * max(workload.requests[i].max_tokens for i in batch)
    logger.info("static batching: %d batches in %.2f s", len(batches), wall)
    return make_result(
        "hf-static",
        workload,
        outputs,
        wall,
        settings={"attn_implementation": model.config._attn_implementation, **asdict(cfg)},
        extra={"num_batches": len(batches), "tokens_generated_incl_surplus": padded_slots},
    )


def _resolve_cb_config(
    workload: Workload, cfg: HFContinuousBatchingConfig, device: torch.device | None = None
) -> dict[str, Any]:
    pages_per_request = [
        math.ceil((r.prompt_len + r.max_tokens) / cfg.page_size) + 1 for r in workload.requests
    ]
    num_blocks = cfg.num_blocks
    if num_blocks is None:
        # page_size-token blocks needed to hold every request at once (+1 page each, + 10 % slack): the cache is
        # never the bottleneck and no request is ever evicted.
        num_blocks = math.ceil(sum(pages_per_request) * 1.1) + 4
    cuda = device is not None and device.type == "cuda"
    defaults = _CB_DEFAULTS["cuda" if cuda else "cpu"]
    max_batch_tokens = cfg.max_batch_tokens or defaults["max_batch_tokens"]
    max_requests = cfg.max_requests_per_batch
    if max_requests is None:
        max_requests = defaults["max_requests_per_batch"]
    return {
        "page_size": cfg.page_size,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests or min(len(workload), 1024),
        "allow_block_sharing": cfg.allow_block_sharing,
        "auto_switch_to_flash": False,  # the attention is chosen by best_cb_attention
        # None: transformers decides (on CUDA: graphs and async batching when the attention needs no mask)
        "use_cuda_graph": None if cuda else False,
        "use_async_batching": None if cuda else False,
        "scheduler_type": "fifo",
        "seed": 0,
    }


def _cb_collect(manager: Any, workload: Workload, timeout_s: float) -> dict[str, list[int]]:
    for req in workload.requests:
        manager.add_request(
            input_ids=list(req.prompt_token_ids),
            request_id=req.request_id,
            max_new_tokens=req.max_tokens,
            eos_token_id=-1,  # -1: no EOS, as transformers itself uses when none is configured
        )
    outputs: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outputs) < len(workload):
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before finishing")
            if time.monotonic() > deadline:
                raise TimeoutError(f"transformers' continuous batching did not finish in {timeout_s} s")
            continue
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            outputs[result.request_id] = list(result.generated_tokens)
    return outputs


def run_hf_continuous_batching(
    model: Any,
    workload: Workload,
    cfg: HFContinuousBatchingConfig | None = None,
    timeout_s: float = 3600.0,
) -> RunResult:
    """Time transformers' continuous batching on the workload: all requests submitted at once to a started
    manager (warmed up on a few requests), until the last result arrives."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cfg = cfg or HFContinuousBatchingConfig()
    device = model.device
    settings = _resolve_cb_config(workload, cfg, device)
    original_attn = model.config._attn_implementation
    attn = best_cb_attention(device)
    if attn is not None and attn != original_attn:
        model.set_attn_implementation(attn)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in workload.requests))
    gen_cfg.eos_token_id = -1
    gen_cfg.pad_token_id = _pad_id(model)
    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_len for r in workload.requests),
        max_generated_length=max(r.max_tokens for r in workload.requests),
        num_requests=len(workload),
    )
    manager = model.init_continuous_batching(
        generation_config=gen_cfg,
        continuous_batching_config=ContinuousBatchingConfig(**settings),
        workload_hints=hints,
    )
    try:
        # Not under inference_mode: the manager's thread runs under no_grad and must update these tensors in place.
        manager.warmup()
        manager.start()
        if cfg.warmup_requests > 0:
            # Fresh ids so the timed requests never collide with the warm-up ones.
            _cb_collect(manager, workload.head(cfg.warmup_requests, "warmup-"), timeout_s)
        sync(device)
        start = time.perf_counter()
        outputs = _cb_collect(manager, workload, timeout_s)
        sync(device)
        wall = time.perf_counter() - start
        resolved = manager.continuous_batching_config
        cache = getattr(manager.batch_processor, "cache", None)
        extra = {
            "resolved_num_blocks": getattr(cache, "num_blocks", resolved.num_blocks),
            "resolved_max_batch_tokens": getattr(cache, "max_batch_tokens", resolved.max_batch_tokens),
            "resolved_max_requests_per_batch": resolved.max_requests_per_batch,
            "resolved_use_cuda_graph": resolved.use_cuda_graph,
            "resolved_use_async_batching": resolved.use_async_batching,
            "cache_mib": round(cache.cache_tensor.numel() / 2**20, 1) if cache is not None else None,
            "attn_implementation": model.config._attn_implementation,
        }
    finally:
        manager.stop(block=True, timeout=60)
        manager.destroy()
        if model.config._attn_implementation != original_attn:
            model.set_attn_implementation(original_attn)
    logger.info("transformers continuous batching: %.2f s", wall)
    settings["attn_implementation"] = attn or original_attn
    return make_result("hf-continuous-batching", workload, outputs, wall, settings=settings, extra=extra)
