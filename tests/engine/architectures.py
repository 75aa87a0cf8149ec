"""Tiny random-weight models of every decoder-only causal-LM architecture in the installed transformers.

Contract (what the parity sweep relies on):

- `causal_lm_types()` lists every `model_type` of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, sorted.
- `tiny_config(model_type)` is that type's own config class with its defaults shrunk by attribute name
  (`architecture_sizes.SIZES`: width 64, 4 query / 2 KV heads of dim 16, MLP 128, vocabulary 512 with eos 0 /
  bos 1 / pad 2 and every other token id inside it, 512 positions, untied embeddings, no dropout; 2 layers, or the
  shortest prefix of the family's layer pattern that holds every kind of layer, at most 8), then per-family
  overrides (`architecture_overrides`). Composite configs get tiny sub-configs the same way. Each family's
  distinctive features stay on: sliding windows of 8 tokens wherever a config has one (flags such as qwen2's
  use_sliding_window switched on), layer-type patterns, soft-capping, attention sinks, chunked attention (chunk 8),
  MLA ranks, sparse-attention budgets of 8 keys, MoE routing (4 experts, top-2), hybrid layer patterns.
- `tiny_model(model_type, seed)` builds it with `AutoModelForCausalLM.from_config(..., dtype=float32)` under
  `torch.manual_seed(seed)`, in eval mode, then `redraw_weights` redraws the parameters from a generator seeded
  with `seed` so that greedy decoding has clear winners (the default std-0.02 init gives near-uniform logits full
  of near-ties). The same seed gives the same weights on every call. Nothing is downloaded.
- `build_failure(model_type)` says why a type cannot be built tiny (`BUILD_FAILURES`); such types stay in
  `causal_lm_types()`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import torch
from architecture_overrides import BUILD_FAILURES, FAMILY_OVERRIDES, SUBCONFIG_OVERRIDES
from architecture_sizes import (
    BOS_ID,
    DROPOUT,
    EOS_ID,
    FLOATS,
    GROUPS,
    HEADS,
    LAYER_COUNTS,
    MAX_LAYERS,
    MIN_LAYERS,
    MOE_FILL,
    NUM_SPECIAL_TOP,
    PAD_ID,
    SIZES,
    SWITCHES,
    VOCAB,
)
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "BOS_ID",
    "BUILD_FAILURES",
    "EOS_ID",
    "PAD_ID",
    "VOCAB",
    "build_failure",
    "causal_lm_types",
    "prompt_id_range",
    "redraw_weights",
    "tiny_config",
    "tiny_model",
]


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_failure(model_type: str) -> str | None:
    """Why `model_type` cannot be built tiny (a known reason), or None when it can."""
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "not a causal-LM model type of this transformers"
    return BUILD_FAILURES.get(model_type)


def prompt_id_range() -> tuple[int, int]:
    """Token ids safe for random prompts: above eos/bos/pad, below the special ids at the top of the vocabulary."""
    return PAD_ID + 1, VOCAB - NUM_SPECIAL_TOP


def tiny_config(model_type: str) -> PretrainedConfig:
    """`model_type`'s config class with tiny dimensions and its distinctive features kept (see module docstring)."""
    reason = build_failure(model_type)
    if reason is not None:
        raise ValueError(f"{model_type}: {reason}")
    overrides = FAMILY_OVERRIDES.get(model_type, {})
    return _shrink(CONFIG_MAPPING[model_type], overrides, SUBCONFIG_OVERRIDES.get(model_type, {}))


