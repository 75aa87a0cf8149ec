"""Who holds which KV blocks: the one owner of the block pool, the prefix cache and every sequence's block table.

The scheduler decides which sequences run; this manager decides whether their blocks fit and hands them out
(vLLM V1's KVCacheManager does the same). A sequence's block fields (`block_ids`, `num_registered_blocks`,
`num_dropped_blocks`, `block_hashes`) are written by this manager and its prefix cache, nowhere else:

- `allocate_prefill` at admission: the cached blocks of the sequence's prefix (prefix caching: shared, a reference
  each, nothing copied; not for a request that wants its `prompt_logprobs`), or those of its prompt that another
  choice of its request computed (`prompt_share`: n > 1, with or without prefix caching), then new blocks for the
  rest of its prefill, if the pool has them above the watermark.
- `allocate_slots` as it decodes: blocks for its next positions, if free (else the scheduler preempts).
- `cache_blocks` once a step has computed its positions: full blocks indexed for prefix hits, a shared prompt's
  blocks held for the choices still to come, and the leading blocks that every layer's window has passed given
  back (only where every layer is windowed or chunked).
- `leave` when a sequence leaves the engine: the choices of a shared prompt it was still owed stop waiting on it.
- `free` when it finishes or is preempted: its blocks back to the pool (cached ones stay findable until evicted).
"""

from __future__ import annotations

from collections.abc import Callable

