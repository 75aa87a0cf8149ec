"""The engine's KV store and the per-step metadata its attention paths read.

One store per engine, allocated once: per attention layer, K of shape [rows, kv_heads, max_model_len, head_dim] and
V of shape [rows, kv_heads, max_model_len, v_head_dim], each layer with its own geometry (rose.engine.layer_spec). A
running sequence owns one slot (a row); it writes the K/V of its new tokens at its own positions and never copies
anyone's cache. Occupied slots are always [0, num_slots_used): when a sequence leaves, the last occupied row is moved
into its place once, so a decode step attends over plain views K[a:b, :, :longest] with a per-row mask, one call per
range of rows (rose.engine.slot_order keeps rows sorted by context length so those ranges are tight).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from rose.engine import cpu_attention
from rose.engine.layer_spec import LayerSpec, first_visible

logger = logging.getLogger(__name__)

Visibility = tuple[int | None, int | None]  # LayerSpec.visibility: (window, chunk)


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

    def decode_mask(self, group: int, visibility: Visibility) -> torch.Tensor:
        """[rows, 1, 1, longest] of decode group `group`: True where a row may attend."""
        key = ("decode", group, visibility)
        if key not in self._masks:
            start, end, longest = self.decode_groups[group]
            pos = torch.arange(longest, device=self.decode_lengths.device)
            lengths = self.decode_lengths[start:end, None]
            mask = pos[None, :] < lengths
            if visibility != (None, None):
                mask &= pos[None, :] >= first_visible(lengths - 1, *visibility)
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def decode_spans(
        self, visibility: Visibility, rows: int, max_len: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, starts, ends) as int64 arrays: decoding token i attends over positions [starts[i], ends[i]),
        checked once per step against a store of `rows` rows of `max_len` positions (cpu_attention.check_spans)."""
        key = ("spans", visibility)
        if key not in self._masks:
            ends = np.asarray(self.decode_row_lengths, dtype=np.int64)
            starts = first_visible(ends - 1, *visibility)
            slots = np.asarray(self.decode_rows, dtype=np.int64)
            cpu_attention.check_spans(slots, starts, ends, n=self.num_decode, rows=rows, max_len=max_len)
            self._masks[key] = (slots, starts, ends)
        return self._masks[key]

    def causal_mask(self, length: int, device: torch.device) -> torch.Tensor:
        """[1, 1, length, length] plain causal mask, built once per step (eager layers need it materialized)."""
        key = ("causal", length)
        if key not in self._masks:
            self._masks[key] = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
        return self._masks[key]

    def additive_mask(self, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`visible` (one of this step's masks) as transformers' additive mask: 0 where visible, dtype's min
        elsewhere; built once per step and mask for every layer."""
        key = ("additive", id(visible), dtype)
        if key not in self._masks:
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
            self._masks[key] = (visible, mask)  # holds `visible`, so its id cannot be reused within the step
        return self._masks[key][1]

    def prefill_mask(
        self, index: int, visibility: Visibility, device: torch.device
    ) -> tuple[int, torch.Tensor | None]:
        """(first, mask) for segment `index`: its queries see keys from position `first` on, through `mask`
        [1, 1, length, start + length - first]; mask None where plain causal attention over them is exact."""
        seg = self.prefills[index]
        first = first_visible(seg.start, *visibility)
        if seg.start == 0 and visibility == (None, None):
            return 0, None
        key = ("prefill", index, visibility)
        if key not in self._masks:
            q_pos = torch.arange(seg.start, seg.start + seg.length, device=device)[:, None]
            k_pos = torch.arange(first, seg.start + seg.length, device=device)[None, :]
            mask = (k_pos <= q_pos) & (k_pos >= first_visible(q_pos, *visibility))
            self._masks[key] = mask[None, None]
        return first, self._masks[key]


class KVCache:
    """Preallocated per-slot K/V tensors for every attention layer, each layer shaped by its LayerSpec."""

    def __init__(
        self,
        specs: list[LayerSpec],
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # zeros, not empty: masked-out rows are multiplied by 0, and 0 * NaN garbage would be NaN
        self.k = [
            torch.zeros((max_num_seqs, s.num_kv_heads, max_model_len, s.head_dim), dtype=dtype, device=device)
            for s in specs
        ]
        self.v = [
            torch.zeros(
                (max_num_seqs, s.num_kv_heads, max_model_len, s.v_head_dim), dtype=dtype, device=device
            )
            for s in specs
        ]
        self.specs = list(specs)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # decode attention through rose.engine.cpu_attention's kernels (exact lengths) instead of SDPA
        self.use_cpu_kernels = cpu_attention.enabled(torch.device(device), dtype)

    @staticmethod
    def bytes_per_token(specs: list[LayerSpec], dtype: torch.dtype) -> int:
        """K and V bytes one position of one row takes across all layers."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.num_kv_heads * (s.head_dim + s.v_head_dim) for s in specs) * size

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
