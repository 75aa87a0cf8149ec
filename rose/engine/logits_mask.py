"""A grammar's next-token bitmask applied to a step's logits (rose.engine.grammar fills it, this sets the
disallowed logits to -inf).

The bitmask is both grammar backends' layout: int32 words, bit j of word w allows token 32 * w + j
(`allocate_bitmask`). `LogitsMasker` owns the host bitmask a step fills and the kernel that applies it:

* CPU, float32: a numba kernel that writes only the disallowed tokens (rose.engine.cpu_bitmask: ~0 ms for 64
  free-string rows at 151k tokens, against 17 ms for the lookup below);
* other CPU dtypes: one float row per bitmask byte (0 allowed / -inf masked, bit j = token 8 * byte + j), an
  embedding lookup + add: ~0.4 ms for 64 x 8192 against ~1.7 ms for xgrammar's CPU kernel (2 threads);
* CUDA (or `mask_backend="xgrammar"`): xgrammar's kernel on the device.
"""

from __future__ import annotations

import sys

import torch

from rose.engine import cpu_bitmask
from rose.engine.grammar_backends import apply_bitmask_kernel

_NEG_INF = float("-inf")
MASK_BACKENDS = ("auto", "numba", "lookup", "xgrammar")


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask of `rows` rows over `vocab_size` tokens, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class LogitsMasker:
    """The bitmask buffer of a step and its application. `mask_backend`: "numba", "lookup" (CPU, little-endian
    only), "xgrammar" (its kernel), "auto" (numba / lookup on CPU, xgrammar elsewhere)."""

    def __init__(self, vocab_size: int, device: torch.device, mask_backend: str = "auto") -> None:
        if mask_backend not in MASK_BACKENDS:
            raise ValueError(
                f"mask_backend must be one of {', '.join(map(repr, MASK_BACKENDS))}, got {mask_backend!r}"
            )
        lut_ok = device.type == "cpu" and sys.byteorder == "little"
        if mask_backend in ("lookup", "numba") and not lut_ok:
            raise ValueError(f"mask_backend {mask_backend!r} needs a little-endian CPU device")
        self.vocab_size = vocab_size
        self._use_lut = lut_ok if mask_backend == "auto" else mask_backend in ("lookup", "numba")
        self._use_numba = mask_backend in ("auto", "numba")
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        self._byte_lut = torch.zeros(256, 8).masked_fill_(bits == 0, _NEG_INF)
        self._bitmask = allocate_bitmask(1, vocab_size)

    def bitmask(self, rows: int) -> torch.Tensor:
        """The host bitmask for `rows` rows to fill (reused from step to step: grown, never shrunk)."""
        if self._bitmask.shape[0] < rows:
            self._bitmask = allocate_bitmask(max(rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        return self._bitmask[:rows]

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Mask, in place, the rows `rows` of `logits` by the rows of `bitmask` (one per entry of `rows`, in order);
        columns from `vocab_size` on are left alone."""
        n, vocab = len(rows), self.vocab_size
        whole = n == logits.shape[0]
        if not self._use_lut:
            device_mask = bitmask.to(logits.device, non_blocking=True)
            if whole:
                apply_bitmask_kernel(logits, device_mask, vocab)
            else:
                # xgrammar's indices pick rows of the logits; the bitmask has one row per logits row
                full = torch.full(
                    (logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device
                )
                full[rows] = device_mask
                apply_bitmask_kernel(logits, full, vocab, indices=rows)
        elif self._use_numba and cpu_bitmask.usable(logits):
            cpu_bitmask.apply(logits, bitmask, rows, vocab)
        else:
            add = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), self._byte_lut)
            add = add.view(n, -1)[:, :vocab].to(logits.dtype)
            if whole:
                logits[:, :vocab] += add
            else:  # one in-place kernel on the constrained rows only
                logits[:, :vocab].index_add_(0, torch.tensor(rows, device=logits.device), add)
