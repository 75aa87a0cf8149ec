"""Lengths up to which rose is exact for a model, from transformers' own per-layer view of it.

rose flattens a step's sequences into one forward, each token with its own position. Where transformers computes
something from more than a token's position, rose matches `generate` only below a length, and the engine caps
`max_model_len` (and for llama4 the step's token budget) there (`exact_lengths`, which rose.engine.model_probe keeps
on its AttentionLayers: exact_context / exact_step_tokens):
- a layer whose cache keeps fewer tokens than its mask sees (a `sliding_window` that only transformers' cache
  applies, as in moshi): `generate` forgets what rose still attends to, beyond that window;
- longrope / dynamic RoPE: the frequencies depend on the longest position in the whole forward, another sequence's
  in a batched step, once a position reaches the length where they switch;
- llama4's attention temperature tuning: NoPE layers scale queries by the token's index in the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

if TYPE_CHECKING:
    import torch

    from rose.engine.layer_spec import LayerSpec

Limit = tuple[int, str]  # a length, and why rose is exact only below it


def cache_layers(config) -> tuple[list[str], list[dict]]:
    """transformers' own view of each decoder layer: its cache layer type and that layer's arguments."""
    try:
        return get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception:  # configs without per-layer structure (state-space models): judged by their fields
        return list(getattr(config, "layer_types", None) or ()), []


def layer_types(config) -> list[str]:
    """Each decoder layer's kind as transformers' cache sees it (full/sliding/chunked attention, linear, conv, ...)."""
    return list(cache_layers(config)[0])


def cache_windows(config) -> list[int | None]:
    """Per decoder layer, the window transformers' cache keeps (sliding and chunked layers), else None."""
    return [kwargs.get("sliding_window") for kwargs in cache_layers(config)[1]]


def exact_lengths(
    modules: Sequence[torch.nn.Module], specs: Sequence[LayerSpec], model: PreTrainedModel
) -> tuple[Limit | None, Limit | None]:
    """Where transformers' own computation depends on more than each token's position, rose is exact only below a
    length: (the longest context, the most tokens per forward) rose serves exactly, each the tightest such limit with
    its reason, None where unbounded. `modules` / `specs`: the model's attention calls in forward order, as probed."""
    limits = [*_cache_window_limits(modules, specs, model.config), *_rope_limits(model)]
    step: Limit | None = None
    # llama4's temperature tuning scales NoPE layers' queries by the token's index in the forward, which is the
    # step's flattened index here: exact only while both stay below its floor_scale - 1
    tuned = [m for m in modules if getattr(m, "attn_temperature_tuning", False) and not m.use_rope]
    if tuned:
        limit = int(tuned[0].floor_scale) - 1
        step = (limit, f"its NoPE layers scale queries by the token's index in the forward from {limit} on")
        limits.append(step)
    return (min(limits) if limits else None), step


def _cache_window_limits(
    modules: Sequence[torch.nn.Module], specs: Sequence[LayerSpec], config
) -> list[Limit]:
    """generate keeps only the last `window - 1` tokens of a layer transformers' cache calls sliding (or chunked);
    where that is fewer than the layer's mask lets it see, rose is exact only while contexts fit that window."""
    windows = cache_windows(config)
    limits = []
    for module, spec in zip(modules, specs, strict=True):
        index = getattr(module, "layer_idx", None)
        kept = windows[index] if isinstance(index, int) and index < len(windows) else None
        span = spec.window or spec.chunk
        if kept is not None and (span is None or kept < span):
            sees = "every token" if span is None else f"{span} tokens"
            limits.append(
                (
                    kept,
                    f"transformers' cache keeps the last {kept} tokens of layer {index}, whose mask sees {sees}",
                )
            )
    return limits


def _rope_limits(model: PreTrainedModel) -> list[Limit]:
    """longrope and dynamic RoPE pick their frequencies from the longest position in the whole forward, which in a
    batched step belongs to another sequence: exact only while no position reaches the length where they switch.
    (dynamic RoPE only grows past `max_position_embeddings`, the model's own context: it never caps in practice.)
    The text decoder's rotary modules only: a vision tower's never sees the text's positions."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    limits = []
    for module in decoder.modules():
        kinds = getattr(module, "rope_type", None)
        # rotary modules keep their original frequencies, per layer type (`<type>_original_inv_freq`) where the
        # type decides the RoPE
        if not isinstance(kinds, str | dict) or not any(
            "original_inv_freq" in name for name, _ in module.named_buffers()
        ):
            continue
        for layer_type, kind in kinds.items() if isinstance(kinds, dict) else [(None, kinds)]:
            if kind == "longrope":
                params = module.config.rope_parameters
                limit = int(
                    (params[layer_type] if layer_type else params)["original_max_position_embeddings"]
                )
            elif "dynamic" in kind:
                limit = int(module.original_max_seq_len)
            else:
                continue
            limits.append(
                (limit, f"its {kind} RoPE changes frequencies once a forward holds position {limit}")
            )
    return limits
