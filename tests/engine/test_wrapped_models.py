"""Models whose forward is wrapped (a user's subclass, PEFT's models, an instance-level wrapper as hooks make) are
judged by what reaches their layers, not by the forward's signature (rose.engine.model_probe): a wrapper that
passes `position_ids` on is served, exactly (greedy tokens equal transformers' `generate` on the same model, with
prompts batched and prefilled in chunks beside decoding sequences, where each token's own position matters); one that
drops them is refused at construction with the reason."""

from __future__ import annotations

import pytest
import torch
from architectures import prompt_id_range, tiny_model
from engine_helpers import greedy, hf_greedy
from transformers import GPT2LMHeadModel, LlamaForCausalLM

from rose.engine.engine import Engine
from rose.engine.model_probe import UnsupportedModelError

BASES = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel}  # rotary positions; learned absolute positions
PROMPTS = [[5 + (7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate((3, 11, 6, 17))]
MAX_TOKENS = 6
DROPS = "its forward does not pass position_ids on"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def subclass_passing(base: type) -> type:
    class Mine(base):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    return Mine


def subclass_popping(base: type) -> type:
    class PopsPositions(base):
        def forward(self, *args, **kwargs):
            kwargs.pop("position_ids", None)
            return super().forward(*args, **kwargs)

    return PopsPositions


def subclass_declaring_and_dropping(base: type) -> type:
    """Takes position_ids by name (a signature check would serve it) and does not pass them on."""

    class DeclaresPositions(base):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, **kwargs)

    return DeclaresPositions


def subclass_without_positions(base: type) -> type:
    class NoPositions(base):
        def forward(self, input_ids=None, use_cache=None, logits_to_keep=0):
            return super().forward(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep)

    return NoPositions


def as_subclass(model_type: str, make: type) -> torch.nn.Module:
    """The zoo's tiny `model_type` (clear greedy winners), rebuilt as the wrapper class with the same weights."""
    base = tiny_model(model_type)
    model = make(BASES[model_type])(base.config)
    model.load_state_dict(base.state_dict())
    return model.eval()


def instance_wrapped(model_type: str, *, drop: bool = False) -> torch.nn.Module:
    """No new class: the instance's forward replaced by a `(*args, **kwargs)` closure, as PEFT-style or hook-based
    wrappers do."""
    model = tiny_model(model_type)
    inner = model.forward

    def forward(*args, **kwargs):
        if drop:
            kwargs.pop("position_ids", None)
        return inner(*args, **kwargs)

    model.forward = forward
    return model


def engine(model: torch.nn.Module) -> Engine:
    # small steps: prompts are prefilled in chunks beside decoding sequences, so positions never equal the row index
    return Engine(
        model,
        None,
        device="cpu",
        dtype="float32",
        max_num_seqs=3,
        max_model_len=64,
        max_num_batched_tokens=8,
        block_size=4,
        enable_prefix_caching=True,
    )


def greedy_tokens(model: torch.nn.Module) -> list[list[int]]:
    """rose's greedy tokens for PROMPTS, all added at once."""
    rose = engine(model)
    for i, prompt in enumerate(PROMPTS):
        rose.add_request(str(i), prompt, greedy(MAX_TOKENS))
    got: dict[str, list[int]] = {}
    while rose.has_unfinished():
        for out in rose.step():
            if out.finished:
                got[out.request_id] = out.output.token_ids
    return [got[str(i)] for i in range(len(PROMPTS))]


def reference(model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time (before the engine owns the model)."""
    lo, hi = prompt_id_range()
    assert all(lo <= t < hi for p in PROMPTS for t in p)
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def assert_exact(model: torch.nn.Module) -> None:
    expected = reference(model)
    assert greedy_tokens(model) == expected


@pytest.mark.parametrize("model_type", sorted(BASES))
def test_a_subclass_whose_forward_passes_everything_on_is_served_exactly(model_type):
    assert_exact(as_subclass(model_type, subclass_passing))


@pytest.mark.parametrize("model_type", sorted(BASES))
def test_an_instance_level_forward_wrapper_is_served_exactly(model_type):
    assert_exact(instance_wrapped(model_type))


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_a_peft_model_is_served_exactly(task_type):
    """PEFT's wrappers: `PeftModel.forward(*args, **kwargs)` and `PeftModelForCausalLM.forward`, whose signature names
    no position_ids: both hand them to the model. Served with its adapter, exactly as `generate` on the PEFT model."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type=task_type
    )
    model = peft.get_peft_model(tiny_model("llama"), lora)
    with torch.no_grad():  # strong enough to change the greedy tokens
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20)
    model.eval()
    assert reference(model) != reference(tiny_model("llama"))
    assert_exact(model)


