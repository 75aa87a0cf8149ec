"""Keeps SDPA decode attention from reading padding: decoding sequences in groups, each padded to its own longest.

The SDPA decode path (CUDA, low precision, ROSE_ATTENTION_BACKEND=sdpa) gathers each decoding sequence's blocks into
a padded batch and reads every row up to the longest context in the call. The runner sorts the decoding sequences
by context length (longest first: a gather, so ordering costs nothing) and `decode_groups` splits them into a few
contiguous ranges, each read only up to its own longest row (one attention call per range per layer, so a split
must save enough reads to pay for its call). The CPU kernels read exact lengths and need none of this.

Lengths are in positions; costs are padded positions read per layer per step.
"""

from __future__ import annotations

from itertools import accumulate

MAX_GROUPS = 4
# a split must save this many padded positions per layer to pay for one more attention call (~20 us on CPU)
MIN_GROUP_SAVING = 256


def _best_split(lengths: list[int], a: int, b: int) -> tuple[int, int]:
    """(saving, split index) of the best way to cut range [a, b) in two; saving 0 when no cut helps."""
    seg = lengths[a:b]
    n = len(seg)
    if n < 2:
        return 0, a
    prefix = list(accumulate(seg, max))  # prefix[i] = max(seg[: i + 1])
    suffix = list(accumulate(reversed(seg), max))[::-1]  # suffix[i] = max(seg[i:])
    whole = n * prefix[-1]
    cost, cut = min((c * prefix[c - 1] + (n - c) * suffix[c], c) for c in range(1, n))
    return whole - cost, a + cut


def decode_groups(lengths: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous ranges (start, end, longest) covering `lengths` (in row order), at most MAX_GROUPS of them."""
    if not lengths:
        return []
    bounds = [0, len(lengths)]
    while len(bounds) <= MAX_GROUPS:
        saving, cut = max(_best_split(lengths, a, b) for a, b in zip(bounds, bounds[1:], strict=False))
        if saving < MIN_GROUP_SAVING:
            break
        bounds.append(cut)
        bounds.sort()
    return [(a, b, max(lengths[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)]


def padded_cost(lengths: list[int]) -> int:
    """Positions decode attention reads for rows in this order (per layer, per step)."""
    return sum((b - a) * longest for a, b, longest in decode_groups(lengths))
