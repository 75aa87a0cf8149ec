"""Keeps decode attention from reading padding: row ranges padded to their own longest row, rows kept sorted.

Decode attention reads every row it covers up to the longest context in the call. Two cheap host-side decisions keep
that padding small:
- `decode_groups` splits the occupied rows into a few contiguous ranges, each read only up to its own longest row
  (one attention call per range per layer, so a split must save enough reads to pay for its call);
- `plan_reorder` tells the scheduler when to sort the rows by context length, longest first, so that ranges are
  tight. Running sequences all grow by one token per step, so sorted rows stay sorted until sequences join or
  leave; a re-sort happens only when the reads it saves over the next steps outweigh the K/V rows it copies.

Lengths are in positions of one row; costs are padded positions read per layer per step.
"""

from __future__ import annotations

from itertools import accumulate

MAX_GROUPS = 4
# a split must save this many padded positions per layer to pay for one more attention call (~20 us on CPU)
MIN_GROUP_SAVING = 256
# a re-sort is worth it when its savings over this many steps exceed the positions it copies (x COPY_COST)
REORDER_HORIZON = 8
REORDER_COPY_COST = 2


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


def plan_reorder(lengths: list[int], computed: list[int]) -> list[int] | None:
    """The rows' new order (old row indices, longest context first) if sorting now pays, else None.

    `lengths`: each row's context in this step's decode attention; `computed`: the positions its K/V holds (what a
    move copies).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their rows
    if all(i == row for row, i in enumerate(order)):
        return None
    saving = padded_cost(lengths) - padded_cost([lengths[i] for i in order])
    copied = sum(computed[i] for row, i in enumerate(order) if i != row)
    if saving * REORDER_HORIZON > copied * REORDER_COPY_COST:
        return order
    return None
