"""A grammar's next-token bitmask applied to float32 CPU logits by a numba kernel.

The bitmask (rose.engine.grammar_backends' layout: int32 words, bit j of word w allows token 32 * w + j) is read
word by word, and only the disallowed logits are written (-inf). A word of 32 allowed tokens (-1) costs one
compare: inside a free JSON string nearly every word is, so a row costs little more than reading its bitmask; a
word of 32 masked tokens (0), as most are where the grammar allows a few, is one 32-wide store.
At a 151k vocabulary the embedding-lookup mask (rose.engine.grammar) writes a float per token per row, then adds
it: 17 ms for 64 rows on 2 cores against this kernel's ~1-6 ms (benchmarks/README.md, structured outputs).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

try:
    from numba import njit, prange
except ImportError:  # pragma: no cover - numba is a dependency; the lookup mask is used without it
    njit = None


if njit is not None:

    def _kernel(logits, bitmask, rows, vocab):  # pragma: no cover - compiled
        words = bitmask.shape[1]
        for i in prange(bitmask.shape[0]):
            row = rows[i]
            for w in range(words):
                word = bitmask[i, w]
                if word == -1:
                    continue
                base = w * 32
                if word == 0 and base + 32 <= vocab:  # 32 masked tokens: one store the compiler vectorizes
                    logits[row, base : base + 32] = -np.inf
                    continue
                for j in range(32):
                    token = base + j
                    if token >= vocab:
                        break
                    if (word >> j) & 1 == 0:
                        logits[row, token] = -np.inf

    try:
        _apply = njit(parallel=True, nogil=True, cache=True)(_kernel)
    except RuntimeError as exc:  # "cannot cache function ...: no locator available"
        logger.warning("numba cannot cache the bitmask kernel (%s); compiling it in each process", exc)
        _apply = njit(parallel=True, nogil=True)(_kernel)


def warm() -> None:
    """Compile (or load from numba's cache) the kernel now, not in the first constrained step (~1 s cold)."""
    if njit is not None:
        _apply(np.zeros((1, 32), np.float32), np.full((1, 1), -1, np.int32), np.zeros(1, np.int64), 32)


def usable(logits: torch.Tensor) -> bool:
    """Whether the kernel can mask these logits (float32 on CPU, numba installed)."""
    return njit is not None and logits.device.type == "cpu" and logits.dtype == torch.float32


def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Set to -inf, in place, the logits of `logits[rows[i]]` whose bit is 0 in `bitmask[i]` (tokens below
    `vocab_size`). Only for `usable` logits."""
    _apply(
        logits.detach().numpy(),
        bitmask.numpy(),
        np.asarray(rows, dtype=np.int64),
        vocab_size,
    )
