"""rose.harness.lora_adapters: an adapter written from a built model leaves that model as it was (PEFT wraps its
layers in place while the adapter is drawn)."""

from __future__ import annotations

import json

import pytest
import torch

from rose.engine.presets import build_preset
from rose.harness.lora_adapters import make_adapter

pytest.importorskip("peft")


def test_an_adapter_of_a_built_model_leaves_the_model_unchanged(tmp_path):
    model = build_preset("tiny-llama")[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = make_adapter(tmp_path / "a", ["q_proj", "down_proj"], rank=4, seed=0, model=model)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (
        path == str(tmp_path / "a")
        and config["r"] == 4
        and set(config["target_modules"]) == {"q_proj", "down_proj"}
    )
