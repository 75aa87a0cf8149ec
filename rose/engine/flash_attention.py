"""Decode attention on CUDA through flash-attn's paged kernel, where flash-attn is installed.

`flash_attn_with_kvcache` reads each sequence's K/V straight from the paged store through its block table (the
store's layout, `[num_blocks, block_size, kv_heads, head_dim]`, is the one it takes), so decode needs no gather.
flash-attn 2 takes pages whose size is a multiple of 256 positions: the engine's default block size on such a
device is then 256 (rose.engine.kv_budget.default_block_size), and other block sizes keep the torch path (gather + SDPA). Layers it
cannot compute as transformers does (sinks, chunked attention, K and V of different head dims) and layers computed
by the model's own eager function take the torch path too. `ROSE_ATTENTION_BACKEND=sdpa` turns it off.

Not yet run on a GPU (no GPU was available while it was written): see ../shared/gpu-checklist.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable

import torch

from rose.engine.layer_spec import LayerSpec

logger = logging.getLogger(__name__)

PAGE_MULTIPLE = 256  # flash-attn 2: "page_block_size must be a multiple of 256"
_HALF = (torch.float16, torch.bfloat16)


def kernel() -> Callable | None:
    """flash-attn's `flash_attn_with_kvcache`, None when it is not installed."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device and dtype can run the kernel at all (CUDA, fp16 / bf16, flash-attn installed)."""
    if os.environ.get("ROSE_ATTENTION_BACKEND", "auto").lower() == "sdpa":
        return False
    return device.type == "cuda" and dtype in _HALF and kernel() is not None


def enabled(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    return usable(device, dtype) and block_size % PAGE_MULTIPLE == 0


def supports(spec: LayerSpec, fn: Callable) -> bool:
    """Layers whose attention the kernel `fn` computes as transformers does (soft-capping only where it takes
    `softcap=`: flash-attn 2.6 and later)."""
    if spec.softcap is not None and not _takes_softcap(fn):
        return False
    return not spec.sinks and spec.chunk is None and spec.v_head_dim == spec.head_dim and spec.head_dim <= 256


@functools.cache
def _takes_softcap(fn: Callable) -> bool:  # read once per kernel, not at every layer's call
    return "softcap" in inspect.signature(fn).parameters


def decode_attention(
    fn: Callable,
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    spec: LayerSpec,
) -> torch.Tensor:
    """q [n, heads, D] -> [n, heads, D]: each decoding token over positions [0, lengths[i]) of block table tables[i]
    (int32 [n, blocks]; lengths int32, the new token's K/V already stored), within the layer's sliding window."""
    # transformers' window W: a query sees (q - W, q], i.e. W - 1 keys to its left
    window = (spec.window - 1, 0) if spec.window is not None else (-1, -1)
    out = fn(
        q[:, None],
        k_store,
        v_store,
        cache_seqlens=lengths,
        block_table=tables,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        **({"softcap": spec.softcap} if spec.softcap is not None else {}),  # flash-attn < 2.6 has no softcap
    )
    return out[:, 0]
