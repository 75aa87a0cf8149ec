"""Sizing the KV store: how many positions each slot gets, from the model's context and a memory budget."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_MIN_MODEL_LEN = 128


def resolve_max_model_len(requested: int | None, context: int, bytes_per_position: int, budget: int) -> int:
    """`requested` if the model's context and the KV budget allow it, else the longest that fits (a warning when
    that is below the context); an error naming what to change when even a short context does not fit."""
    if requested is not None:
        if requested < 1 or requested > context:
            raise ValueError(
                f"max_model_len must be in [1, {context}] (the model's context), got {requested}"
            )
        if requested * bytes_per_position > budget:
            raise ValueError(
                f"max_model_len {requested} x max_num_seqs needs a {requested * bytes_per_position / 2**30:.2f} "
                f"GiB KV store, over the {budget / 2**30:.2f} GiB budget: lower max_model_len or max_num_seqs, "
                "or raise max_kv_cache_bytes"
            )
        return requested
    fit = budget // bytes_per_position
    if fit < min(context, _MIN_MODEL_LEN):
        raise ValueError(
            f"a KV store of max_num_seqs slots fits only {fit} tokens per slot in {budget / 2**30:.2f} GiB: "
            "lower max_num_seqs or raise max_kv_cache_bytes"
        )
    if fit < context:
        logger.warning("max_model_len capped at %d (model context %d) to fit the KV budget", fit, context)
    return int(min(context, fit))


def default_kv_budget(device: torch.device) -> int:
    """CUDA: 85% of free device memory (weights are loaded by then); CPU: a quarter of physical memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 4 * 2**30
