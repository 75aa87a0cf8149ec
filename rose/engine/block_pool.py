"""The KV store's blocks: which are free, who holds each one, and which full blocks are cached for reuse.

The store (rose.engine.kv_cache) is a pool of `num_blocks` blocks of `block_size` positions each. A sequence holds
a list of block ids, its block table: position p of the sequence lives at offset p % block_size of block
table[p // block_size]. Blocks are allocated as a sequence grows and given back when it ends or is preempted.

With prefix caching, a full block whose K/V is computed is indexed by its chained hash (the hash covers every token
before it too) with its tokens, so another sequence with the same prefix takes the block itself: its reference count
goes up and nothing is copied. A block nobody holds any more keeps its contents and its index entry in the free
queue, least recently freed first, until the pool hands it out for something else (an eviction). Uncached free
blocks are handed out before cached ones.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedBlock:
    """What a cached block holds: its chained hash and its tokens (compared on a hit: a hash collision never reuses
    other tokens' K/V)."""

    block_hash: int
    token_ids: tuple[int, ...]


class BlockPool:
    """Reference-counted blocks, a free queue in eviction order, and the hash index of cached full blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._cached: list[CachedBlock | None] = [None] * num_blocks
        self._index: dict[int, int] = {}  # block hash -> block id
        # free blocks, the next one to hand out first: uncached ones at the front, cached ones in LRU order
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evicted = 0  # cached blocks handed out for other contents

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached ones nobody holds included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that `num_tokens` positions take."""
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, each held once; None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            cached = self._cached[block]
            if cached is not None:  # evicted: its contents are about to be overwritten
                self._cached[block] = None
                if self._index.get(cached.block_hash) == block:
                    del self._index[cached.block_hash]
                self.num_evicted += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`. Blocks nobody holds go to the free queue, the sequence's last
        blocks first (they are the least likely to be shared, so they are evicted first)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"block {block} freed more often than it was held")
            if self._refs[block] == 0:
                self._free[block] = None
                if self._cached[block] is None:
                    self._free.move_to_end(block, last=False)

    def lookup(self, hashes: list[int], token_blocks: list[tuple[int, ...]]) -> list[int]:
        """The cached blocks holding the longest prefix of these chained hashes and tokens (no reference taken)."""
        found = []
        for block_hash, tokens in zip(hashes, token_blocks, strict=False):
            block = self._index.get(block_hash)
            if block is None or self._cached[block].token_ids != tokens:
                break
            found.append(block)
        return found

    def share(self, blocks: list[int]) -> None:
        """Take one more reference to each cached block of `blocks` (a prefix hit: no copy)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def cache(self, block: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Index a held, full, computed block. A hash already indexed keeps its block (two sequences computed
        the same block at once; the second copy is simply not cached)."""
        if self._cached[block] is not None or block_hash in self._index:
            return
        self._cached[block] = CachedBlock(block_hash, token_ids)
        self._index[block_hash] = block

    def refs(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return self._cached[block] is not None

    def num_cached(self) -> int:
        return len(self._index)
