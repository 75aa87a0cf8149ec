"""Per-family corrections to the generic shrinking of `architectures` (this folder): config-class kwargs that
win over the generic tiny values, where those do not make a valid model or would switch a family's feature off."""

from __future__ import annotations

from typing import Any

_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}
_GEMMA4_GLOBAL = {"global_head_dim": 32, "attention_k_eq_v": True, "num_global_key_value_heads": 1}

FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # sliding layers supported but none in the default pattern; laguna also varies its head count per layer
    "laguna": {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "num_attention_heads_per_layer": [4, 2],
    },
    "mellum": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
    # hybrids whose default pattern puts no attention layer in the first two
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2},
    "recurrent_gemma": {"num_hidden_layers": 3},  # block pattern recurrent, recurrent, attention
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},  # default: attention only
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": dict(_ROPE), "full_attention": dict(_ROPE)},
    },
    "dory": {
        "num_hidden_layers": 4,
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
    },
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # expands to attention_layers, one per layer
    # positions are offset by the padding id, and generation's check assumes the offset of pad id 0
    "prophetnet": {"pad_token_id": 0},
    # q/k width (hidden / 2) must be a multiple of 64, or the cache's state misfits the layers'
    "xlstm": {"hidden_size": 128},
    "xmod": {"default_language": "en_XX"},  # adapters are per language; none is chosen by default
    # axial position embeddings: dims sum to the width, shape multiplies to the positions; LSH hashing seeded
    "reformer": {
        "is_decoder": True,
        "axial_pos_embds_dim": [32, 32],
        "axial_pos_shape": [16, 32],
        "attention_head_size": 16,
        "feed_forward_size": 128,
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "hash_seed": 0,
        "num_buckets": 4,  # None means "pick at the first training step"; generation iterates it
    },
    # KV sharing: the last layers reuse the caches of the last unshared layer of their kind, so the unshared
    # prefix must hold one layer of each kind
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
    },
    # gemma4: full-attention layers get their own head_dim and (with K = V) a single KV head (per_layer_config);
    # the MoE block of the large variants runs beside the dense MLP; per-layer input embeddings stay on
    "gemma4_text": {
        **_GEMMA4_GLOBAL,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 64,
    },
    "gemma4_unified_text": dict(_GEMMA4_GLOBAL),
    # MLA with a different shape on the sliding layers (per_layer_config from the swa_* kwargs); the rotary part
    # is head_dim * partial_rotary_factor (0.25) = qk_rope_head_dim = 8 on both kinds
    "dots3_note_text": {
        "head_dim": 32,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 2,
        "swa_q_lora_rank": 32,
        "swa_kv_lora_rank": 24,
        "swa_head_dim": 32,
        "swa_qk_nope_head_dim": 24,
        "swa_v_head_dim": 16,
    },
    # doge's cross-domain MoE stays off, as by default: its router reshapes (2, tokens, keys) across the tokens of a
    # forward, so a token's output depends on the others (prompt length, batch); full forward != cached decoding
    # generate builds its cache from the top-level config's layer count, which BltConfig lacks
    "blt": {"num_hidden_layers": 2},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2},
    # top-1 routing is all ZAYA supports; turn its sliding layers on
    "zaya": {
        "num_experts_per_tok": 1,
        "num_hidden_layers": 2,
        "layer_types": ["hybrid_sliding", "hybrid"],
        "sliding_window": 8,
    },
    # query-sparse attention (QSA) indexer: off (None) by default, which the modelling code cannot take
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
}

# Parent type -> sub-config key -> kwargs, for composite configs (applied after the sub-config type's own).
SUBCONFIG_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    # a cross-attention layer among the tiny text layers (the default indices start at 3): text-only forwards skip it
    "mllama": {"text_config": {"num_hidden_layers": 3, "cross_attention_layers": [1]}},
    # DbrxAttention reads rope_theta, which its config does not declare, and clamps with clip_qkv unguarded;
    # a clip of 1 (q/k/v here have std ~0.8) keeps the clipping active
    "dbrx": {"attn_config": {"rope_theta": 10_000.0, "clip_qkv": 1.0}},
}

_DRAFTER = "speculative-decoding drafter: every layer reads the target model's shared KV states (no standalone decoding)"

BUILD_FAILURES: dict[str, str] = {
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "gemma3n": "multimodal: its vision tower is a TimmWrapperModel, which needs timm and PIL (not installed); "
    "the text decoder is gemma3n_text",
    **dict.fromkeys(
        ("musicgen", "musicgen_melody"),
        "audio-codebook decoder: the mapped config is the text-to-audio composite, whose decoder sub-config "
        "AutoModelForCausalLM cannot build, and its inputs are per-codebook token streams",
    ),
}
