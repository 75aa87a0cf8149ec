"""One layer's attention for one step over rose's paged KV store: write the step's K/V, attend each token over its
own sequence's blocks.

The step's tokens come flattened into one row: first one token per decoding sequence, then the prefill segments
(rose.engine.kv_cache.AttentionMetadata). On CUDA with flash-attn, one paged varlen call serves them all
(rose.engine.flash_attention). Otherwise decode tokens attend through the CPU kernels (exact spans read through the
block tables, float32 on CPU) or through SDPA over their blocks gathered in length-sorted groups; prefill segments
through SDPA over their own new K/V (a segment starting at position 0) or their sequence's gathered positions. Layers with soft-capping or sinks,
which SDPA cannot compute, take an `Eager` function on the same views and masks instead: the model's own eager
attention where its modeling module has one (rose.engine.model_binding), so that bf16 / fp16 round as transformers
does, else `eager_attention`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rose.engine import cpu_attention, flash_attention
from rose.engine.kv_cache import AttentionMetadata, KVCache
from rose.engine.layer_spec import LayerSpec

# (q [B, heads, L, D], k [B, kv_heads, S, D], v [B, kv_heads, S, Dv], visible bool [B or 1, 1, L, S], one of the
# step's cached masks) -> [B, L, heads, Dv]: one non-plain layer's attention over given views
Eager = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# cuDNN's SDPA builds an execution plan for each new (batch, query length, key length): a decode step's lengths
# change every step, so on an H100 (torch 2.11) plan building made steps 3-4x slower (63 -> 23 ms at batch 1,
# 84 -> 21 ms at batch 64, benchmarks/README.md "First CUDA run"); flash / memory-efficient need no plan
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends rose's steps run under on `device`: on CUDA every backend but cuDNN's; elsewhere torch's
    own choice."""
    return sdpa_kernel(_CUDA_SDPA) if device.type == "cuda" else contextlib.nullcontext()


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    spec: LayerSpec,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Grouped attention as transformers' eager functions compute it (scores, soft-cap, mask, softmax in float32
    with the sinks' logits, values; gpt-oss's own eager function takes its softmax in the model's dtype, which
    differs from this only by bf16 / fp16 rounding). q: [B, kv_heads, groups, L, D]; k: [B, kv_heads, S, D]; v: [B, kv_heads, S, Dv];
    visible: bool, broadcastable to [B, 1, 1, L, S], or None for plain causal (L == S). Returns [B, kv_heads,
    groups, L, Dv]."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if visible is None:
        length = scores.shape[-1]
        visible = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, spec.num_kv_heads, spec.groups, 1, 1)
        scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v.unsqueeze(2))


def spec_eager(spec: LayerSpec, scale: float, sinks: torch.Tensor | None) -> Eager:
    """`eager_attention` as an Eager function, for layers whose model has no eager function of its own."""

    def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        b, _, length, _ = q.shape
        qg = q.reshape(b, spec.num_kv_heads, spec.groups, length, spec.head_dim)
        out = eager_attention(qg, k, v, visible[:, :, None], scale, spec, sinks)
        return out.reshape(b, spec.num_heads, length, spec.v_head_dim).transpose(1, 2)

    return eager


def attend_layer(
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    eager: Eager | None = None,
) -> torch.Tensor:
    """query [1, heads, num_tokens, D], key [1, kv_heads, num_tokens, D], value [1, kv_heads, num_tokens, Dv] ->
    [num_tokens, heads, Dv], the step's K/V stored on the way. `eager` computes the layers SDPA cannot (soft-capping,
    sinks) outside the CPU kernels; by default `spec_eager`."""
    spec = cache.specs[layer]
    q = query[0].transpose(0, 1)  # [num_tokens, heads, D]
    if cache.flash is not None and eager is None and flash_attention.supports(spec, cache.flash):
        cache.write(layer, meta, key, value)  # every token's K/V first: the kernel reads them from the store
        inputs = meta.varlen_inputs(q.device)
        return flash_attention.attention(cache.flash, q, cache.k[layer], cache.v[layer], inputs, scale, spec)
    if not spec.plain and eager is None:
        eager = spec_eager(spec, scale, sinks)
    kernels = cache.use_cpu_kernels and meta.num_decode > 0
    cache.write(layer, meta, key, value, first=meta.num_decode if kernels else 0)
    parts = []
    if kernels:
        n = meta.num_decode
        tables, starts, ends = meta.decode_spans(spec.visibility, cache.num_blocks)
        out = cpu_attention.decode_attention(
            q[:n].reshape(n, spec.num_kv_heads, spec.groups, spec.head_dim),
            key[0, :, :n].transpose(0, 1),
            value[0, :, :n].transpose(0, 1),
            cache.k[layer],
            cache.v[layer],
            tables,
            starts,
            ends,
            scale,
            softcap=spec.softcap,
            sinks=sinks,
            spans_checked=True,
        )
        parts.append(out.reshape(n, spec.num_heads, spec.v_head_dim))
    elif meta.num_decode:
        parts.append(_attend_decode(cache, layer, meta, q[: meta.num_decode], scale, eager))
    for i, seg in enumerate(meta.prefills):
        q_seg = q[seg.offset : seg.offset + seg.length].transpose(0, 1)
        parts.append(_attend_prefill(cache, layer, meta, i, q_seg, key, value, scale, eager))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _attend_decode(
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    q: torch.Tensor,
    scale: float,
    eager: Eager | None,
) -> torch.Tensor:
    """q: [num_decode, heads, D] -> [num_decode, heads, Dv], each token over its own sequence's blocks."""
    spec = cache.specs[layer]
    groups, inverse = meta.decode_plan(q.device)
    parts = []
    for i, group in enumerate(groups):
        first_block, mask = meta.decode_mask(i, spec.visibility, q.device)
        k, v = cache.gather(
            layer, group.tables[:, first_block:], group.longest - first_block * meta.block_size
        )
        rows = len(group.rows)
        q_rows = q[group.rows]
        if eager is None:  # plain: SDPA (attend_layer gives an eager function to the others)
            # GQA without repeating K/V: the query heads sharing a KV head act as that head's query positions
            qg = q_rows.reshape(rows, spec.num_kv_heads, spec.groups, spec.head_dim)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        else:  # one query position per row: [rows, heads, 1, D] -> [rows, 1, heads, Dv]
            out = eager(q_rows[:, :, None], k, v, mask)
        parts.append(out.reshape(rows, spec.num_heads, spec.v_head_dim))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out if inverse is None else out[inverse]


def _attend_prefill(
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    index: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    eager: Eager | None,
) -> torch.Tensor:
    """q: [heads, length, D] of one segment -> [length, heads, Dv]. A segment starting at position 0 attends over
    this step's own K/V (the values just stored: nothing to gather); a later chunk over its sequence's blocks."""
    spec = cache.specs[layer]
    seg = meta.prefills[index]
    first, mask = meta.prefill_mask(index, spec.visibility, q.device)
    end = seg.start + seg.length
    if seg.start == 0:
        k = key[:, :, seg.offset + first : seg.offset + end].to(cache.k[layer].dtype)
        v = value[:, :, seg.offset + first : seg.offset + end].to(cache.v[layer].dtype)
    else:
        k, v = cache.positions(layer, seg.blocks, first, end)
    if eager is None:
        out = F.scaled_dot_product_attention(
            q[None], k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)
    if mask is None:  # plain causal over the segment's own tokens
        mask = meta.causal_mask(seg.length, q.device)
    return eager(q[None], k, v, mask)[0]
