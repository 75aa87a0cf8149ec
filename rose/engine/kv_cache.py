"""The engine's KV store and the attention function that plugs it into unmodified transformers models.

One store per engine, allocated once: per layer, K and V of shape [max_num_seqs, kv_heads, max_model_len, head_dim].
A running sequence owns one slot (a row); it writes the K/V of its new tokens at its own positions and never copies
anyone's cache. Occupied slots are always [0, num_slots_used): when a sequence leaves, the last occupied row is moved
into its place once, so a decode step attends over plain views K[a:b, :, :longest] with a per-row length mask, one
call per range of rows (rose.engine.slot_order keeps rows sorted by context length so those ranges are tight).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from rose.engine import cpu_attention

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "rose_slots"
CONTEXT_KWARG = (
    "rose_attn"  # the forward kwarg carrying the step's AttentionMetadata to every attention layer
)


@dataclass
class PrefillSegment:
    """A chunk of one sequence's prompt processed this step: tokens [start, start + length) of slot `slot`."""

    slot: int
    start: int
    length: int
    offset: int  # where its tokens begin in the step's flattened input


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step; built once per step, read by every layer.

    The step's tokens are flattened into one row: first one token per decoding sequence, then the prefill segments.
    """

    write_slots: torch.Tensor  # [num_tokens] slot of each token
    write_positions: torch.Tensor  # [num_tokens] position of each token
    num_decode: int
    # each decoding token's store row and context length after this step's write, in token order
    decode_rows: list[int] = field(default_factory=list)
    decode_row_lengths: list[int] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    # SDPA decode path only (see ModelRunner): it attends over store rows [0, decode_span) in row ranges.
    # decode_slots: [num_decode] row of each decoding token, None when they are 0..num_decode-1;
    # decode_lengths: [decode_span] context length of each row (1 for rows mid-prefill)
    decode_slots: torch.Tensor | None = None
    decode_span: int = 0
    decode_lengths: torch.Tensor | None = None
    # (start, end, longest): row ranges attended in one call each, read up to their own longest row
    decode_groups: list[tuple[int, int, int]] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)

    def decode_mask(self, group: int, window: int | None) -> torch.Tensor:
        """[rows, 1, 1, longest] of decode group `group`: True where a row may attend."""
        key = ("decode", group, window)
        if key not in self._masks:
            start, end, longest = self.decode_groups[group]
            pos = torch.arange(longest, device=self.decode_lengths.device)
            lengths = self.decode_lengths[start:end, None]
            mask = pos[None, :] < lengths
            if window is not None:
                mask &= pos[None, :] >= lengths - window
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def decode_spans(self, window: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, starts, ends) as int64 arrays: decoding token i attends over positions [starts[i], ends[i])."""
        key = ("spans", window)
        if key not in self._masks:
            ends = np.asarray(self.decode_row_lengths, dtype=np.int64)
            starts = np.zeros_like(ends) if window is None else np.maximum(ends - window, 0)
            self._masks[key] = (np.asarray(self.decode_rows, dtype=np.int64), starts, ends)
        return self._masks[key]

    def prefill_mask(self, index: int, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[1, 1, length, start + length] causal mask of segment `index`; None where plain causal attention works."""
        seg = self.prefills[index]
        if seg.start == 0 and window is None:
            return None
        key = ("prefill", index, window)
        if key not in self._masks:
            q_pos = torch.arange(seg.start, seg.start + seg.length, device=device)[:, None]
            k_pos = torch.arange(seg.start + seg.length, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            self._masks[key] = mask[None, None]
        return self._masks[key]


class KVCache:
    """Preallocated per-slot K/V tensors for every attention layer."""

    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (max_num_seqs, num_kv_heads, max_model_len, head_dim)
        # zeros, not empty: masked-out rows are multiplied by 0, and 0 * NaN garbage would be NaN
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # decode attention through rose.engine.cpu_attention's kernels (exact lengths) instead of SDPA
        self.use_cpu_kernels = cpu_attention.enabled(torch.device(device), dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @torch.inference_mode()  # the store may hold inference tensors (an engine built under inference_mode)
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (done once when a sequence leaves)."""
        for t in (*self.k, *self.v):
            t[dst, :, :length].copy_(t[src, :, :length])

    @torch.inference_mode()
    def move_rows(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` positions of rows `src` into rows `dst`, all sources read first (a permutation)."""
        src_t = torch.tensor(src, device=self.k[0].device)
        dst_t = torch.tensor(dst, device=self.k[0].device)
        for t in (*self.k, *self.v):
            view = t[:, :, :length]
            view.index_copy_(0, dst_t, view.index_select(0, src_t))

    def write(
        self, layer: int, meta: AttentionMetadata, key: torch.Tensor, value: torch.Tensor, first: int = 0
    ) -> None:
        """Store this step's K/V ([1, kv_heads, num_tokens, head_dim]) at each token's slot and position, from token
        `first` on (the CPU decode kernels store the decode tokens' K/V themselves)."""
        if first >= key.shape[2]:
            return
        k = key[0, :, first:].transpose(0, 1)  # [num_tokens, kv_heads, head_dim]
        v = value[0, :, first:].transpose(0, 1)
        slots, positions = meta.write_slots[first:], meta.write_positions[first:]
        self.k[layer][slots, :, positions] = k.to(self.k[layer].dtype)
        self.v[layer][slots, :, positions] = v.to(self.v[layer].dtype)


def _attend_decode(
    cache: KVCache, layer: int, meta: AttentionMetadata, q: torch.Tensor, scaling: float, window: int | None
) -> torch.Tensor:
    """q: [num_decode, heads, head_dim] -> [num_decode, heads, head_dim], attending over each row's own slot."""
    span, kv_heads = meta.decode_span, cache.num_kv_heads
    num_decode, heads, head_dim = q.shape
    groups = heads // kv_heads
    if meta.decode_slots is not None:
        # some occupied rows are mid-prefill: give them a dummy query so all rows run in one batched call
        full = q.new_zeros((span, heads, head_dim))
        full[meta.decode_slots] = q
        q = full
    # GQA without repeating K/V: the query heads sharing a KV head act as that head's query positions
    qg = q.view(span, kv_heads, groups, head_dim)
    parts = []
    for i, (start, end, longest) in enumerate(meta.decode_groups):
        k = cache.k[layer][start:end, :, :longest]
        v = cache.v[layer][start:end, :, :longest]
        mask = meta.decode_mask(i, window)
        parts.append(F.scaled_dot_product_attention(qg[start:end], k, v, attn_mask=mask, scale=scaling))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    out = out.reshape(span, heads, head_dim)
    if meta.decode_slots is not None:
        out = out[meta.decode_slots]
    return out


def _attend_prefill(
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    index: int,
    q: torch.Tensor,
    scaling: float,
    window: int | None,
) -> torch.Tensor:
    """q: [heads, length, head_dim] of one segment -> [length, heads, head_dim]."""
    seg = meta.prefills[index]
    end = seg.start + seg.length
    k = cache.k[layer][seg.slot : seg.slot + 1, :, :end]
    v = cache.v[layer][seg.slot : seg.slot + 1, :, :end]
    mask = meta.prefill_mask(index, window, q.device)
    out = F.scaled_dot_product_attention(
        q[None], k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def slot_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention hook: write this step's K/V into the store, attend each token over its own slot.

    query/key/value: [1, heads, num_tokens, head_dim] (the step's tokens flattened into one row).
    Returns [1, num_tokens, heads, head_dim] as transformers expects.
    """
    meta: AttentionMetadata | None = kwargs.get(CONTEXT_KWARG)
    cache: KVCache | None = getattr(module, "_rose_kv_cache", None)
    if meta is None or cache is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} runs only inside rose's Engine "
            f"(missing the {CONTEXT_KWARG!r} forward kwarg or the KV cache binding)"
        )
    layer = module.layer_idx
    if scaling is None:
        scaling = module.head_dim**-0.5
    window = getattr(module, "sliding_window", None)
    kernels = cache.use_cpu_kernels and meta.num_decode > 0
    cache.write(layer, meta, key, value, first=meta.num_decode if kernels else 0)

    q = query[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
    parts = []
    if kernels:
        n, heads, head_dim = meta.num_decode, q.shape[1], q.shape[2]
        kv_heads = cache.num_kv_heads
        rows, starts, ends = meta.decode_spans(window)
        out = cpu_attention.decode_attention(
            q[:n].reshape(n, kv_heads, heads // kv_heads, head_dim),
            key[0, :, :n].transpose(0, 1),
            value[0, :, :n].transpose(0, 1),
            cache.k[layer],
            cache.v[layer],
            rows,
            starts,
            ends,
            scaling,
        )
        parts.append(out.view(n, heads, head_dim))
    elif meta.num_decode:
        parts.append(_attend_decode(cache, layer, meta, q[: meta.num_decode], scaling, window))
    for i, seg in enumerate(meta.prefills):
        q_seg = q[seg.offset : seg.offset + seg.length].transpose(0, 1)
        parts.append(_attend_prefill(cache, layer, meta, i, q_seg, scaling, window))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, slot_attention_forward)


def bind_kv_cache(model: PreTrainedModel, cache: KVCache) -> None:
    """Point every module that has a `layer_idx` at the cache and switch the model to our attention.

    The engine owns the model from then on: its attention runs only inside the engine.
    """
    for module in model.modules():
        if getattr(module, "layer_idx", None) is not None:
            module._rose_kv_cache = cache
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
