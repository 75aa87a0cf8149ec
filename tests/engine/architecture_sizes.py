"""The generic tables of `architectures` (this folder): tiny values by config attribute name, feature
switches, and the names of layer counts. A value applies wherever a family's config declares the attribute with an
int default (None stays None: it means "derived" or "feature off", e.g. q_lora_rank=None is MLA without query
compression)."""

from __future__ import annotations

import re
from typing import Any

VOCAB = 512
EOS_ID, BOS_ID, PAD_ID = 0, 1, 2
NUM_SPECIAL_TOP = 32  # other special ids (image, audio, sep, ...) are placed at the top of the vocabulary
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
WINDOW = 8  # sliding windows, attention chunks, sparse-attention budgets: 20-token prompts already cross them
POSITIONS = 512
MIN_LAYERS, MAX_LAYERS = 2, 8

SIZES: dict[str, int] = {
    # widths
    **dict.fromkeys(
        ("hidden_size", "n_embd", "d_model", "embed_dim", "emb_dim", "word_embed_proj_dim"), HIDDEN
    ),
    "hidden_size_global": HIDDEN,  # blt's local encoder/decoder project to and from its global transformer
    # vision/audio towers (built by the *ForConditionalGeneration types) project into the text width
    **dict.fromkeys(("adapter_in_dim", "adapter_out_dim", "adapter_input_size", "out_hidden_size"), HIDDEN),
    **dict.fromkeys(
        ("vision_output_dim", "projector_input_dim", "projector_output_dim", "output_channels"), HIDDEN
    ),
    **dict.fromkeys(("ext_pw_out_channel", "depthwise_separable_out_channel", "nemo_conv_channels"), HIDDEN),
    "num_blocks": MIN_LAYERS,  # phi4_multimodal's audio conformer
    # attention heads
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), HEADS
    ),
    **dict.fromkeys(("encoder_attention_heads", "swa_num_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "swa_head_dim", "attention_head_dim", "dim_head", "kv_channels"), HEAD_DIM),
    "query_pre_attn_scalar": HEAD_DIM,  # gemma's 1/sqrt scale follows the head size
    "rotary_dim": HEAD_DIM // 2,  # partial rotary (gptj, codegen): half of each head rotates
    # MLPs
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim"), FFN),
    **dict.fromkeys(("ffn_hidden_size", "dim_ff", "dff", "d_inner", "mlp_dim"), FFN),
    **dict.fromkeys(
        ("prefix_dense_intermediate_size", "intermediate_size_mlp", "dense_intermediate_size"), FFN
    ),
    # vocabularies and positions
    **dict.fromkeys(("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input"), VOCAB),
    "encoder_hash_byte_group_vocab": VOCAB,  # blt's hashed n-gram embeddings
    **dict.fromkeys(("shape_vocab_size", "pronunciation_vocab_size"), 64),  # roc_bert's extra embeddings
    **dict.fromkeys(("shape_embed_dim", "pronunciation_embed_dim"), 32),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), POSITIONS),
    "model_max_length": POSITIONS,
    **dict.fromkeys(("num_buckets", "relative_attention_num_buckets"), 32),
    "rel_extent": 32,  # inkling's relative-position extent
    # mixture of experts: 4 small experts, top-2, one shared expert, one dense layer first
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_top_k", "moe_topk", "top_k_experts", "moe_k"), 2),
    "num_experts_per_token": 2,
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size"), FFN // 2
    ),
    **dict.fromkeys(("shared_intermediate_size", "shared_experts_intermediate_size"), FFN // 2),
    "moe_shared_expert_intermediate_size": FFN // 2,
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
    "zero_expert_num": 2,  # longcat's "zero" (identity) experts
    "router_hidden_size": 32,
    # MLA (deepseek_v2/v3 and relatives): KV latent of rank 32, decoupled RoPE part of 8 dims
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "o_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "v_head_dim": 16,
    # sparse (DSA) attention's indexer keeps 8 keys: it really selects on a 20-token prompt
    "index_head_dim": HEAD_DIM,
    "index_n_heads": 2,
    "index_topk": WINDOW,
    # linear attention / gated delta nets
    **dict.fromkeys(("linear_num_key_heads", "linear_num_heads"), 2),
    "linear_num_value_heads": 4,
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), HEAD_DIM),
    # state-space layers: inner width 2 * 64 = 8 heads of 16
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim"), HEAD_DIM),
    **dict.fromkeys(("mamba_n_heads", "n_mamba_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    "mamba_d_ssm": 2 * HIDDEN,
    # local attention of every name
    **dict.fromkeys(
        ("sliding_window", "sliding_window_size", "window_size", "attention_window_size"), WINDOW
    ),
    **dict.fromkeys(("local_attention_window_len", "attention_chunk_size", "keep_window_size"), WINDOW),
    "local_attention": 2 * WINDOW,  # modernbert-decoder: its sliding window is half of this
    # odds and ends
    "hc_lowrank": 32,  # qwen4_exp's hyper-connection mixer
    "hidden_size_per_layer_input": HEAD_DIM,  # gemma3n/4 per-layer embeddings
    "laurel_rank": 8,  # gemma3n's learned augmented residual
    "input_embedding_size": 32,  # rembert's factorised embeddings
    **dict.fromkeys(("output_embedding_size", "prompt_mid_dim"), HIDDEN),  # rembert, mvp
}

# Feature switches, on from the start (so that the layer patterns derived from them include the switched-on
# kinds): a sliding window wherever the config has one, even where its default None turns it off, and qwen2-style
# flags that gate it (window on from layer 1).
SWITCHES: dict[str, Any] = {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}

# Float values, applied where the default is a float (None = the feature off, which stays off). Attention scores of
# the tiny models are of order 1: a cap of 50 (gemma2's) would change nothing, 5 visibly bends them. (The final-logit
# caps stay: tanh is monotonic, so they never change a greedy choice anyway.)
FLOATS: dict[str, float] = {"attn_logit_softcapping": 5.0}

# Caps rather than values: group-limited MoE routing keeps 2 groups of 2 experts, of which the best 1 is used.
GROUPS: dict[str, int] = {"n_group": 2, "topk_group": 1, "num_expert_group": 2, "topk_groups": 1}

# MoE fields whose default None the modelling code cannot take (deepseek_v2's top-k, dots1's experts).
MOE_FILL = ("num_experts_per_tok", "n_routed_experts", "n_shared_experts")

LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
DROPOUT = re.compile(r"(dropout|pdrop|drop_rate|layerdrop|drop_prob)")
