"""What one attention layer of a model computes, in the terms rose's KV store and attention paths need.

A `LayerSpec` is read off the model itself (rose.engine.model_probe probes one forward), never guessed from the
config: the layer's head counts and head dims as its attention function receives them (K and V may differ), and
the semantics transformers gives that layer's attention — which key positions a query sees, logit soft-capping and
attention sinks. Visibility follows transformers' mask functions exactly: causal (position q sees [0, q]), a
sliding window of W (q sees (q - W, q]) or chunked attention of size C (q sees [q // C * C, q]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

Positions = TypeVar("Positions", int, np.ndarray, torch.Tensor)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int  # of the queries and keys
    v_head_dim: int
    window: int | None = None  # sliding window: q sees (q - window, q]
    chunk: int | None = None  # chunked attention: q sees [q // chunk * chunk, q]
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), before the mask
    sinks: bool = False  # one learned logit per head joins each softmax (gpt-oss); its probability is dropped

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not share {self.num_kv_heads} KV heads evenly")
        if self.window is not None and self.chunk is not None:
            raise ValueError("a layer has a sliding window or chunked attention, not both")

    @property
    def groups(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def visibility(self) -> tuple[int | None, int | None]:
        """(window, chunk): the key for masks shared by every layer that sees the same positions."""
        return self.window, self.chunk

    @property
    def plain(self) -> bool:
        """Softmax(QK^T) V with a mask and nothing else: SDPA computes it."""
        return self.softcap is None and not self.sinks

    def describe(self) -> str:
        """One line for logs: heads, dims and the features that apply."""
        parts = [f"{self.num_heads} heads / {self.num_kv_heads} KV heads, head dim {self.head_dim}"]
        if self.v_head_dim != self.head_dim:
            parts.append(f"V head dim {self.v_head_dim}")
        if self.window is not None:
            parts.append(f"sliding window {self.window}")
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk}")
        if self.softcap is not None:
            parts.append(f"soft-cap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return ", ".join(parts)


def first_needed(visibilities: frozenset[tuple[int | None, int | None]], position: int) -> int:
    """The first key position that a query at `position` or later sees in any layer of these visibilities (the
    distinct `LayerSpec.visibility` of a model's layers): 0 as soon as one layer attends to the whole context; with
    a window or chunks in every layer, the earlier positions are never read again."""
    return min((first_visible(position, *v) for v in visibilities), default=0)


def first_visible(last: Positions, window: int | None, chunk: int | None) -> Positions:
    """The first key position that a query at position `last` sees (ints, numpy arrays or tensors)."""
    if window is not None:
        if isinstance(last, int):
            return max(last - window + 1, 0)
        return (last - window + 1).clip(min=0)
    if chunk is not None:
        return last // chunk * chunk
    return last * 0