def tiny_model(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A float32, eval-mode tiny `model_type` whose weights depend only on `seed`."""
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    redraw_weights(model, seed)
    return model


# --- config shrinking -------------------------------------------------------------------------------------------


def _shrink(cls: type[PretrainedConfig], overrides: dict[str, Any], sub_overrides: dict[str, dict]) -> Any:
    """Build `cls` twice: once with the feature switches and overrides (to see the family's own defaults and layer
    pattern with its features on), then with the tiny values derived from that, the overrides winning.
    Sub-configs (text/vision/...) are shrunk the same way and passed in as objects."""
    subs = _tiny_subconfigs(cls, overrides, sub_overrides)
    names = {f.name for f in dataclasses.fields(cls)}
    overrides = {**{k: v for k, v in SWITCHES.items() if k in names}, **overrides}
    base = _base(cls, {**subs, **overrides})
    layers = next((overrides[k] for k in LAYER_COUNTS if k in overrides), None)
    tiny = {**_tiny_values(base, layers), **subs, **overrides}
    return cls(**tiny)


def _base(cls: type[PretrainedConfig], overrides: dict[str, Any]) -> PretrainedConfig:
    """The family's defaults with its overrides on (so that derived layer patterns show the switched-on features);
    overrides that only fit the tiny sizes (a 2-entry layer list, mamba heads of a 64-wide model) fail validation
    against the big defaults, and then the plain defaults serve."""
    try:
        return cls(**overrides)
    except StrictDataclassClassValidationError:
        return cls()


def _tiny_subconfigs(
    cls: type[PretrainedConfig], overrides: dict[str, Any], sub_overrides: dict[str, dict]
) -> dict[str, Any]:
    """Tiny versions of the sub-configs (text/vision/audio, dbrx's attn/ffn), each with the overrides of its own
    model type (gemma3's text_config gets gemma3_text's) and then those given for this parent."""
    out: dict[str, Any] = {}
    if not cls.sub_configs:
        return out
    base = _base(cls, overrides)
    for key in cls.sub_configs:
        sub = getattr(base, key, None)
        if isinstance(sub, PretrainedConfig) and key not in overrides:
            own = {**FAMILY_OVERRIDES.get(sub.model_type, {}), **sub_overrides.get(key, {})}
            out[key] = _shrink(type(sub), own, SUBCONFIG_OVERRIDES.get(sub.model_type, {}))
    return out


def _layer_count(base: dict[str, Any]) -> tuple[int | None, int]:
    """The base's layer count and the smallest prefix (>= 2) holding every kind of layer of its per-layer lists."""
    count = next((base[k] for k in LAYER_COUNTS if isinstance(base.get(k), int)), None)
    if count is None:
        return None, MIN_LAYERS
    lists = [v for v in base.values() if _is_pattern(v, count)]
    need = MIN_LAYERS
    for values in lists:
        kinds = {repr(v) for v in values}
        n = next(i for i in range(1, count + 1) if {repr(v) for v in values[:i]} == kinds)
        need = max(need, n)
    return count, min(need, count, MAX_LAYERS) if count >= MIN_LAYERS else count


def _is_pattern(value: Any, count: int) -> bool:
    """A per-layer list that repeats kinds (layer_types, no_rope_layers flags); not a list of layer indices."""
    return (
        isinstance(value, list) and count > 0 and len(value) == count and len(set(map(repr, value))) < count
    )


def _tiny_values(base: PretrainedConfig, layers: int | None = None) -> dict[str, Any]:
    """Tiny kwargs for `base`'s class; `layers` (an override's layer count) wins over the pattern's."""
    # Declared fields only: attributes that __post_init__ derives (e.g. MLA's head_dim = qk_rope_head_dim) must be
    # derived again from the tiny fields, not forced from the big model's values.
    d = _field_values(base)
    count, n = _layer_count(d)
    n = layers or n
    specials = iter(range(VOCAB - 1, VOCAB - NUM_SPECIAL_TOP, -1))
    out: dict[str, Any] = {}
    for key, value in d.items():
        tiny = _tiny_value(key, value, count, n, specials)
        if tiny is not _UNCHANGED:
            out[key] = tiny
    return {**out, **_consistent(d, out)}


_UNCHANGED = object()


def _tiny_value(key: str, value: Any, count: int | None, n: int, specials: Iterator[int]) -> Any:
    """One field's tiny value, or _UNCHANGED to keep the family's default."""
    if isinstance(value, bool) or key.startswith("_") or key == "per_layer_config":
        return _UNCHANGED  # flags stay; per_layer_config is derived again from the tiny fields
    if key in LAYER_COUNTS and isinstance(value, int):
        return n
    if count and _is_pattern(value, count):
        return [SIZES[key]] * n if key in SIZES else (value * n)[:n]  # per-layer sizes (gemma3n) or kinds
    if count and isinstance(value, list) and len(value) == count:
        return value[:n]  # per-layer values without repeats
    if key in SIZES and isinstance(value, int):
        return SIZES[key]
    if DROPOUT.search(key) and isinstance(value, float):
        return 0.0
    if key in FLOATS and isinstance(value, float):
        return FLOATS[key]
    if key in GROUPS and isinstance(value, int):
        return min(value, GROUPS[key])
    if key in ("eos_token_id", "bos_token_id", "pad_token_id") or (
        key.endswith(("_token_id", "_token_index", "_token_ids")) and value is not None
    ):
        return _token_id(key, value, specials)
    return _UNCHANGED


def _consistent(d: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Values that must agree with others, and defaults the modelling code cannot take."""
    fix: dict[str, Any] = {"tie_word_embeddings": False}
    # None that the modelling code cannot take (hunyuan's head_dim, nemotron's KV heads, dots1's experts)
    fill = ("head_dim", "num_key_value_heads", *(MOE_FILL if "moe_intermediate_size" in d else ()))
    fix.update({k: SIZES[k] for k in fill if k in d and d[k] is None})
    if d.get("head_dim") is not None and d.get("head_dim") == d.get("qk_rope_head_dim"):
        fix["head_dim"] = SIZES["qk_rope_head_dim"]  # MLA's rotary embedding spans head_dim
    if isinstance(d.get("kv_lora_rank"), int) and "num_key_value_heads" in out:
        fix["num_key_value_heads"] = HEADS  # MLA expands its latent into one K/V per query head: no GQA
    if "is_decoder" in d:
        fix["is_decoder"] = True  # encoder families (bert, roberta, ...) are causal LMs only as decoders
    return fix


def _field_values(config: PretrainedConfig) -> dict[str, Any]:
    """The declared fields' values; through to_dict only where getattr refuses (the per-layer attributes of
    heterogeneous configs), since to_dict rewrites some values (dory doubles its layer lists there)."""
    serialized: dict[str, Any] | None = None
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        try:
            out[f.name] = getattr(config, f.name)
        except (AttributeError, RuntimeError):  # AmbiguousGlobalPerLayerAttributeError is a RuntimeError
            serialized = config.to_dict() if serialized is None else serialized
            out[f.name] = serialized.get(f.name)
    return out


def _token_id(key: str, value: Any, specials: Iterator[int]) -> Any:
    """eos/bos/pad 0/1/2; other special ids (image, audio, ...) from the top of the vocabulary down."""
    if key.startswith("forced_"):
        return None  # forced bos/eos would override greedy choices at the first/last step
    if key.startswith("eos"):
        return EOS_ID if not isinstance(value, list) else [EOS_ID]
    if key.startswith("bos"):
        return BOS_ID
    if key.startswith(("pad", "decoder_start")):
        return PAD_ID
    if isinstance(value, list):
        return [next(specials) for _ in value]
    return next(specials)


# --- weights ----------------------------------------------------------------------------------------------------

MATRIX_STD = 0.1  # width 64: each projection keeps activations of order 1
HEAD_STD = 0.4  # output head: logits of std ~3 over 512 ids, so the top-1 is usually clear of the top-2
NORM_STD = 0.1  # norm weights stay ~1 (or ~0 where the family stores 1 + w)
BIAS_STD = 0.02
SINK_STD = 1.0  # attention-sink logits of order 1 change the softmax visibly
_KEEP_INIT = re.compile(r"(A_log|dt_bias|\.D$|time_decay|time_first|recurrent_param)")


@torch.no_grad()
def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Redraw the floating parameters from a generator seeded with `seed`, in registration order.

    Matrices (embeddings, projections, experts, convolutions) get N(0, 0.1), the output head N(0, 0.4); attention
    sinks N(0, 1); constant vectors (norm weights, biases, zero-initialised gates) their constant plus noise, so
    norms stay near 1 (or near 0 where the family computes 1 + w). Vectors whose init is structured (mamba's
    A_log / dt_bias / D, rwkv's decays, dt_proj biases, xlstm's gate ramps) keep it: it is seeded by from_config
    under torch.manual_seed(seed), hence as deterministic."""
    gen = torch.Generator().manual_seed(seed)
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    head_weight = getattr(head, "weight", None)
    for name, param in model.named_parameters():
        if not param.is_floating_point() or _KEEP_INIT.search(name):
            continue
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "sinks" in name:
            param.copy_(noise * SINK_STD)
        elif param.dim() >= 2:
            param.copy_(noise * (HEAD_STD if param is head_weight else MATRIX_STD))
        elif param.numel() > 0 and bool((param == param.flatten()[0]).all()):
            std = BIAS_STD if name.endswith("bias") else NORM_STD
            param.copy_(param.flatten()[0] + noise * std)
