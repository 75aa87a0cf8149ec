"""The engine's paged KV store and the per-step metadata its attention paths read.

One store per engine, allocated once: per attention layer, K of shape [num_blocks, block_size, kv_heads, head_dim]
and V of shape [num_blocks, block_size, kv_heads, v_head_dim], each layer with its own geometry
(rose.engine.layer_spec). The block ids are the pool's (rose.engine.block_pool); a sequence's block table says where
its positions live, so a sequence never moves and a shared prefix block is read by every sequence holding it. One
position's heads are contiguous (the layout flash-attn's paged kernels take too): the CPU kernels read a position's
K/V for all heads in one stream, and a step's K/V are written with one scatter over flat slot indices
(block * block_size + offset).
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from rose.engine import cpu_attention, flash_attention
from rose.engine.decode_groups import decode_groups
from rose.engine.layer_spec import LayerSpec, first_visible

logger = logging.getLogger(__name__)

Visibility = tuple[int | None, int | None]  # LayerSpec.visibility: (window, chunk)


@dataclass(slots=True)
class PrefillSegment:
    """A chunk of one sequence's prefill this step: its positions [start, start + length), held in `blocks`."""

    blocks: list[int]  # the sequence's block table
    start: int
    length: int
    offset: int  # where its tokens begin in the step's flattened input


