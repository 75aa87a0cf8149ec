"""rose.engine.loader: a preset, a config (random weights), or a checkpoint directory, resolved the same way by the
LLM API, the worker (`--model`) and `rose bench`."""

from __future__ import annotations

import pytest
import torch

from rose import LLM, SamplingParams
from rose.engine import loader, presets


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def qwen_config(tmp_path):
    path = tmp_path / "cfg" / "config.json"
    path.parent.mkdir()
    presets.preset_config("tiny-qwen2").to_json_file(path)
    return path


def test_a_config_builds_random_weights_from_seed_0(qwen_config):
    preset, _ = presets.build_preset("tiny-qwen2")
    for source in (qwen_config, str(qwen_config)):
        assert loader.random_weights_config(source) == qwen_config
        model, tokenizer = loader.build_model(source)
        assert type(model).__name__ == "Qwen2ForCausalLM" and same_weights(model, preset)
        assert len(tokenizer) == len(presets.build_tokenizer())  # the in-memory one: the config has none
    other, _ = loader.build_model(qwen_config, seed=1)
    assert not same_weights(other, preset)
    assert loader.model_config(qwen_config).num_hidden_layers == preset.config.num_hidden_layers


def test_random_weights_are_drawn_in_float32_whatever_the_config_says(qwen_config):
    config = loader.model_config(qwen_config)
    config.dtype = torch.bfloat16  # as real checkpoints' configs say
    config.to_json_file(qwen_config)
    model, _ = loader.build_model(qwen_config)
    assert next(model.parameters()).dtype == torch.float32
    assert same_weights(model, presets.build_preset("tiny-qwen2")[0])


def test_a_directory_without_weights_is_an_error_not_random_weights(qwen_config):
    assert loader.random_weights_config(qwen_config.parent) is None
    with pytest.raises(OSError):
        loader.load(qwen_config.parent, device="cpu")


def test_a_checkpoint_directory_loads_its_weights_and_tokenizer(tmp_path):
    model, tokenizer = presets.build_preset("tiny-llama", seed=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert loader.random_weights_config(tmp_path) is None  # weights present: not a bare config
    loaded = loader.load(tmp_path, device="cpu", dtype="float32")
    assert same_weights(loaded.model, model)
    assert loaded.tokenizer.encode("hello world") == tokenizer.encode("hello world")


def test_a_config_next_to_a_tokenizer_uses_it(qwen_config):
    presets.build_tokenizer(vocab_size=1024).save_pretrained(qwen_config.parent)
    _, tokenizer = loader.build_model(qwen_config)
    assert len(tokenizer) == 1024


def test_a_given_tokenizer_spares_the_checkpoint_its_own(tmp_path):
    model, tokenizer = presets.build_preset("tiny-llama")
    model.save_pretrained(tmp_path / "weights-only")
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = loader.load(tmp_path / "weights-only", tokenizer=str(tmp_path / "tok"), device="cpu")
    assert same_weights(loaded.model, model) and len(loaded.tokenizer) == len(tokenizer)


def test_the_llm_api_runs_a_config(qwen_config):
    llm = LLM(str(qwen_config), device="cpu", max_num_seqs=2, max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_an_unknown_path_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="neither a preset .* a config file nor an existing directory"):
        loader.load(str(tmp_path / "missing" / "model"), device="cpu")
