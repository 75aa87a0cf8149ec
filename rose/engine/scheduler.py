"""Continuous batching: which tokens run in the next forward.

Every step, each running sequence that is decoding gets one token; the rest of the per-step token budget goes to
prompt chunks (chunked prefill), first of sequences already admitted, then of waiting requests admitted into free
slots. Waiting requests are served by priority, then FIFO: a lower `priority` value is served earlier (as in vLLM).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from rose.engine.sequence import Sequence, SequenceStatus
from rose.engine.slot_order import plan_reorder


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.seq.num_prompt_tokens


@dataclass
class SlotMove:
    """Row `src` of the KV store must be copied to row `dst` (its first `length` positions)."""

    src: int
    dst: int
    length: int


@dataclass
class ScheduledBatch:
    decode: list[Sequence] = field(default_factory=list)  # in slot order
    prefill: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so that every running sequence can decode each step"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.running: list[Sequence] = []  # index == slot; occupied slots are always [0, len(running))
        self._prefilling: list[Sequence] = []  # admitted, prompt not done, in admission order
        self._waiting: list[tuple[int, int, Sequence]] = []
        self._num_waiting = 0
        self._counter = itertools.count()
        # prefix caching: may hold a request back for a step, and sets up its reused prefix once it has a slot
        self.should_defer: Callable[[Sequence, list[Sequence]], bool] | None = None
        self.on_admit: Callable[[Sequence], None] | None = None
        # structured outputs: a request whose grammar is still compiling waits, without holding up those behind it
        self.is_ready: Callable[[Sequence], bool] | None = None
        # rows joined decoding or left since the last look at their order (see rose.engine.slot_order)
        self._order_changed = False
        self.sort_rows = True  # off when decode attention reads exact lengths (no padding to save)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.priority, next(self._counter), seq))
        self._num_waiting += 1

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(decode=[s for s in self.running if not s.is_prefilling])
        budget = self.max_num_batched_tokens - len(batch.decode)
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
                if self.should_defer is not None and self.should_defer(seq, self._prefilling):
                    heapq.heappush(self._waiting, entry)  # same place in line; nothing behind it jumps ahead
                    self._num_waiting += 1
                    break
                seq.status = SequenceStatus.RUNNING
                seq.slot = len(self.running)
                self.running.append(seq)
                self._prefilling.append(seq)
                if self.on_admit is not None:
                    self.on_admit(seq)
                budget -= self._chunk(batch, seq, budget)
        finally:
            for entry in not_ready:
                heapq.heappush(self._waiting, entry)
            self._num_waiting += len(not_ready)
        return batch

    def waiting_seqs(self) -> list[Sequence]:
        """The requests still waiting for a slot (in no particular order)."""
        return [e[2] for e in self._waiting if e[2].status is SequenceStatus.WAITING]

    def _chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        length = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
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
        self._order_changed = True

    def reorder(self) -> list[SlotMove]:
        """Sort the running rows longest context first when that pays (see rose.engine.slot_order).

        Call before `schedule`. Returns the KV row moves to make, all at once (every source is read before any
        destination is written): the sequences already have their new slots.
        """
        if not self._order_changed or not self.sort_rows:
            return []
        self._order_changed = False
        running = self.running
        # context after this step's write; rows mid-prefill take part in decode attention as 1-position dummies
        lengths = [1 if s.is_prefilling else s.num_computed_tokens + 1 for s in running]
        order = plan_reorder(lengths, [s.num_computed_tokens for s in running])
        if order is None:
            return []
        moves = []
        self.running = [running[i] for i in order]
        for slot, seq in enumerate(self.running):
            if seq.slot != slot:
                moves.append(SlotMove(src=seq.slot, dst=slot, length=seq.num_computed_tokens))
                seq.slot = slot
        return moves

    def remove(self, seq: Sequence) -> SlotMove | None:
        """Take `seq` out (finished or aborted). Returns the KV row move that keeps slots contiguous, if any."""
        if seq.status is SequenceStatus.WAITING:
            seq.status = SequenceStatus.FINISHED
            self._num_waiting -= 1
            return None
        if seq.status is not SequenceStatus.RUNNING:
            return None
        seq.status = SequenceStatus.FINISHED
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        self._order_changed = True
        slot, last = seq.slot, self.running.pop()
        seq.slot = -1
        if last is seq:
            return None
        self.running[slot] = last
        move = SlotMove(src=last.slot, dst=slot, length=last.num_computed_tokens)
        last.slot = slot
        return move
