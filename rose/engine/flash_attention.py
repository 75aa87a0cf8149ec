"""Attention on CUDA through flash-attn's paged varlen kernel, where flash-attn is installed.

`flash_attn_varlen_func(..., block_table=...)` reads each sequence's K/V straight from the paged store through its
block table (the store's layout, `[num_blocks, block_size, kv_heads, head_dim]`, is the one it takes), so one call
per layer serves the whole step: every decoding token (one query over its context) and every prefill chunk (its
queries over its context so far, causal from the bottom right), with no gather and no per-sequence loop, as vLLM
V1's FlashAttention backend does. flash-attn 2 takes pages whose size is a multiple of 256 positions: the engine's
default block size on such a device is then 256 (rose.engine.kv_budget.default_block_size), and other block sizes
keep the torch path (SDPA per prefill chunk, gather + SDPA for decode). Layers it cannot compute as transformers
does (sinks, chunked attention, K and V of different head dims, soft-capping before flash-attn 2.6) and layers
computed by the model's own eager function take the torch path too; a model none of whose layers would take it
keeps CUDA's default block size of 16. `ROSE_ATTENTION_BACKEND=sdpa` turns it off.

Not yet run on a GPU (no GPU was available while it was written): its wiring is checked on CPU against a stand-in
with the kernel's documented semantics (tests/engine/test_cpu_attention.py); see ../shared/gpu-checklist.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rose.engine.layer_spec import LayerSpec

logger = logging.getLogger(__name__)

PAGE_MULTIPLE = 256  # flash-attn 2: "page_block_size must be a multiple of 256"
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class VarlenInputs:
    """One step's sequences as the kernel takes them: sequence i has queries cu_seqlens_q[i]:cu_seqlens_q[i + 1]
    of the step's tokens and a context of cu_seqlens_k[i + 1] - cu_seqlens_k[i] positions (its new tokens'
    K/V already stored) in block table block_table[i]; int32 tensors on the device."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor


@functools.cache
def kernel() -> Callable | None:
    """flash-attn's `flash_attn_varlen_func`, None when it is not installed or takes no block table (< 2.5)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        logger.warning("flash-attn without paged varlen attention (block_table): using the torch path")
        return None
    return flash_attn_varlen_func


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device and dtype can run the kernel at all (CUDA, fp16 / bf16, flash-attn installed)."""
    if os.environ.get("ROSE_ATTENTION_BACKEND", "auto").lower() == "sdpa":
        return False
    return device.type == "cuda" and dtype in _HALF and kernel() is not None


def enabled(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    return usable(device, dtype) and block_size % PAGE_MULTIPLE == 0


def serves_any(
    specs: list[LayerSpec], reference_implementation: str, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether some layer of a model would run the kernel here (then the pool takes the kernel's page size): a
    plain layer it supports, in a model that did not come with eager attention (whose layers all run the model's
    own eager function)."""
    fn = kernel() if usable(device, dtype) else None
    if fn is None or reference_implementation == "eager":
        return False
    return any(spec.plain and supports(spec, fn) for spec in specs)


def supports(spec: LayerSpec, fn: Callable) -> bool:
    """Layers whose attention the kernel `fn` computes as transformers does (soft-capping only where it takes
    `softcap=`: flash-attn 2.6 and later)."""
    if spec.softcap is not None and not _takes_softcap(fn):
        return False
    # head dims flash-attn pads to a multiple of 8 would have it copy the whole paged store at every call
    return (
        not spec.sinks
        and spec.chunk is None
        and spec.v_head_dim == spec.head_dim
        and spec.head_dim <= 256
        and spec.head_dim % 8 == 0
    )


@functools.cache
def _takes_softcap(fn: Callable) -> bool:  # read once per kernel, not at every layer's call
    return "softcap" in inspect.signature(fn).parameters


def attention(
    fn: Callable,
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    inputs: VarlenInputs,
    scale: float,
    spec: LayerSpec,
) -> torch.Tensor:
    """q [num_tokens, heads, D] (the step's tokens, sequence by sequence as `inputs` counts them) -> [num_tokens,
    heads, D]: each token over its sequence's positions up to its own, within the layer's sliding window."""
    # transformers' window W: a query sees (q - W, q], i.e. W - 1 keys to its left
    window = (spec.window - 1, 0) if spec.window is not None else (-1, -1)
    return fn(
        q,
        k_store,
        v_store,
        inputs.cu_seqlens_q,
        inputs.cu_seqlens_k,
        inputs.max_seqlen_q,
        inputs.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        block_table=inputs.block_table,
        **({"softcap": spec.softcap} if spec.softcap is not None else {}),  # flash-attn < 2.6 has no softcap
    )
