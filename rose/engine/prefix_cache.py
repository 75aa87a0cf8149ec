"""Prefix caching over the block pool: a request starts with the cached full blocks of its prefix, shared, not copied.

A sequence's tokens (prompt, then generated ones) are cut into blocks of the pool's size; each full block gets a
chained hash (it covers every token before it). Once a block's K/V is computed, `register` indexes it in the pool
(rose.engine.block_pool); a new request looks its block hashes up at admission and takes the blocks found into its
block table (a reference each), then prefills from there. Cached blocks outlive their sequences in the pool's free
queue until they are evicted, so a prefix is also found after the request that computed it has finished, and a
follow-up turn finds the previous turn's generated tokens too.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from dataclasses import asdict, dataclass, field

from rose.engine.block_pool import BlockPool
from rose.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def block_hashes(
    token_ids: list[int], block_size: int, prev: list[int] | None = None, salt: int = 0
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`; with `prev` (the hashes of its first blocks, already
    computed) only the blocks after those are hashed. 128-bit BLAKE2b over the previous hash and the block's tokens:
    a block's hash stands for its whole prefix, and a hit compares only the block's own tokens, so the hash must not
    collide, even for inputs crafted to (Python's `hash` of a tuple is 64 bits and not collision-resistant)."""
    hashes = list(prev or [])
    last = hashes[-1] if hashes else salt  # `salt`: what else the K/V depends on (a LoRA adapter's id)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        digest = hashlib.blake2b(last.to_bytes(16, "little") + block, digest_size=16).digest()
        last = int.from_bytes(digest, "little")
        hashes.append(last)
    return hashes


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # requests looked up
    hits: int = 0  # requests that reused a prefix
    query_tokens: int = 0
    hit_tokens: int = 0  # tokens not recomputed


@dataclass
class PrefixCache:
    """`stats` counts requests admitted for the first time; `preempted_stats` their readmissions after a
    preemption (which find their own blocks again while those are not evicted), kept apart as vLLM does so that the
    hit rate describes the workload, not memory pressure."""

    pool: BlockPool
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    preempted_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def _hashes(self, seq: Sequence) -> list[int]:
        """The chained hashes of `seq`'s full blocks (prompt and generated tokens), extended as it grows."""
        tokens = seq.all_token_ids
        if seq.block_hashes is None or len(seq.block_hashes) < len(tokens) // self.block_size:
            # keyed by adapter: the same tokens under another LoRA adapter have other K/V
            salt = seq.lora_request.lora_int_id if seq.lora_request is not None else 0
            seq.block_hashes = block_hashes(tokens, self.block_size, seq.block_hashes, salt)
        return seq.block_hashes

    def _token_blocks(self, seq: Sequence, n: int) -> list[tuple[int, ...]]:
        tokens, size = seq.all_token_ids, self.block_size
        return [tuple(tokens[i * size : (i + 1) * size]) for i in range(n)]

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks of `seq`'s longest held prefix (none taken yet). At most num_prefill_tokens - 1
        tokens: the last one must run to give the next token's logits."""
        hashes = self._hashes(seq)
        usable = min(len(hashes), (seq.num_prefill_tokens - 1) // self.block_size)
        return self.pool.lookup(hashes[:usable], self._token_blocks(seq, usable))

    def take(self, seq: Sequence, blocks: list[int]) -> None:
        """`seq` is admitted with `blocks` (from `lookup`) as the start of its block table: one more reference
        each, nothing copied (called at every admission: the stats count queries too)."""
        stats = self.preempted_stats if seq.num_preemptions else self.stats
        stats.queries += 1
        stats.query_tokens += seq.num_prefill_tokens
        if blocks:
            self.pool.share(blocks)
            stats.hits += 1
            stats.hit_tokens += len(blocks) * self.block_size

    def get_stats(self) -> dict[str, int]:
        """`prefix_cache_queries` / `_hits` / `_query_tokens` / `_hit_tokens` (requests admitted the first time),
        the same as `prefix_cache_preempted_*` (readmissions), and the pool's cached and evicted blocks."""
        return {
            **{f"prefix_cache_{name}": value for name, value in asdict(self.stats).items()},
            **{
                f"prefix_cache_preempted_{name}": value
                for name, value in asdict(self.preempted_stats).items()
            },
            "prefix_cache_blocks": self.pool.num_cached(),
            "prefix_cache_evicted_blocks": self.pool.num_evicted,
        }

    def pending_overlap(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Whether a sequence still prefilling will soon hold more of `seq`'s prefix than the cache holds now.

        Admitting `seq` later then saves recomputing that prefix (requests sharing an instruction prefix that
        arrive together would otherwise all compute it in the same step).
        """
        hashes = self._hashes(seq)
        if not hashes:
            return False
        usable = min(len(hashes), (seq.num_prefill_tokens - 1) // self.block_size)
        have = len(self.lookup(seq))
        if have >= usable:
            return False
        for other in prefilling:
            theirs = self._hashes(other)
            if len(theirs) > have and theirs[have] == hashes[have]:
                return True
        return False

    def register(self, seq: Sequence) -> None:
        """Index `seq`'s full blocks whose K/V is computed by now."""
        done = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if done <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq)
        tokens, size = seq.all_token_ids, self.block_size
        for i in range(max(seq.num_registered_blocks, seq.num_dropped_blocks), done):
            self.pool.cache(seq.block_ids[i], hashes[i], tuple(tokens[i * size : (i + 1) * size]))
        seq.num_registered_blocks = done
