"""rose.engine.model_probe: what the probe reads off each attention layer, and what it refuses, before any request.

The specs must be transformers' own semantics per layer (its mask functions decide which layers are windowed or
chunked), and a model rose cannot serve exactly must be refused at construction with its type and the reason.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from engine_helpers import greedy
from transformers import AutoConfig, AutoModelForCausalLM

from rose import LLM
from rose.engine.engine import Engine
from rose.engine.layer_spec import LayerSpec
from rose.engine.model_probe import UnsupportedModelError, probe

SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def tiny(model_type: str, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    # the layer count at construction, so that fields derived from it (layer_types) agree
    config = AutoConfig.for_model(model_type, **{"num_hidden_layers": 2, **fields})
    for name, value in SMALL.items():
        if name not in fields:
            with contextlib.suppress(AttributeError):  # derived fields (falcon's head_dim) cannot be set
                setattr(config, name, value)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def specs(model) -> list[LayerSpec]:
    return probe(model).specs


def test_plain_gqa_layers():
    assert specs(tiny("llama")) == [LayerSpec(4, 2, 8, 8)] * 2


def test_a_sliding_window_set_only_in_the_config_is_read_from_transformers_mask():
    """Mistral keeps its window in the config, not on the attention module: it must still window."""
    assert [s.window for s in specs(tiny("mistral", sliding_window=6))] == [6, 6]
    assert [s.window for s in specs(tiny("mistral", sliding_window=None))] == [None, None]


def test_per_layer_windows_follow_layer_types_exactly():
    qwen2 = tiny("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert qwen2.config.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    assert [s.window for s in specs(qwen2)] == [None, 5, 5, 5]
    # use_sliding_window False: transformers windows no layer, whatever sliding_window says
    assert [s.window for s in specs(tiny("qwen2", sliding_window=5, use_sliding_window=False))] == [
        None,
        None,
    ]
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    gemma3 = tiny("gemma3_text", num_hidden_layers=3, sliding_window=7, layer_types=types)
    assert [s.window for s in specs(gemma3)] == [7, None, 7]


def test_soft_capping_and_sinks_and_chunks():
    gemma2 = specs(tiny("gemma2", attn_logit_softcapping=3.0, sliding_window=4))
    assert [(s.softcap, s.window) for s in gemma2] == [(3.0, 4), (3.0, None)]
    gpt_oss = specs(tiny("gpt_oss", num_local_experts=2, num_experts_per_tok=1, sliding_window=4))
    assert all(s.sinks for s in gpt_oss)
    llama4 = tiny(
        "llama4_text",
        attention_chunk_size=4,
        num_hidden_layers=4,
        num_local_experts=2,
        intermediate_size_mlp=64,
    )
    chunks = [s.chunk for s in specs(llama4)]
    assert chunks == [
        4 if rope else None for rope in llama4.config.no_rope_layers
    ]  # transformers' own pattern
    assert None in chunks and 4 in chunks


def test_keys_and_values_of_different_head_dims():
    assert specs(tiny("deepseek_v3", **_MLA)) == [LayerSpec(4, 4, 12, 6)] * 2


@pytest.mark.parametrize(
    ("model_type", "fields", "reason"),
    [
        ("falcon", {}, "its attention does not use transformers' AttentionInterface"),
        ("bloom", {"n_layer": 2, "n_head": 4}, "its attention does not use transformers' AttentionInterface"),
        ("mamba", {"state_size": 4}, "state"),
        ("jamba", {"num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1}, "state"),
        ("trocr", {}, "its attention does not use transformers' AttentionInterface"),
        ("bart", {}, "its forward does not pass position_ids on"),
        ("llama", {"is_causal": False}, "its attention mask is neither causal"),
    ],
)
def test_refused_at_construction_with_the_model_type_and_the_reason(model_type, fields, reason):
    model = tiny(model_type, **fields)
    with pytest.raises(UnsupportedModelError, match=rf"^{model_type}: .*{reason}"):
        Engine(model, None, device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(UnsupportedModelError, match=rf"^{model_type}: "):
        LLM(model, device="cpu", max_num_seqs=2, max_model_len=64)


def test_encoder_decoder_models_are_refused():
    torch.manual_seed(0)
    config = AutoConfig.for_model("t5", vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    from transformers import T5ForConditionalGeneration

    with pytest.raises(UnsupportedModelError, match="^t5: encoder-decoder models are not supported"):
        Engine(T5ForConditionalGeneration(config), None, device="cpu", max_num_seqs=2, max_model_len=32)


def test_decoder_layers_that_drop_kwargs_are_served():
    """stablelm's decoder layers pass no **kwargs to their attention: the step reaches it all the same."""
    model = tiny("stablelm")
    engine = Engine(model, None, device="cpu", max_num_seqs=2, max_model_len=64)
    engine.add_request("a", [5, 6, 7], greedy(3))
    while engine.has_unfinished():
        outs = engine.step()
    assert outs[0].finished and len(outs[0].output.token_ids) == 3


