"""The tiny architecture zoo (architectures.py): deterministic weights, tiny sizes, and the distinctive
features the parity sweep relies on, on a dozen representative families (the full sweep is
benchmarks/architectures_report.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from architecture_overrides import FAMILY_OVERRIDES, SUBCONFIG_OVERRIDES
from architectures import (
    BOS_ID,
    BUILD_FAILURES,
    EOS_ID,
    PAD_ID,
    VOCAB,
    build_failure,
    causal_lm_types,
    prompt_id_range,
    tiny_config,
    tiny_model,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

REPRESENTATIVE = [
    "llama",
    "mistral",
    "qwen2",
    "gemma2",
    "gpt_oss",
    "llama4_text",
    "deepseek_v3",
    "gpt2",
    "phi3",
    "starcoder2",
    "falcon",
    "mamba",
]


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {t: tiny_model(t) for t in REPRESENTATIVE}


def test_types_are_every_causal_lm_type_sorted():
    types = causal_lm_types()
    assert types == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) and len(types) > 150
    assert set(REPRESENTATIVE) <= set(types)


def test_known_failures_keep_their_reason():
    assert set(BUILD_FAILURES) <= set(causal_lm_types())
    for model_type, reason in BUILD_FAILURES.items():
        assert build_failure(model_type) == reason and reason
        with pytest.raises(ValueError, match=model_type):
            tiny_config(model_type)
    assert build_failure("llama") is None
    assert build_failure("not-a-model") is not None


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss", "mamba"])
def test_same_seed_same_weights(model_type):
    sa, sb = tiny_model(model_type, seed=3).state_dict(), tiny_model(model_type, seed=3).state_dict()
    so = tiny_model(model_type, seed=4).state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], so[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_types_are_tiny_and_consistent(models, model_type):
    model = models[model_type]
    config = model.config
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert config.vocab_size == VOCAB
    assert (config.eos_token_id, config.bos_token_id, config.pad_token_id) == (EOS_ID, BOS_ID, PAD_ID)
    assert config.tie_word_embeddings is False
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    for name, value in config.to_dict().items():
        if name.endswith("_token_id") and isinstance(value, int):
            assert 0 <= value < VOCAB, name
    assert getattr(config, "max_position_embeddings", 512) >= 256
    assert 2 <= config.num_hidden_layers <= 8


def test_greedy_choices_are_clear(models):
    lo, hi = prompt_id_range()
    ids = torch.randint(lo, hi, (1, 11), generator=torch.Generator().manual_seed(0))
    gaps = []
    for model in models.values():
        with torch.no_grad():
            top = model(ids).logits[0, -1].topk(2).values
        gaps.append((top[0] - top[1]).item())
    assert sum(g > 1e-3 for g in gaps) >= len(gaps) - 1, gaps


def test_norm_weights_stay_near_one(models):
    norms = [p for n, p in models["llama"].named_parameters() if n.endswith("norm.weight")]
    assert norms
    for p in norms:  # redrawn around 1, not left at exactly 1 (nor zeroed)
        assert 0.7 < p.mean().item() < 1.3 and p.std().item() > 0.01


def test_sliding_windows_are_small_and_on(models):
    for model_type in ("mistral", "phi3", "starcoder2"):
        assert models[model_type].config.sliding_window == 8, model_type
    qwen2 = models["qwen2"].config
    assert qwen2.use_sliding_window and qwen2.sliding_window == 8
    assert qwen2.layer_types == ["full_attention", "sliding_attention"]


def test_gemma2_keeps_soft_capping_and_alternating_layers(models):
    config = models["gemma2"].config
    assert config.attn_logit_softcapping == 5.0  # low enough to bend the tiny model's attention scores
    assert config.final_logit_softcapping == 30.0
    assert config.sliding_window == 8
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.query_pre_attn_scalar == config.head_dim


def test_gpt_oss_has_real_sinks(models):
    model = models["gpt_oss"]
    sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
    assert sinks and all(p.abs().mean().item() > 0.1 for p in sinks)
    assert set(model.config.layer_types) == {"sliding_attention", "full_attention"}
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2


def test_llama4_text_has_small_chunks_and_its_layer_pattern(models):
    config = models["llama4_text"].config
    assert config.attention_chunk_size == 8
    assert set(config.layer_types) == {"chunked_attention", "full_attention"}
    assert config.num_local_experts == 4


def test_deepseek_v3_is_small_valid_mla_and_moe(models):
    config = models["deepseek_v3"].config
    assert (config.kv_lora_rank, config.q_lora_rank) == (32, 48)
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.head_dim == config.qk_rope_head_dim  # MLA's rotary part
    assert config.n_routed_experts == 4 and config.num_experts_per_tok == 2
    assert config.n_routed_experts % config.n_group == 0 and config.topk_group <= config.n_group
    assert config.num_key_value_heads == config.num_attention_heads


def test_gqa_where_the_family_supports_it(models):
    for model_type in ("llama", "mistral", "qwen2", "phi3"):
        config = models[model_type].config
        assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2), model_type


def test_mamba_keeps_its_state_space_init(models):
    mixer = models["mamba"].backbone.layers[0].mixer
    assert mixer.A_log.shape[-1] == models["mamba"].config.state_size
    assert torch.isfinite(mixer.A_log).all() and (mixer.A_log > 0).any()  # log(1..16): A = -exp(A_log) < 0


def test_hybrids_keep_one_layer_of_each_kind():
    assert set(tiny_config("jamba").layers_block_type) == {"attention", "mamba"}
    assert set(tiny_config("qwen3_next").layer_types) == {"linear_attention", "full_attention"}


# Override keys that are no declared field on purpose: kwargs that __post_init__ consumes, or (blt, dbrx) attributes
# the modelling code reads although the config does not declare them.
UNDECLARED = {
    "gemma4_text": {"global_head_dim", "num_global_key_value_heads"},
    "gemma4_unified_text": {"global_head_dim", "num_global_key_value_heads"},
    "dots3_note_text": {f"swa_{k}" for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    | {f"swa_{k}" for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")},
    "blt": {"num_hidden_layers"},
    "dbrx.attn_config": {"rope_theta"},
}


def test_overrides_name_real_fields():
    """A misspelt override would only set a stray attribute and silently leave the feature off."""
    for model_type, overrides in FAMILY_OVERRIDES.items():
        cls = CONFIG_MAPPING[model_type]
        names = {f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map)
        assert set(overrides) - names == UNDECLARED.get(model_type, set()), model_type
    for model_type, subs in SUBCONFIG_OVERRIDES.items():
        for key, overrides in subs.items():
            names = {f.name for f in dataclasses.fields(CONFIG_MAPPING[model_type].sub_configs[key])}
            assert set(overrides) - names == UNDECLARED.get(f"{model_type}.{key}", set()), (model_type, key)
