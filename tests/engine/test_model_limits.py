"""rose.engine.model_limits: where transformers computes from more than each token's position, rose caps the lengths
it serves at the point up to which it is exact, matches `generate` there, and refuses a longer request."""

from __future__ import annotations

import copy

import pytest
import torch
from architectures import redraw_weights, tiny_config, tiny_model
from engine_helpers import drain, greedy, hf_greedy

from rose.engine.engine import Engine
from rose.engine.model_probe import UnsupportedModelError
from rose.engine.presets import model_from_config

PROMPTS = [[5, 9, 13], [40, 41], [7, 200, 33, 4, 71, 8]]


def exact_within_the_cap(model, max_tokens: int, **kwargs) -> Engine:
    reference = copy.deepcopy(model)
    engine = Engine(model, None, device="cpu", max_num_seqs=len(PROMPTS), **kwargs)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, greedy(max_tokens))
    run = drain(engine)
    for i, ids in enumerate(PROMPTS):
        assert run.outputs[str(i)].token_ids == hf_greedy(reference, ids, max_tokens), f"prompt {i}"
    return engine


def test_a_window_only_the_cache_applies_caps_the_context():
    """moshi: transformers' cache keeps `sliding_window` tokens while the mask is causal."""
    model = tiny_model("moshi")
    window = model.config.sliding_window
    engine = exact_within_the_cap(model, window - len(PROMPTS[-1]))
    assert engine.max_model_len == window
    with pytest.raises(
        UnsupportedModelError, match=rf"^moshi: exact only for contexts up to {window} tokens"
    ):
        Engine(tiny_model("moshi"), None, device="cpu", max_num_seqs=2, max_model_len=window + 1)


def longrope_phi3(original: int = 12):
    config = tiny_config("phi3")
    half = config.hidden_size // config.num_attention_heads // 2
    config.rope_parameters = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * half,
        "long_factor": [1.0 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": original,
    }
    config.original_max_position_embeddings = (
        original  # phi3 standardizes its rope parameters from this field
    )
    model = model_from_config(config).eval()
    redraw_weights(model, 0)  # clear greedy choices, as the zoo's
    assert model.config.rope_parameters["original_max_position_embeddings"] == original
    return model


def test_longrope_per_layer_type_caps_the_context_too():
    """gemma3's rotary module keeps one RoPE per layer type (`<type>_original_inv_freq`)."""
    config = tiny_config("gemma3_text")
    half = config.head_dim // 2
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0] * half,
        "long_factor": [4.0] * half,
    }
    config.rope_parameters = {"full_attention": longrope, "sliding_attention": dict(longrope)}
    engine = Engine(model_from_config(config).eval(), None, device="cpu", max_num_seqs=2)
    assert engine.max_model_len == 16


def test_longrope_caps_the_context_at_its_original_length():
    """longrope switches every position's frequencies once any position of a forward passes the original length:
    in a batched step, another sequence's."""
    engine = exact_within_the_cap(longrope_phi3(12), 12 - len(PROMPTS[-1]))
    assert engine.max_model_len == 12
    with pytest.raises(
        UnsupportedModelError, match="phi3: exact only for contexts up to 12 tokens .*longrope"
    ):
        Engine(longrope_phi3(12), None, device="cpu", max_num_seqs=2, max_model_len=64)


def temperature_tuned_llama4(floor_scale: int, attn_scale: float = 0.1):
    config = tiny_config("llama4_text")
    config.floor_scale, config.attn_scale = floor_scale, attn_scale
    model = model_from_config(config).eval()
    redraw_weights(model, 0)
    return model


def test_llama4_temperature_tuning_caps_the_context_and_the_step():
    model = temperature_tuned_llama4(16)
    config = model.config
    assert config.attn_temperature_tuning and 0 in config.no_rope_layers
    engine = exact_within_the_cap(model, 8)
    assert engine.max_model_len == 15 and engine.scheduler.max_num_batched_tokens == 15
    with pytest.raises(UnsupportedModelError, match="exact only for steps of up to 15 tokens"):
        Engine(temperature_tuned_llama4(16), None, device="cpu", max_num_seqs=2, max_num_batched_tokens=64)


def _own_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """A layer's own causal attention that ignores the mask it is given (as remote code or a future model may)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def test_an_attention_layer_that_skips_rose_is_refused():
    """A layer whose attention runs through another implementation would attend without rose's store."""
    from transformers import AttentionInterface

    AttentionInterface.register("test_own_attention", _own_attention)
    model = tiny_model("llama")
    layer = model.model.layers[1].self_attn
    layer.config = copy.deepcopy(
        model.config
    )  # its own config, which the switch to rose's attention never reaches
    layer.config._attn_implementation_internal = "test_own_attention"
    with pytest.raises(
        UnsupportedModelError, match=r"^llama: attention layer 1 \(LlamaAttention\) ran without going"
    ):
        Engine(model, None, device="cpu", max_num_seqs=2, max_model_len=64)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("build", ["longrope", "llama4"])
def test_without_the_cap_rose_would_be_wrong(build, monkeypatch):
    """Guards the caps above: past them, batched steps really do diverge from generate."""
    from coverage_check import check_model

    from rose.engine import model_limits

    def model():
        if build == "longrope":
            return longrope_phi3(12)
        return temperature_tuned_llama4(
            4, attn_scale=1.0
        )  # scales large enough to change tiny models' tokens

    assert check_model(build, model, ("batched",)).status == "refused"  # max_model_len 128 is past the cap
    monkeypatch.setattr(model_limits, "exact_lengths", lambda modules, specs, model: (None, None))
    assert check_model(build, model, ("batched",)).status == "wrong"