@dataclass(slots=True)
class DecodeGroup:
    """SDPA decode: decoding tokens `rows` (indices into the decode tokens), their block tables `tables`
    [rows, blocks] padded with block 0, their context `lengths`, read up to `longest` positions (from the first
    block the `shortest` row's window reaches, AttentionMetadata.decode_mask)."""

    rows: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    longest: int
    shortest: int


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step; built once per step, read by every layer.

    The step's tokens are flattened into one row: first one token per decoding sequence, then the prefill segments.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block * block_size + offset) of each token
    num_decode: int
    block_size: int
    # decoding token i: its sequence's block table (padded with 0) and context length after this step's write
    decode_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 1), dtype=np.int64))
    decode_lengths: list[int] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    _cached: dict = field(default_factory=dict)

    def decode_spans(
        self, visibility: Visibility, num_blocks: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tables, starts, ends) as int64 arrays: decoding token i attends over positions [starts[i], ends[i]) of
        block table tables[i], checked once per step against a pool of `num_blocks` (cpu_attention.check_spans)."""
        key = ("spans", visibility)
        if key not in self._cached:
            ends = np.asarray(self.decode_lengths, dtype=np.int64)
            starts = first_visible(ends - 1, *visibility)
            tables = self.decode_tables
            cpu_attention.check_spans(
                tables, starts, ends, n=self.num_decode, num_blocks=num_blocks, block_size=self.block_size
            )
            self._cached[key] = (tables, starts, ends)
        return self._cached[key]

    def varlen_inputs(self, device: torch.device) -> flash_attention.VarlenInputs:
        """The step's sequences for flash-attn's varlen kernel: each decoding token one query over its context,
        then each prefill segment its queries over positions [0, start + length)."""
        if "varlen" not in self._cached:
            q_lens = [1] * self.num_decode + [seg.length for seg in self.prefills]
            k_lens = list(self.decode_lengths) + [seg.start + seg.length for seg in self.prefills]
            width = max([self.decode_tables.shape[1], *(len(seg.blocks) for seg in self.prefills)])
            tables = np.zeros((len(q_lens), width), dtype=np.int32)  # padded with block 0: never read
            tables[: self.num_decode, : self.decode_tables.shape[1]] = self.decode_tables
            for i, seg in enumerate(self.prefills, start=self.num_decode):
                tables[i, : len(seg.blocks)] = seg.blocks
            self._cached["varlen"] = flash_attention.VarlenInputs(
                cu_seqlens_q=torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32, device=device),
                cu_seqlens_k=torch.tensor(np.cumsum([0, *k_lens]), dtype=torch.int32, device=device),
                max_seqlen_q=max(q_lens),
                max_seqlen_k=max(k_lens),
                block_table=torch.from_numpy(tables).to(device),
            )
        return self._cached["varlen"]

    def decode_plan(self, device: torch.device) -> tuple[list[DecodeGroup], torch.Tensor | None]:
        """SDPA decode: the decoding tokens sorted longest first and split into groups (rose.engine.decode_groups);
        with the permutation that puts the groups' concatenated outputs back in token order (None: already)."""
        if "plan" not in self._cached:
            order = sorted(range(self.num_decode), key=lambda i: -self.decode_lengths[i])
            lengths = [self.decode_lengths[i] for i in order]
            groups = []
            for start, end, longest in decode_groups(lengths):
                rows = order[start:end]
                blocks = -(-longest // self.block_size)
                tables = torch.from_numpy(self.decode_tables[rows, :blocks]).to(device, non_blocking=True)
                groups.append(
                    DecodeGroup(
                        rows=torch.tensor(rows, device=device),
                        tables=tables,
                        lengths=torch.tensor(lengths[start:end], device=device),
                        longest=longest,
                        shortest=min(lengths[start:end]),
                    )
                )
            inverse = None
            if order != sorted(order):
                inverse = torch.empty(self.num_decode, dtype=torch.long)
                inverse[torch.tensor(order)] = torch.arange(self.num_decode)
                inverse = inverse.to(device)
            self._cached["plan"] = (groups, inverse)
        return self._cached["plan"]

    def decode_mask(
        self, group: int, visibility: Visibility, device: torch.device
    ) -> tuple[int, torch.Tensor]:
        """(first_block, mask) of decode group `group`: no row sees a position before block `first_block` of its
        table (a window or chunks leave them behind), and mask [rows, 1, 1, longest - first_block * block_size]
        is True where a row may attend among the positions from there on."""
        key = ("decode", group, visibility)
        if key not in self._cached:
            g = self.decode_plan(device)[0][group]
            # first_visible never decreases with the position: the shortest row reaches back furthest
            first_block = first_visible(g.shortest - 1, *visibility) // self.block_size
            pos = torch.arange(first_block * self.block_size, g.longest, device=device)
            lengths = g.lengths[:, None]
            mask = pos[None, :] < lengths
            if visibility != (None, None):
                mask &= pos[None, :] >= first_visible(lengths - 1, *visibility)
            self._cached[key] = (first_block, mask[:, None, None, :])
        return self._cached[key]

    def causal_mask(self, length: int, device: torch.device) -> torch.Tensor:
        """[1, 1, length, length] plain causal mask, built once per step (eager layers need it materialized)."""
        key = ("causal", length)
        if key not in self._cached:
            self._cached[key] = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
        return self._cached[key]

    def additive_mask(self, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`visible` (one of this step's masks) as transformers' additive mask: 0 where visible, dtype's min
        elsewhere; built once per step and mask for every layer."""
        key = ("additive", id(visible), dtype)
        if key not in self._cached:
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
            self._cached[key] = (visible, mask)  # holds `visible`, so its id cannot be reused within the step
        return self._cached[key][1]

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
        if key not in self._cached:
            q_pos = torch.arange(seg.start, seg.start + seg.length, device=device)[:, None]
            k_pos = torch.arange(first, seg.start + seg.length, device=device)[None, :]
            mask = (k_pos <= q_pos) & (k_pos >= first_visible(q_pos, *visibility))
            self._cached[key] = mask[None, None]
        return first, self._cached[key]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed store tensor. Zeros, not garbage: the SDPA path reads padding past a sequence's length (masked out,
    so multiplied by 0, and 0 * NaN would be NaN). On CPU it lives in an anonymous mapping, whose pages the kernel
    hands out zeroed on their first write: the process's memory grows with the blocks actually used, not with the
    pool's size (torch.zeros would write every page up front)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    # private: reading an untouched page maps the zero page (a shared mapping would make it resident)
    buffer = mmap.mmap(
        -1, numel * torch.empty((), dtype=dtype).element_size(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping


class KVCache:
    """The block pool's K/V tensors for every attention layer, each layer shaped by its LayerSpec."""

    def __init__(
        self,
        specs: list[LayerSpec],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size)
        self.k = [_zeros((*shape, s.num_kv_heads, s.head_dim), dtype, torch.device(device)) for s in specs]
        self.v = [_zeros((*shape, s.num_kv_heads, s.v_head_dim), dtype, torch.device(device)) for s in specs]
        self.specs = list(specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # decode attention through rose.engine.cpu_attention's kernels (exact lengths) instead of SDPA
        self.use_cpu_kernels = cpu_attention.enabled(torch.device(device), dtype)
        # CUDA: flash-attn's paged varlen kernel for the whole step, where installed and the block size suits it
        self.flash = (
            flash_attention.kernel()
            if flash_attention.enabled(torch.device(device), dtype, block_size)
            else None
        )

    @staticmethod
    def bytes_per_token(specs: list[LayerSpec], dtype: torch.dtype) -> int:
        """K and V bytes one position takes across all layers."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(s.num_kv_heads * (s.head_dim + s.v_head_dim) for s in specs) * size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(
        self, layer: int, meta: AttentionMetadata, key: torch.Tensor, value: torch.Tensor, first: int = 0
    ) -> None:
        """Store this step's K/V ([1, kv_heads, num_tokens, head_dim]) at each token's slot, from token `first` on
        (the CPU decode kernels store the decode tokens' K/V themselves)."""
        if first >= key.shape[2]:
            return
        k_store, v_store = self.k[layer], self.v[layer]
        slots = meta.slot_mapping[first:]
        k_store.view(-1, *k_store.shape[2:])[slots] = key[0, :, first:].transpose(0, 1).to(k_store.dtype)
        v_store.view(-1, *v_store.shape[2:])[slots] = value[0, :, first:].transpose(0, 1).to(v_store.dtype)

    def gather(self, layer: int, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of block tables `tables` [rows, blocks], positions [0, length): [rows, kv_heads, length, dim]
        each (a copy; the rows' positions past their own length are padding)."""
        rows, blocks = tables.shape
        out = []
        for store in (self.k[layer], self.v[layer]):
            picked = store[tables].view(rows, blocks * self.block_size, *store.shape[2:])
            out.append(picked[:, :length].transpose(1, 2))
        return out[0], out[1]

    def positions(
        self, layer: int, blocks: list[int], first: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one sequence's positions [first, end), block table `blocks`: [1, kv_heads, end - first, dim]."""
        lo, hi = first // self.block_size, -(-end // self.block_size)
        index = torch.tensor(blocks[lo:hi], device=self.k[layer].device)
        k, v = self.gather(layer, index[None], end - lo * self.block_size)
        skip = first - lo * self.block_size
        return k[:, :, skip:], v[:, :, skip:]