from rose.engine.block_pool import BlockPool
from rose.engine.prefix_cache import PrefixCache
from rose.engine.sequence import PASSED_BLOCK, Sequence


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        *,
        enable_prefix_caching: bool = False,
        watermark_blocks: int = 0,
        first_needed: Callable[[int], int] | None = None,
    ) -> None:
        """`watermark_blocks`: blocks kept free when admitting beside running sequences (rose.engine.kv_budget).
        `first_needed(p)`: the first position a query at p or later reads (rose.engine.layer_spec.first_needed);
        None where some layer reads the whole context."""
        self.pool = pool
        self.prefix_cache = PrefixCache(pool) if enable_prefix_caching else None
        self.watermark_blocks = watermark_blocks
        self.first_needed = first_needed

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def drops_passed_blocks(self) -> bool:
        """Every layer is windowed or chunked: a sequence holds about a window's worth of blocks however long."""
        return self.first_needed is not None

    @property
    def caches_blocks(self) -> bool:
        """`cache_blocks` has work: prefix caching is on, or passed blocks are given back."""
        return self.prefix_cache is not None or self.first_needed is not None

    def blocks_for(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    def should_defer(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Hold `seq` back a step: a sequence still prefilling will soon hold more of its prefix than the cache does
        now (rose.engine.prefix_cache.PrefixCache.pending_overlap), or the choice whose prompt it shares is."""
        share = seq.prompt_share
        if share is not None and not share.blocks and any(s.prompt_share is share for s in prefilling):
            return True
        return self.reads_cache(seq) and self.prefix_cache.pending_overlap(seq, prefilling)

    def reads_cache(self, seq: Sequence) -> bool:
        """Whether `seq` may take its prefix from the cache: prefix caching is on and it does not want the prompt's
        logprobs (which need every prompt position computed: vLLM V1 skips the cache for them too)."""
        return self.prefix_cache is not None and seq.params.prompt_logprobs is None

    def _prompt_blocks(self, seq: Sequence) -> int:
        """Full blocks of `seq`'s prompt a choice may share: all but the prompt's last token, as a prefix hit."""
        return max(0, (len(seq.prompt_token_ids) - 1) // self.pool.block_size)

    def _hold_prompt(self, seq: Sequence) -> None:
        """`seq` has computed its prompt: hold its full blocks for the choices still to come."""
        share, usable = seq.prompt_share, self._prompt_blocks(seq)
        if share is None or share.blocks or not share.pending or not usable or seq.num_dropped_blocks:
            return
        if seq.num_computed_tokens >= usable * self.pool.block_size:
            share.blocks = seq.block_ids[:usable]
            self.pool.share(share.blocks)

    def _admitted_or_gone(self, seq: Sequence) -> None:
        """`seq` no longer waits for its shared prompt; the last one lets the held blocks go."""
        share = seq.prompt_share
        if share is None or seq.request_id not in share.pending:
            return
        share.pending.discard(seq.request_id)
        if not share.pending and share.blocks:
            self.pool.free(share.blocks)
            share.blocks = []

    def release_held(self, waiting: list[Sequence]) -> bool:
        """Let go of the prompt blocks held for `waiting` choices: an idle engine whose next request does not fit
        needs them more (the choices then compute their prompt themselves). Whether any block came back."""
        shares = {id(s.prompt_share): s.prompt_share for s in waiting if s.prompt_share is not None}
        held = [share for share in shares.values() if share.blocks]
        for share in held:
            self.pool.free(share.blocks)
            share.blocks = []
        return bool(held)

    def leave(self, seq: Sequence) -> None:
        """`seq` leaves the engine (finished or aborted; its blocks, if any, are freed separately)."""
        self._admitted_or_gone(seq)

    def allocate_prefill(self, seq: Sequence, *, watermark: bool) -> int | None:
        """Give `seq` the blocks of its whole prefill, its cached prefix shared, if the pool has them (above the
        watermark when `watermark`). Returns how many of its tokens the cache already holds, or None (nothing
        taken) when the blocks are short."""
        pool = self.pool
        hits = self.prefix_cache.lookup(seq) if self.reads_cache(seq) else []
        share = seq.prompt_share
        shared = share.blocks[: self._prompt_blocks(seq)] if share is not None else []
        if len(shared) <= len(hits):
            shared = []
        held = shared or hits
        new = pool.blocks_for(seq.num_prefill_tokens) - len(held)
        available = pool.num_free - sum(1 for b in held if pool.refs(b) == 0)  # free cached blocks taken back
        if new > available - (self.watermark_blocks if watermark else 0):
            return None
        if self.reads_cache(
            seq
        ):  # a request that skips the cache is no query (vLLM's stats leave it out too)
            self.prefix_cache.take(seq, [] if shared else hits)
        if shared:
            pool.share(shared)
        seq.block_ids = held + pool.allocate(new)
        self._admitted_or_gone(seq)
        return len(held) * pool.block_size

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq` hold blocks for `num_tokens` positions; False (nothing taken) when too few are free."""
        need = self.pool.blocks_for(num_tokens) - len(seq.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        seq.block_ids.extend(blocks)
        return True

    def cache_blocks(self, seq: Sequence) -> None:
        """A step computed more of `seq`: index its full blocks for prefix hits (before passed ones go back to the
        pool, so that they stay findable in its free queue), then give back the blocks no query will read again."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(seq)
        self._hold_prompt(seq)  # before a window's passed blocks go back
        if self.first_needed is None:
            return
        passed = self.first_needed(seq.num_computed_tokens) // self.pool.block_size
        if passed <= seq.num_dropped_blocks:
            return
        dropped = seq.block_ids[seq.num_dropped_blocks : passed]
        seq.block_ids[seq.num_dropped_blocks : passed] = [PASSED_BLOCK] * len(dropped)
        seq.num_dropped_blocks = passed
        self.pool.free(dropped)

    def free(self, seq: Sequence) -> None:
        """Give `seq`'s blocks back (its cached full blocks stay in the pool for prefix hits until evicted)."""
        self.pool.free(seq.block_ids[seq.num_dropped_blocks :])
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.num_dropped_blocks = 0

    def num_tokens_held(self, seq: Sequence) -> int:
        """Positions of `seq` whose K/V the store holds now (passed blocks not counted)."""
        return seq.num_computed_tokens - seq.num_dropped_blocks * self.pool.block_size

    def get_stats(self) -> dict[str, int]:
        """The pool's blocks (`kv_blocks_used` / `_free` / `_total`, `kv_block_size`) and, with prefix caching,
        its figures (rose.engine.prefix_cache.PrefixCache.get_stats)."""
        prefix = self.prefix_cache.get_stats() if self.prefix_cache is not None else {}
        return {
            **prefix,
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_free": self.pool.num_free,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_block_size": self.pool.block_size,
            "kv_tokens_total": self.pool.num_blocks * self.pool.block_size,
        }
