"""Sizing the paged KV store: its block size, how many blocks the pool gets from a memory budget, and the longest
sequence it serves.

The pool never holds more than `max_num_seqs` sequences of the longest length could use (the batch cap makes more
unusable); within that, it takes what the budget allows.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from rose.engine import flash_attention
from rose.engine.kv_cache import KVCache
from rose.engine.model_probe import AttentionLayers

logger = logging.getLogger(__name__)

_MIN_MODEL_LEN = 128
# The CPU decode kernels walk each sequence's blocks: a longer block is a longer sequential read between jumps
# (`rose bench engine`'s workload: +4 % tok/s at 32, +6 % at 64 over 16, interleaved passes). A sequence wastes half
# a block on average, and prefix caching shares whole blocks only: 64 keeps both small next to typical prompts.
CPU_BLOCK_SIZE = 64
GPU_BLOCK_SIZE = 16  # vLLM's on GPUs, for the gather + SDPA path


def default_block_size(device: torch.device, flash: bool) -> int:
    """flash-attn's page size where its paged kernel serves the model (`flash`), else CPU_BLOCK_SIZE on CPU and
    GPU_BLOCK_SIZE elsewhere."""
    if flash:
        return flash_attention.PAGE_MULTIPLE
    return CPU_BLOCK_SIZE if device.type == "cpu" else GPU_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class StorePlan:
    block_size: int
    num_blocks: int
    max_model_len: int
    watermark_blocks: int


def plan_store(
    layers: AttentionLayers,
    device: torch.device,
    dtype: torch.dtype,
    *,
    context: int,
    max_num_seqs: int,
    max_model_len: int | None,
    max_kv_cache_bytes: int | None,
    num_gpu_blocks_override: int | None,
    block_size: int | None,
) -> StorePlan:
    """The pool's block size, its blocks (`num_gpu_blocks_override`, else what `max_kv_cache_bytes` or the device's
    default budget holds, at most `max_num_seqs` sequences of the longest length), the longest sequence it serves
    (`max_model_len` checked, else the model's `context` capped at the pool) and its admission watermark."""
    if block_size is None:
        flash = flash_attention.serves_any(layers.specs, layers.reference_implementation, device, dtype)
        block_size = default_block_size(device, flash)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_gpu_blocks_override is not None:
        if num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {num_gpu_blocks_override}")
        num_blocks = num_gpu_blocks_override
    else:
        budget = max_kv_cache_bytes if max_kv_cache_bytes is not None else default_kv_budget(device)
        num_blocks = pool_blocks(
            budget,
            KVCache.bytes_per_token(layers.specs, dtype) * block_size,
            max_num_seqs,
            max_model_len or context,
            block_size,
        )
    max_len = resolve_max_model_len(max_model_len, context, num_blocks * block_size)
    watermark = watermark_blocks(num_blocks, max_num_seqs, max_len, block_size)
    return StorePlan(block_size, num_blocks, max_len, watermark)


def pool_blocks(budget: int, block_bytes: int, max_num_seqs: int, max_len: int, block_size: int) -> int:
    """Blocks of `block_bytes` in `budget`, at most `max_num_seqs` sequences of `max_len` tokens' worth."""
    cap = max_num_seqs * -(-max_len // block_size)
    fit = budget // block_bytes
    if fit < 1:
        raise ValueError(
            f"a KV budget of {budget / 2**20:.2f} MiB does not hold one block of {block_size} tokens "
            f"({block_bytes / 2**20:.2f} MiB): raise max_kv_cache_bytes"
        )
    return int(min(cap, fit))


def watermark_blocks(num_blocks: int, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks kept free when admitting, so that running sequences can grow without preempting at once: ~1 % of
    the pool, at least one (a request admitted into the last free block would be the next step's victim). None
    where the pool holds `max_num_seqs` sequences of `max_model_len`: it never runs short."""
    if num_blocks >= max_num_seqs * -(-max_model_len // block_size):
        return 0
    return max(1, num_blocks // 100)


def resolve_max_model_len(requested: int | None, context: int, pool_tokens: int) -> int:
    """`requested` if the model's context and the pool allow it, else the longest that fits (a warning when that
    is below the context); an error naming what to change when even a short context does not fit."""
    if requested is not None:
        if requested < 1 or requested > context:
            raise ValueError(
                f"max_model_len must be in [1, {context}] (the model's context), got {requested}"
            )
        if requested > pool_tokens:
            raise ValueError(
                f"max_model_len {requested} is longer than the KV pool's {pool_tokens} tokens: lower "
                "max_model_len or raise max_kv_cache_bytes (or num_gpu_blocks_override)"
            )
        return requested
    if pool_tokens < min(context, _MIN_MODEL_LEN):
        raise ValueError(
            f"the KV pool holds only {pool_tokens} tokens: raise max_kv_cache_bytes (or num_gpu_blocks_override)"
        )
    if pool_tokens < context:
        logger.warning(
            "max_model_len capped at %d (model context %d) to fit the KV pool", pool_tokens, context
        )
    return int(min(context, pool_tokens))


def default_kv_budget(device: torch.device) -> int:
    """CUDA: 85% of free device memory (weights are loaded by then); CPU: a quarter of physical memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 4 * 2**30
