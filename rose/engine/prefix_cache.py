"""Prefix caching: reuse the K/V of a prompt prefix that is still held in the store.

Sources are the rows of running sequences (their computed prompt blocks) and of recently finished sequences, which
are kept in spare rows of the store beyond `max_num_seqs` under an LRU budget. Token blocks are identified by chained
hashes (a block's hash covers every token before it), so one hash lookup finds a row holding the whole prefix; the
tokens are compared too, so a hash collision can never reuse wrong K/V. A new request whose prefix is found gets the
prefix rows copied into its slot once and starts its prefill after them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from rose.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`."""
    hashes, prev = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, *token_ids[start : start + block_size]))
        hashes.append(prev)
    return hashes


@dataclass(eq=False)
class RetainedRow:
    """A finished sequence's K/V kept in a spare row."""

    slot: int
    token_ids: list[int]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # requests looked up
    hits: int = 0  # requests that reused a prefix
    query_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens not recomputed
    retained: int = 0
    evicted: int = 0


@dataclass
class PrefixMatch:
    src_slot: int
    num_tokens: int


@dataclass
class PrefixCache:
    block_size: int
    first_spare_slot: int
    num_spare_slots: int
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self._index: dict[int, Sequence | RetainedRow] = {}
        self._registered: dict[int, int] = {}  # id(sequence) -> blocks registered so far
        self._free = list(range(self.first_spare_slot, self.first_spare_slot + self.num_spare_slots))
        self._lru: OrderedDict[int, RetainedRow] = OrderedDict()  # slot -> row, least recently used first

    # ------------------------------------------------------------------ lookups

    def _holder_tokens(self, holder: Sequence | RetainedRow) -> list[int]:
        if isinstance(holder, RetainedRow):
            return holder.token_ids
        return holder.prompt_token_ids

    def _match_blocks(self, hashes: list[int]) -> tuple[int, Sequence | RetainedRow | None]:
        for n in range(len(hashes), 0, -1):
            holder = self._index.get(hashes[n - 1])
            if holder is not None:
                return n, holder
        return 0, None

    def match(self, seq: Sequence) -> PrefixMatch | None:
        """The longest held prefix of `seq`'s prompt (at most prompt - 1 tokens: the last one must run)."""
        hashes = seq.block_hashes or []
        self.stats.queries += 1
        self.stats.query_tokens += seq.num_prompt_tokens
        blocks, holder = self._match_blocks(hashes)
        if holder is None:
            return None
        n = min(blocks * self.block_size, seq.num_prompt_tokens - 1)
        if n <= 0 or self._holder_tokens(holder)[:n] != seq.prompt_token_ids[:n]:
            return None
        if isinstance(holder, RetainedRow):
            self._lru.move_to_end(holder.slot)
        self.stats.hits += 1
        self.stats.hit_tokens += n
        return PrefixMatch(src_slot=holder.slot, num_tokens=n)

    def pending_overlap(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Whether a sequence still prefilling will soon hold more of `seq`'s prefix than the cache holds now.

        Admitting `seq` later then saves recomputing that prefix (requests sharing an instruction prefix that
        arrive together would otherwise all compute it in the same step).
        """
        hashes = seq.block_hashes or []
        if not hashes:
            return False
        have, _ = self._match_blocks(hashes)
        for other in prefilling:
            theirs = other.block_hashes or []
            if len(theirs) > have and len(hashes) > have and theirs[have] == hashes[have]:
                return True
        return False

    # ------------------------------------------------------------------ registration

    def register(self, seq: Sequence) -> None:
        """Index the prompt blocks of `seq` whose K/V is computed by now."""
        hashes = seq.block_hashes or []
        done = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        start = self._registered.get(id(seq), 0)
        for h in hashes[start:done]:
            self._index[h] = seq
        self._registered[id(seq)] = max(start, done)

    def release(self, seq: Sequence, retain: bool) -> int | None:
        """`seq` leaves its slot. With `retain`, returns a spare row to copy its K/V into before the slot is reused."""
        blocks = self._registered.pop(id(seq), 0)
        hashes = seq.block_hashes or []
        target: int | None = None
        row: RetainedRow | None = None
        if retain and self.num_spare_slots and seq.num_computed_tokens >= self.block_size:
            target = self._take_spare()
            tokens = (seq.prompt_token_ids + seq.output_token_ids)[: seq.num_computed_tokens]
            row = RetainedRow(slot=target, token_ids=tokens)
            hashes = block_hashes(tokens, self.block_size)
            blocks = len(hashes)
            self._lru[target] = row
            self.stats.retained += 1
        for h in hashes[:blocks]:
            holder = self._index.get(h)
            if row is not None and (holder is None or holder is seq or isinstance(holder, RetainedRow)):
                self._index[h] = row
            elif holder is seq:
                del self._index[h]
        return target

    def _take_spare(self) -> int:
        if self._free:
            return self._free.pop()
        slot, old = self._lru.popitem(last=False)
        for h in block_hashes(old.token_ids, self.block_size):
            if self._index.get(h) is old:
                del self._index[h]
        self.stats.evicted += 1
        return slot
