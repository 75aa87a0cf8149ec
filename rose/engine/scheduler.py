"""Continuous batching over a paged KV store: which tokens run in the next forward, and who holds which blocks.

Every step, each running sequence that is decoding gets one token, which may need one more block; the rest of the
per-step token budget goes to prompt chunks (chunked prefill), first of sequences already admitted, then of waiting
requests admitted while the pool has the blocks for their whole prefill (minus what the prefix cache already holds)
above a small watermark, up to `max_num_seqs` running. Admission never preempts (as in vLLM V1): a waiting request
of a better priority than running ones waits for blocks to come back. Waiting requests are served by priority, then
FIFO: a lower `priority` value is served earlier (as in vLLM); a request that does not fit holds back those behind
it.

With a sliding window (or chunked attention) in every layer, the leading blocks of a sequence that no layer's query
will read again are given back as it advances (vLLM's sliding-window manager does the same): a sequence then holds
about a window's worth of blocks however long it grows. Its block table keeps their places (PASSED_BLOCK), so
position p still lives in entry p // block_size.

When a decoding sequence needs a block and none is free, the least important running sequence (highest priority
value, latest arrival) is preempted by recompute, as in vLLM V1: its blocks go back to the pool and it waits again,
ahead of later arrivals of its priority, with its generated tokens as part of what it prefills when readmitted. Its
sampling state is untouched (nothing is sampled for the step it lost), so its stream and its seeded draws continue
as if it had never been preempted.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from rose.engine.block_pool import BlockPool
from rose.engine.sequence import PASSED_BLOCK, Sequence, SequenceStatus


@dataclass(slots=True)
class PrefillChunk:
    seq: Sequence
    start: int
    length: int

    @property
    def completes_prefill(self) -> bool:
        """The chunk reaches the end of what the sequence prefills: its last logits give the next token."""
        return self.start + self.length == self.seq.num_prefill_tokens


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # most important first
    prefill: list[PrefillChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting while scheduling this step

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


# a prefix hit: (blocks the cache holds for the sequence's prefix, looked up but not taken) and taking them
Lookup = Callable[[Sequence], list[int]]
Take = Callable[[Sequence, list[int]], None]


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pool: BlockPool,
        watermark_blocks: int = 0,
        first_needed: Callable[[int], int] | None = None,
    ) -> None:
        """`first_needed(p)`: the first position a query at p or later reads (rose.engine.layer_spec.first_needed);
        None where some layer reads the whole context."""
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so that every running sequence can decode each step"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = pool
        self.watermark_blocks = watermark_blocks
        self.first_needed = first_needed
        self.running: list[Sequence] = []  # in admission order
        self._prefilling: list[Sequence] = []  # admitted, prefill not done, in admission order
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._num_waiting = 0
        self._counter = itertools.count()
        self.num_preemptions = 0
        self._num_added = 0  # requests added and their prompt tokens: num_admittable's default request size
        self._prompt_tokens_added = 0
        # prefix caching: may hold a request back for a step; finds and takes its cached prefix blocks
        self.should_defer: Callable[[Sequence, list[Sequence]], bool] | None = None
        self.lookup_prefix: Lookup | None = None
        self.take_prefix: Take | None = None
        # structured outputs: a request whose grammar is still compiling waits, without holding up those behind it
        self.is_ready: Callable[[Sequence], bool] | None = None

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, seq: Sequence) -> None:
        seq.queue_order = next(self._counter)
        self._num_added += 1
        self._prompt_tokens_added += seq.num_prompt_tokens
        self._push(seq)

    def num_admittable(self, tokens_per_request: int | None = None) -> int:
        """How many more requests can start now: the batch cap left (`max_num_seqs` minus running and waiting
        requests) and the free blocks (less the waiting requests' prompts and the admission watermark) divided by
        the blocks of one request of `tokens_per_request` tokens (default: the mean prompt length of the requests
        added so far; one block before any). When idle it always takes one: any request that fits
        `max_model_len` fits the pool."""
        room = self.max_num_seqs - self.num_running - self._num_waiting
        if room <= 0:
            return 0
        if tokens_per_request is None:
            tokens_per_request = self._prompt_tokens_added // self._num_added if self._num_added else 1
        per_request = self.pool.blocks_for(max(1, tokens_per_request))
        if not self.has_unfinished():
            return max(1, min(room, self.pool.num_free // per_request))
        free = self.pool.num_free - self.watermark_blocks - self.waiting_blocks()
        per_request = min(per_request, max(1, self.pool.num_blocks - self.watermark_blocks))
        return max(0, min(room, free // per_request))

    def _push(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.priority, seq.queue_order, seq))
        self._num_waiting += 1

    @staticmethod
    def _importance(seq: Sequence) -> tuple[int, int]:
        """Sort key, most important first: the order waiting requests are served in."""
        return seq.priority, seq.queue_order

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in sorted((s for s in self.running if not s.is_prefilling), key=self._importance):
            if seq.status is not SequenceStatus.RUNNING:  # preempted for a more important one just now
                continue
            if self._grow(seq, seq.num_computed_tokens + 1, batch):
                batch.decode.append(seq)
                budget -= 1
        for seq in self._prefilling:
            if budget <= 0:
                break
            budget -= self._chunk(batch, seq, budget)
        not_ready: list[tuple[int, int, Sequence]] = []  # pushed back with their keys: they keep their place
        try:
            while budget > 0 and len(self.running) < self.max_num_seqs and self._num_waiting:
                entry = self._pop_waiting()
                if entry is None:
                    break
                seq = entry[2]
                if self.is_ready is not None:
                    not_ready.append(entry)  # until the check has passed: an exception must not lose it
                    if not self.is_ready(seq):
                        continue
                    not_ready.pop()
                deferred = self.should_defer is not None and self.should_defer(seq, self._prefilling)
                if deferred or not self._admit(seq):  # no room: it waits for blocks to come back
                    heapq.heappush(self._waiting, entry)  # same place in line; nothing behind it jumps ahead
                    self._num_waiting += 1
                    break
                budget -= self._chunk(batch, seq, budget)
        finally:
            for entry in not_ready:
                heapq.heappush(self._waiting, entry)
            self._num_waiting += len(not_ready)
        return batch

    def _admit(self, seq: Sequence) -> bool:
        """Give `seq` the blocks of its whole prefill (its cached prefix shared) if the pool has them above the
        watermark (an idle engine admits without it: nothing else will free blocks)."""
        pool = self.pool
        hits = self.lookup_prefix(seq) if self.lookup_prefix is not None else []
        new = pool.blocks_for(seq.num_prefill_tokens) - len(hits)
        available = pool.num_free - sum(1 for b in hits if pool.refs(b) == 0)  # free cached blocks taken back
        if new > available - (self.watermark_blocks if self.running else 0):
            return False
        if self.take_prefix is not None:
            self.take_prefix(seq, hits)
        seq.block_ids = hits + pool.allocate(new)
        seq.num_computed_tokens = len(hits) * pool.block_size
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._prefilling.append(seq)
        return True

    def _grow(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Make `seq` hold blocks for `num_tokens` positions, preempting less important sequences while the pool
        is short. False when `seq` is itself the least important: then it is preempted."""
        need = self.pool.blocks_for(num_tokens) - len(seq.block_ids)
        while need > self.pool.num_free:
            victim = max(self.running, key=self._importance)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    def drop_passed_blocks(self, seqs: list[Sequence]) -> None:
        """Give back the leading blocks that no query from each sequence's next position on will read (called once
        a step has advanced them, so that the free blocks count them at once); a no-op unless every layer is
        windowed or chunked."""
        if self.first_needed is None:
            return
        for seq in seqs:
            passed = self.first_needed(seq.num_computed_tokens) // self.pool.block_size
            if passed <= seq.num_dropped_blocks:
                continue
            dropped = seq.block_ids[seq.num_dropped_blocks : passed]
            seq.block_ids[seq.num_dropped_blocks : passed] = [PASSED_BLOCK] * len(dropped)
            seq.num_dropped_blocks = passed
            self.pool.free(dropped)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free `seq`'s blocks and queue it again, to recompute its prompt and generated tokens when readmitted."""
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_prefill_tokens = seq.num_tokens
        seq.metrics.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        batch.preempted.append(seq)
        self._push(seq)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        self.pool.free(seq.block_ids[seq.num_dropped_blocks :])
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.num_dropped_blocks = 0

    def waiting_seqs(self) -> list[Sequence]:
        """The requests still waiting to be admitted (in no particular order)."""
        return [e[2] for e in self._waiting if e[2].status is SequenceStatus.WAITING]

    def waiting_blocks(self) -> int:
        """Blocks the waiting requests' prefills will take (before any prefix hit)."""
        return sum(self.pool.blocks_for(s.num_prefill_tokens) for s in self.waiting_seqs())

    def _chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        length = min(seq.num_prefill_tokens - seq.num_computed_tokens, budget)
        batch.prefill.append(PrefillChunk(seq, seq.num_computed_tokens, length))
        return length

    def _pop_waiting(self) -> tuple[int, int, Sequence] | None:
        while self._waiting:
            entry = heapq.heappop(self._waiting)
            if entry[2].status is SequenceStatus.WAITING:  # aborted ones stay in the heap until popped
                self._num_waiting -= 1
                return entry
        return None

    def prefill_done(self, seq: Sequence) -> None:
        self._prefilling.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (finished or aborted), its blocks back to the pool."""
        if seq.status is SequenceStatus.WAITING:
            seq.status = SequenceStatus.FINISHED
            self._num_waiting -= 1
            return
        if seq.status is not SequenceStatus.RUNNING:
            return
        seq.status = SequenceStatus.FINISHED
        self._release(seq)
