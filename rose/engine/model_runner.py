"""Turns a scheduled batch into one forward of the model over the flattened step tokens."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from rose.engine.attention import sdpa_backends
from rose.engine.kv_cache import AttentionMetadata, KVCache, PrefillSegment
from rose.engine.lora import LoRAManager
from rose.engine.model_binding import ForwardContext, attach
from rose.engine.model_probe import AttentionLayers
from rose.engine.scheduler import PrefillChunk, ScheduledBatch
from rose.engine.sequence import Sequence


def model_context(config) -> int:
    """The context length a transformers config declares (2048 when it declares none). Everything else about the
    model's attention is read off the model itself (rose.engine.model_probe)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 2048


@dataclass(slots=True)
class PromptLogits:
    """Logits of a prompt's positions for its `prompt_logprobs`: row j predicts prompt token `first + j`."""

    seq: Sequence
    first: int
    logits: torch.Tensor


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor  # [num_sampled, vocab]: the rows of ScheduledBatch.sampled, in its order
    prompt: list[PromptLogits] = field(default_factory=list)


def prompt_rows(seq: Sequence, start: int, end: int) -> tuple[int, int] | None:
    """The positions of [start, end) (a chunk of `seq`'s prefill) whose logits give prompt logprobs not yet taken,
    as (first, stop): position p predicts prompt token p + 1. None when there are none, or when the positions
    before them were not computed by `seq` (another choice's shared prompt): its entries come from that choice."""
    if seq.prompt_logprobs is None:
        return None
    first = len(seq.prompt_logprobs) - 1  # the entries so far cover tokens 0 .. first
    stop = min(end, seq.num_prompt_tokens - 1)
    return (first, stop) if start <= first < stop else None


class ModelRunner:
    def __init__(
        self, model: PreTrainedModel, layers: AttentionLayers, cache: KVCache, lora: LoRAManager | None = None
    ) -> None:
        self.model = model
        self.lora = lora
        self.cache = cache
        self.device = cache.k[0].device
        self.context = ForwardContext()
        attach(model, layers, cache, self.context)
        # models without it compute every token's logits; the sampled rows are picked out after the forward
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _decode_rows(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int]]:
        """The decode sequences in the forward's row order, and the row of each of `batch.decode`: with LoRA,
        sorted by adapter slot (each adapter's rows one run: rose.engine.lora), else the batch's order."""
        if self.lora is None:
            return batch.decode, list(range(len(batch.decode)))
        order = sorted(range(len(batch.decode)), key=lambda i: self._slot(batch.decode[i], -1))
        rows = [0] * len(order)
        for row, i in enumerate(order):
            rows[i] = row
        return [batch.decode[i] for i in order], rows

    def _prefill_order(self, batch: ScheduledBatch) -> list[int]:
        """The order of `batch.prefill`'s chunks in the forward: with LoRA, by adapter slot (a few long runs
        rather than one per prompt), else the batch's order."""
        order = list(range(len(batch.prefill)))
        if self.lora is not None:
            order.sort(key=lambda i: self._slot(batch.prefill[i].seq, -1))
        return order

    def _slot(self, seq: Sequence, base: int | None = None) -> int | None:
        """The sequence's adapter slot; `base` for the base model."""
        return base if seq.lora_request is None else self.lora.slot_of(seq.lora_request.lora_name)

    def _lora_step(self, decode: list[Sequence], prefill: list[PrefillChunk]) -> None:
        """Each token's adapter slot, in the forward's order: decode tokens, then prefill chunks."""
        seqs = [*decode, *(c.seq for c in prefill)]
        lengths = [1] * len(decode) + [c.length for c in prefill]
        self.lora.begin_step([self._slot(s) for s in seqs], lengths)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run the step's forward; returns logits [num_sampled, vocab] for decode rows, then completed prefills, and
        those of the prompt positions that requests with `prompt_logprobs` computed (`ModelOutput.prompt`).

        Every sequence in the batch already holds the blocks for the positions it computes (the scheduler saw
        to it)."""
        size = self.cache.block_size
        ids: list[int] = []
        slots: list[int] = []  # decode tokens' flat slots; prefill chunks' come as arrays in `chunk_slots`
        chunk_slots: list[np.ndarray] = []
        positions: list[int] = []
        sample_index: list[int] = []
        prompt_index: list[int] = []
        prompts: list[tuple[Sequence, int, int]] = []  # (seq, first prompt token predicted, rows)
        decode, sample_index = self._decode_rows(batch)  # logits come back in batch.decode's order
        for seq in decode:
            pos = seq.num_computed_tokens
            ids.append(seq.last_token_id)
            slots.append(seq.block_ids[pos // size] * size + pos % size)
            positions.append(pos)
        segments = []
        completed: dict[int, int] = {}  # a completing chunk's index in batch.prefill -> its last row
        order = self._prefill_order(batch)
        for i in order:
            chunk = batch.prefill[i]
            seq = chunk.seq
            offset = len(ids)
            end = chunk.start + chunk.length
            tokens = seq.prompt_token_ids if end <= seq.num_prompt_tokens else seq.all_token_ids
            ids.extend(tokens[chunk.start : end])
            blocks = seq.block_ids
            pos = np.arange(chunk.start, end)
            first, last = chunk.start // size, (end - 1) // size + 1  # the blocks this chunk writes
            table = np.asarray(blocks[first:last], dtype=np.int64)
            chunk_slots.append(table[pos // size - first] * size + pos % size)
            positions.extend(range(chunk.start, end))
            segments.append(PrefillSegment(blocks, chunk.start, chunk.length, offset))
            if chunk.completes_prefill:
                completed[i] = len(ids) - 1
            rows = prompt_rows(seq, chunk.start, end)
            if rows is not None:
                first, stop = rows
                prompt_index.extend(range(offset + first - chunk.start, offset + stop - chunk.start))
                prompts.append((seq, first + 1, stop - first))

        sample_index += [completed[i] for i in sorted(completed)]  # sampled in batch.prefill's order
        num_decode = len(decode)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(
                np.concatenate([np.asarray(slots, dtype=np.int64), *chunk_slots])
            ).to(self.device, non_blocking=True),
            num_decode=num_decode,
            block_size=size,
            decode_lengths=[p + 1 for p in positions[:num_decode]],
            prefills=segments,
        )
        if num_decode:
            width = max(len(seq.block_ids) for seq in decode)
            tables = np.zeros((num_decode, width), dtype=np.int64)  # padded with block 0: never read unmasked
            for i, seq in enumerate(decode):
                tables[i, : len(seq.block_ids)] = seq.block_ids
            meta.decode_tables = tables
        keep = self._tensor(sample_index + prompt_index)
        self.context.begin(meta)
        if self.lora is not None:
            self._lora_step(decode, [batch.prefill[i] for i in order])
        try:
            with sdpa_backends(self.device):
                out = self.model(
                    input_ids=self._tensor(ids)[None],
                    position_ids=self._tensor(positions)[None],
                    use_cache=False,
                    **({"logits_to_keep": keep} if self.keeps_logits else {}),
                )
        finally:
            self.context.end()
            if self.lora is not None:
                self.lora.end_step()
        logits = out.logits[0] if self.keeps_logits else out.logits[0, keep]
        num_sampled = len(sample_index)
        if not prompts:
            return ModelOutput(logits)
        parts, row = [], num_sampled
        for seq, first, n in prompts:
            parts.append(PromptLogits(seq, first, logits[row : row + n]))
            row += n
        return ModelOutput(logits[:num_sampled], parts)
