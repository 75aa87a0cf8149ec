"""Turns a scheduled batch into one forward of the model over the flattened step tokens."""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from rose.engine.kv_cache import AttentionMetadata, KVCache, PrefillSegment
from rose.engine.model_binding import ForwardContext, attach
from rose.engine.model_probe import AttentionLayers
from rose.engine.scheduler import ScheduledBatch
from rose.engine.slot_order import decode_groups


def model_context(config) -> int:
    """The context length a transformers config declares (2048 when it declares none). Everything else about the
    model's attention is read off the model itself (rose.engine.model_probe)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 2048


class ModelRunner:
    def __init__(self, model: PreTrainedModel, layers: AttentionLayers, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.k[0].device
        self.context = ForwardContext()
        attach(model, layers, cache, self.context)
        # models without it compute every token's logits; the sampled rows are picked out after the forward
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _plan_sdpa_decode(self, meta: AttentionMetadata, num_slots: int) -> None:
        """SDPA attends over whole store rows [0, span): one per decoding token, in slot order; rows mid-prefill
        among them get a dummy length of 1. Row ranges are planned over those lengths (rose.engine.slot_order)."""
        lengths = meta.decode_row_lengths
        meta.decode_span = meta.num_decode
        if meta.num_decode != num_slots:
            meta.decode_span = num_slots
            full = [1] * num_slots
            for row, length in zip(meta.decode_rows, lengths, strict=True):
                full[row] = length
            lengths = full
            meta.decode_slots = self._tensor(meta.decode_rows)
        meta.decode_lengths = self._tensor(lengths)
        meta.decode_groups = decode_groups(lengths)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, num_slots: int) -> torch.Tensor:
        """Run the step's forward; returns logits [num_sampled, vocab] for decode rows, then completed prefills."""
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        sample_index: list[int] = []
        for seq in batch.decode:
            sample_index.append(len(ids))
            ids.append(seq.last_token_id)
            slots.append(seq.slot)
            positions.append(seq.num_computed_tokens)
        segments = []
        for chunk in batch.prefill:
            seq = chunk.seq
            offset = len(ids)
            ids.extend(seq.prompt_token_ids[chunk.start : chunk.start + chunk.length])
            slots.extend([seq.slot] * chunk.length)
            positions.extend(range(chunk.start, chunk.start + chunk.length))
            segments.append(PrefillSegment(seq.slot, chunk.start, chunk.length, offset))
            if chunk.completes_prompt:
                sample_index.append(len(ids) - 1)

        num_decode = len(batch.decode)
        meta = AttentionMetadata(
            write_slots=self._tensor(slots),
            write_positions=self._tensor(positions),
            num_decode=num_decode,
            decode_rows=slots[:num_decode],
            decode_row_lengths=[p + 1 for p in positions[:num_decode]],
            prefills=segments,
        )
        if num_decode and not self.cache.use_cpu_kernels:  # the CPU kernels read exact spans: nothing to plan
            self._plan_sdpa_decode(meta, num_slots)
        keep = self._tensor(sample_index)
        self.context.begin(meta)
        try:
            out = self.model(
                input_ids=self._tensor(ids)[None],
                position_ids=self._tensor(positions)[None],
                use_cache=False,
                **({"logits_to_keep": keep} if self.keeps_logits else {}),
            )
        finally:
            self.context.end()
        return out.logits[0] if self.keeps_logits else out.logits[0, keep]