@pytest.mark.parametrize("model_type", sorted(BASES))
@pytest.mark.parametrize("make", [subclass_popping, subclass_declaring_and_dropping])
def test_a_forward_that_drops_position_ids_is_refused(model_type, make):
    model = as_subclass(model_type, make)
    with pytest.raises(UnsupportedModelError, match=rf"^{model_type}: {DROPS} .*its own positions"):
        engine(model)


def test_an_instance_level_wrapper_that_drops_position_ids_is_refused():
    with pytest.raises(UnsupportedModelError, match=rf"^llama: {DROPS}"):
        engine(instance_wrapped("llama", drop=True))


def test_a_forward_that_cannot_take_position_ids_is_refused_by_its_signature():
    model = as_subclass("llama", subclass_without_positions)
    with pytest.raises(UnsupportedModelError, match="^llama: its forward takes no position_ids"):
        engine(model)


def test_the_dropping_wrapper_would_be_wrong_if_served(monkeypatch):
    """Guards the refusal: the wrapper that drops position_ids, were it served, parts from `generate` here."""
    from rose.engine import model_probe

    model = as_subclass("llama", subclass_popping)
    expected = reference(model)
    monkeypatch.setattr(model_probe, "positions_reach_layers", lambda *_: True)
    assert greedy_tokens(model) != expected


def smollm3(no_rope_layers: list[int], *, drop: bool = False) -> torch.nn.Module:
    """The zoo's tiny SmolLM3 with rotary positions in the layers flagged 1 (0: NoPE, no positional encoding)."""
    from architectures import redraw_weights, tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("smollm3")
    config.no_rope_layers = no_rope_layers
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    redraw_weights(model, 0)
    if drop:
        inner = model.forward
        model.forward = lambda *args, **kwargs: inner(
            *args, **{k: v for k, v in kwargs.items() if k != "position_ids"}
        )
    return model


@pytest.mark.parametrize("drop", [False, True])
def test_a_model_without_any_positional_encoding_is_served_exactly(drop):
    """NoPE in every layer: positions change nothing, so a forward that drops them computes the same."""
    assert_exact(smollm3([0, 0, 0, 0], drop=drop))


@pytest.mark.parametrize("no_rope_layers", [[0, 1, 1, 1], [0, 0, 0, 1]])
def test_a_dropping_wrapper_is_refused_where_any_layer_has_positions(no_rope_layers):
    with pytest.raises(UnsupportedModelError, match=rf"^smollm3: {DROPS}"):
        engine(smollm3(no_rope_layers, drop=True))
    assert_exact(smollm3(no_rope_layers))  # the same model unwrapped is served


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_position_checks_hold_in_half_precision(dtype):
    def build(model):
        return Engine(model, None, device="cpu", dtype=dtype, max_num_seqs=2, max_model_len=64, block_size=4)

    build(smollm3([0, 0, 0, 0], drop=True))  # no positions anywhere: served
    with pytest.raises(UnsupportedModelError, match=rf"^smollm3: {DROPS}"):
        build(smollm3([0, 0, 0, 1], drop=True))