def test_the_store_is_shaped_per_layer():
    model = tiny("deepseek_v3", **_MLA)
    engine = Engine(model, None, device="cpu", max_num_seqs=3, max_model_len=40, block_size=8)
    # [blocks, block size, KV heads, head dim]: 3 sequences of 40 tokens = 15 blocks of 8
    assert [tuple(t.shape) for t in engine.cache.k] == [(15, 8, 4, 12)] * 2
    assert [tuple(t.shape) for t in engine.cache.v] == [(15, 8, 4, 6)] * 2


_MLA = dict(
    num_key_value_heads=4,
    head_dim=4,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
    n_routed_experts=2,
    num_experts_per_tok=1,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)


def test_a_sub_model_that_keeps_its_attention_is_refused(monkeypatch):
    """transformers only warns when a sub-model cannot switch attention: its layers would run without the store."""
    from architectures import tiny_model

    model = tiny_model("gemma3")  # a multimodal model: vision tower + text model
    text_model = type(model.model.language_model)
    monkeypatch.setattr(text_model, "_can_set_attn_implementation", classmethod(lambda cls: False))
    with pytest.raises(
        UnsupportedModelError, match="^gemma3: its sub-model Gemma3TextModel keeps transformers'"
    ):
        Engine(model, None, device="cpu", max_num_seqs=2, max_model_len=64)


def _tiny_dory(mode: str) -> torch.nn.Module:
    from architectures import redraw_weights, tiny_config

    config = tiny_config("dory")
    config.recurrent_kv_cache_mode = mode
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    redraw_weights(model, 0)
    return model


def test_dory_last_loop_is_refused_and_its_default_mode_served_exactly(monkeypatch):
    """dory's `last_loop` earlier loops attend over the K/V the last loop cached in earlier forwards, beside their own
    for the current one: `generate`'s tokens depend on its split (the prompt, then one token at a time), which rose's
    steps do not reproduce. Refused, naming the field and the mode rose serves; `per_loop` (the default) is exact."""
    from architectures import prompt_id_range
    from coverage_check import check_model
    from transformers import DoryConfig

    from rose.engine import model_probe

    with pytest.raises(
        UnsupportedModelError,
        match=r"^dory: recurrent_kv_cache_mode='last_loop' is not served exactly \(.*\); "
        r"rose serves recurrent_kv_cache_mode='per_loop' exactly",
    ):
        Engine(_tiny_dory("last_loop"), None, device="cpu", max_num_seqs=2, max_model_len=64)
    assert DoryConfig().recurrent_kv_cache_mode == "per_loop"
    modes = ("batched", "chunked")
    verdict = check_model("dory", lambda: _tiny_dory("per_loop"), modes, id_range=prompt_id_range())
    assert verdict.status == "exact", verdict.detail
    # the refusal is needed: served as any other model, last_loop parts from generate
    monkeypatch.setattr(model_probe, "_UNSERVED_MODES", {})
    verdict = check_model("dory", lambda: _tiny_dory("last_loop"), modes, id_range=prompt_id_range())
    assert verdict.status == "wrong", verdict.detail
