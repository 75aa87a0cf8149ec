"""Continuous batching over a paged KV store: which tokens run in the next forward, and the state of every request.

Every step, each running sequence that is decoding gets one token, which may need one more block; the rest of the
per-step token budget goes to prompt chunks (chunked prefill), first of sequences already admitted, then of waiting
requests admitted while the pool has the blocks for their whole prefill (minus what the prefix cache already holds)
above a small watermark, up to `max_num_seqs` running. Admission never preempts (as in vLLM V1): a waiting request
of a better priority than running ones waits for blocks to come back. Waiting requests are served by priority, then
earliest deadline (requests without one after those with one), then FIFO: a lower `priority` value is served
earlier (as in vLLM); a request that does not fit holds back those behind it. A LoRA request whose adapter has no
free slot (rose.engine.lora) waits without holding back the base-model requests behind it; the LoRA requests behind
it wait with it, so that a slot frees up.

With a sliding window (or chunked attention) in every layer, the leading blocks of a sequence that no layer's query
will read again are given back as it advances (vLLM's sliding-window manager does the same): a sequence then holds
about a window's worth of blocks however long it grows. Its block table keeps their places (PASSED_BLOCK), so
position p still lives in entry p // block_size.

When a decoding sequence needs a block and none is free, the least important running sequence (highest priority
value, then no deadline or the latest, then latest arrival) is preempted by recompute, as in vLLM V1: its blocks go
back to the pool and it waits again in its place (ahead of later arrivals of its priority and deadline), with its
generated tokens as part of what it prefills when readmitted. Its
sampling state is untouched (nothing is sampled for the step it lost), so its stream and its seeded draws continue
as if it had never been preempted.

The scheduler owns the requests and their state: it holds them by id, moves each through its status (a request whose
grammar is still compiling waits as WAITING_FOR_GRAMMAR, without holding up those behind it), and after each forward
`update_from_output` advances what the step computed and appends what it sampled (nano-vllm's `postprocess`, vLLM's
`update_from_output`). Blocks are the KV-cache manager's (rose.engine.kv_cache_manager): the scheduler asks it for
them and gives them back.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rose.engine.kv_cache_manager import KVCacheManager
from rose.engine.outputs import FinishReason, StepOutput, TokenLogprob
from rose.engine.sequence import Sequence, SequenceStatus
from rose.engine.stopping import append_token

if TYPE_CHECKING:
    from rose.engine.lora import LoRAManager
    from rose.engine.sampler import SamplerOutput

_WAITING = (SequenceStatus.WAITING, SequenceStatus.WAITING_FOR_GRAMMAR)


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

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token from this step, in the order of the forward's logits rows: the decoding
        ones, then those whose prefill this step completes."""
        return self.decode + [c.seq for c in self.prefill if c.completes_prefill]

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv: KVCacheManager,
        *,
        eos_token_ids: set[int],
        max_model_len: int,
        lora: LoRAManager | None = None,
    ) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs}) "
                "so that every running sequence can decode each step"
            )
        self.max_num_seqs = max_num_seqs
        self.lora = lora  # a sequence runs only with its adapter resident (rose.engine.lora)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, Sequence] = {}  # every unfinished request, by id
        self.running: list[Sequence] = []  # in admission order
        self._prefilling: list[Sequence] = []  # admitted, prefill not done, in admission order
        self._waiting: list[tuple[int, float, int, Sequence]] = []
        self._num_waiting = 0
        self._counter = itertools.count()
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt (and recomputed) positions computed, over the engine's life
        self.num_constrained = 0  # requests with a grammar: the engine skips the grammar machinery while 0
        self._num_added = 0  # requests added and their prompt tokens: num_admittable's default request size
        self._prompt_tokens_added = 0

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        self.requests[seq.request_id] = seq
        seq.queue_order = next(self._counter)
        compiling = seq.structured is not None and not seq.structured.is_ready
        seq.status = SequenceStatus.WAITING_FOR_GRAMMAR if compiling else SequenceStatus.WAITING
        self.num_constrained += seq.structured is not None
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
        kv = self.kv
        per_request = kv.blocks_for(max(1, tokens_per_request))
        if not self.has_unfinished():
            return max(1, min(room, kv.num_free // per_request))
        free = kv.num_free - kv.watermark_blocks - self.waiting_blocks()
        per_request = min(per_request, max(1, kv.num_blocks - kv.watermark_blocks))
        return max(0, min(room, free // per_request))

    def _push(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (*self._importance(seq), seq))
        self._num_waiting += 1

    @staticmethod
    def _importance(seq: Sequence) -> tuple[int, float, int]:
        """Sort key, most important first: the order waiting requests are served in (priority, then the earliest
        deadline, one without last, then arrival)."""
        return seq.priority, math.inf if seq.deadline is None else seq.deadline, seq.queue_order

    # ----------------------------------------------------------------- scheduling

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
        # popped but not admitted: pushed back with their keys, so they keep their place (an exception included)
        held: list[tuple[int, int, Sequence]] = []
        slot_blocked = (
            False  # a LoRA request found no adapter slot: no LoRA request behind it starts this step
        )
        try:
            while budget > 0 and len(self.running) < self.max_num_seqs and self._num_waiting:
                entry = self._pop_waiting()
                if entry is None:
                    break
                held.append(entry)
                seq = entry[-1]
                if seq.status is SequenceStatus.WAITING_FOR_GRAMMAR:
                    if not seq.structured.is_ready:
                        continue
                    seq.status = SequenceStatus.WAITING
                if seq.lora_request is not None and (
                    slot_blocked or not self.lora.can_acquire(seq.lora_request.lora_name)
                ):
                    # every adapter slot is in use: it waits and base-model requests behind it may go; LoRA ones
                    # may not, or a resident adapter's stream of requests would keep its slot from it forever
                    slot_blocked = True
                    continue
                if self.kv.should_defer(seq, self._prefilling) or not self._admit(seq):
                    break  # no room: it keeps its place in line, and nothing behind it jumps ahead
                held.pop()
                budget -= self._chunk(batch, seq, budget)
        finally:
            for entry in held:
                heapq.heappush(self._waiting, entry)
            self._num_waiting += len(held)
        if not batch and not self.running and self.kv.release_held(self.waiting_seqs()):
            return self.schedule()  # idle, and only the prompts held for n > 1 choices kept the next one out
        return batch

    def _admit(self, seq: Sequence) -> bool:
        """Admit `seq` if the KV-cache manager has the blocks of its whole prefill (above the watermark unless the
        engine is idle: nothing else will free blocks); a LoRA request's adapter takes its slot."""
        adapter = seq.lora_request.lora_name if seq.lora_request is not None else None
        if adapter is not None:  # first: a load that raises leaves no blocks taken
            self.lora.acquire(adapter)
        cached = self.kv.allocate_prefill(seq, watermark=bool(self.running))
        if cached is None:
            if adapter is not None:
                self.lora.release(adapter)  # it stays resident, idle
            return False
        seq.num_computed_tokens = cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._prefilling.append(seq)
        return True

    def _grow(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Make `seq` hold blocks for `num_tokens` positions, preempting less important sequences while the pool
        is short. False when `seq` is itself the least important: then it is preempted."""
        while not self.kv.allocate_slots(seq, num_tokens):
            victim = max(self.running, key=self._importance)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

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
        if seq.lora_request is not None:
            self.lora.release(seq.lora_request.lora_name)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        self.kv.free(seq)

    def _chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        length = min(seq.num_prefill_tokens - seq.num_computed_tokens, budget)
        batch.prefill.append(PrefillChunk(seq, seq.num_computed_tokens, length))
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.time()
        return length

    def _pop_waiting(self) -> tuple[int, float, int, Sequence] | None:
        while self._waiting:
            entry = heapq.heappop(self._waiting)
            if entry[-1].status in _WAITING:  # finished ones stay in the heap until popped
                self._num_waiting -= 1
                return entry
        return None

    def waiting_seqs(self) -> list[Sequence]:
        """The requests still waiting to be admitted (in no particular order)."""
        return [e[-1] for e in self._waiting if e[-1].status in _WAITING]

    def waiting_for_grammar(self) -> list[Sequence]:
        """The waiting requests whose grammar has not compiled (yet, or ever)."""
        return [e[-1] for e in self._waiting if e[-1].status is SequenceStatus.WAITING_FOR_GRAMMAR]

    def waiting_blocks(self) -> int:
        """Blocks the waiting requests' prefills will take (before any prefix hit)."""
        return sum(self.kv.blocks_for(s.num_prefill_tokens) for s in self.waiting_seqs())

    # ----------------------------------------------------------------- after the forward

    def update_from_output(
        self,
        batch: ScheduledBatch,
        sampled: SamplerOutput | None,
        prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]] = (),
    ) -> list[StepOutput]:
        """The step ran `batch` and drew `sampled` for `batch.sampled`: advance what it computed, append the tokens
        (rose.engine.stopping) and the prompt logprobs it took (each sequence's next entries), and retire the
        requests they finished. Returns each sampled request's output."""
        for seq, entries in prompt_logprobs:
            seq.prompt_logprobs.extend(entries)
        for seq in batch.decode:
            seq.num_computed_tokens += 1
        for chunk in batch.prefill:
            self.num_prefill_tokens += chunk.length
            chunk.seq.num_computed_tokens += chunk.length
            if chunk.completes_prefill:
                self._prefilling.remove(chunk.seq)
        sharing = [
            c.seq for c in batch.prefill if c.seq.prompt_share is not None
        ]  # n > 1: the prompt is held
        if self.kv.caches_blocks or sharing:
            for seq in (
                [*batch.decode, *(chunk.seq for chunk in batch.prefill)] if self.kv.caches_blocks else sharing
            ):
                self.kv.cache_blocks(seq)
        if sampled is None:
            return []
        now = time.time()
        outputs = [
            append_token(seq, token, logprob, now, self.eos_token_ids, self.max_model_len)
            for seq, token, logprob in zip(batch.sampled, sampled.token_ids, sampled.logprobs, strict=True)
        ]
        for out in outputs:
            if out.finished:
                self._remove(self.requests[out.request_id])
        return outputs

    def finish_request(self, request_id: str, reason: FinishReason) -> Sequence | None:
        """End a request now (aborted, or its grammar failed), its blocks back to the pool; None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self._remove(seq)
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()
        if seq.detokenizer is not None:
            seq.text = seq.detokenizer.emitted_text
        return seq

    def _remove(self, seq: Sequence) -> None:
        """Take `seq` out (finished or aborted): its blocks back to the pool, its grammar state freed."""
        del self.requests[seq.request_id]
        self.kv.leave(seq)
        if seq.structured is not None:
            seq.structured = None  # frees the matcher
            self.num_constrained -= 1
        if seq.status in _WAITING:
            self._num_waiting -= 1
        elif seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        seq.status = SequenceStatus.FINISHED
