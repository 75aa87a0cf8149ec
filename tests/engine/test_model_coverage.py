"""Every causal-LM architecture of the installed transformers, built tiny (rose.bench.architectures): rose gives
exactly `generate`'s greedy tokens in every engine mode (all prompts batched; chunked prefill of two sequences at a
time with prefix caching; each with either decode backend; a pool so small that sequences are preempted and
recomputed), or refuses the model at construction with its type and the reason
(rose.bench.coverage; `rose bench coverage` prints the same sweep as a table).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch

from rose.bench.architectures import build_failure, causal_lm_types, prompt_id_range, tiny_model
from rose.bench.coverage import MODES, Target, Verdict, check_model
from rose.engine import model_probe

TYPES = causal_lm_types()

# what the issue names, and what each must be
MUST_BE_EXACT = {
    "mistral": "sliding window from the config",
    "mixtral": "sliding window from the config",
    "phi3": "sliding window from the config",
    "starcoder2": "sliding window from the config",
    "qwen2": "per-layer windows (max_window_layers)",
    "exaone4": "per-layer windows (layer_types)",
    "gemma3_text": "per-layer windows (layer_types)",
    "cohere2": "per-layer windows (layer_types)",
    "gemma2": "soft-capping and per-layer windows",
    "gpt_oss": "attention sinks",
    "granite_swa": "attention sinks",
    "llama4_text": "chunked attention",
    "deepseek_v3": "K and V of different head dims (MLA)",
    "jetmoe": "K and V of different head dims",
    "gemma4_text": "per-layer head dims and KV heads",
    "stablelm": "decoder layers that drop **kwargs",
    "diffllama": "two attention calls per layer",
    "mllama": "a cross-attention layer that text-only forwards skip",
    "llama": "the plain case",
    "gpt2": "learned positions",
}
MUST_BE_REFUSED = {
    "falcon": "its attention does not use transformers' AttentionInterface",
    "bloom": "its attention does not use transformers' AttentionInterface",
    "mpt": "its attention does not use transformers' AttentionInterface",
    "gpt_neo": "its attention does not use transformers' AttentionInterface",
    "xglm": "its attention does not use transformers' AttentionInterface",
    "openai-gpt": "its attention does not use transformers' AttentionInterface",
    "mamba": "state-space layers keep a recurrent state",
    "rwkv": "recurrent layers keep a state",
    "jamba": "state-space layers keep a recurrent state",
    "bamba": "state-space layers keep a recurrent state",
    "qwen3_next": "state-space layers keep a recurrent state",
    "nemotron_h": "state-space layers keep a recurrent state",
    "recurrent_gemma": "state-space layers keep a recurrent state",
    "lfm2": "convolution layers keep a rolling state",
    "deepseek_v32": "sparse indexed attention",
    "bart": "its forward takes no position_ids",
    "trocr": "its attention does not use transformers' AttentionInterface",
}


@functools.cache
def verdict(model_type: str) -> Verdict:
    torch.manual_seed(0)
    return check_model(model_type, lambda: tiny_model(model_type), id_range=prompt_id_range())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", TYPES)
def test_exact_in_every_mode_or_refused_with_the_reason(model_type):
    if build_failure(model_type) is not None:  # the zoo cannot build it tiny: its reason is on record
        assert verdict(model_type).status == "skipped"
        return
    v = verdict(model_type)
    assert v.status in ("exact", "refused"), f"{model_type}: {v.status}: {v.detail}"
    if v.status == "refused":
        name, _, reason = v.detail.partition(": ")
        assert name.startswith(model_type) and reason, v.detail
        return
    assert set(v.modes) == set(MODES)
    assert all(m.status == "exact" and m.ties == 0 for m in v.modes.values()), v.modes
    assert v.modes["chunked"].prefix_hits > 0 and v.modes["chunked_sdpa"].prefix_hits > 0, (
        "no cached prefix reused"
    )
    preempt = v.modes["preempt"]
    assert preempt.preemptions > 0 or preempt.windowed, "the tight pool preempted nothing"


def test_the_named_families():
    for model_type, why in MUST_BE_EXACT.items():
        assert verdict(model_type).status == "exact", f"{model_type} ({why}): {verdict(model_type).detail}"
    for model_type, reason in MUST_BE_REFUSED.items():
        v = verdict(model_type)
        assert v.status == "refused" and reason in v.detail, f"{model_type}: {v.status}: {v.detail}"


def test_at_least_forty_architectures_are_exact():
    exact = [t for t in TYPES if build_failure(t) is None and verdict(t).status == "exact"]
    assert len(exact) >= 40, exact


@pytest.mark.parametrize(
    ("model_type", "strip"),
    [
        ("mistral", {"window": None}),
        ("gemma3_text", {"window": None}),
        ("llama4_text", {"chunk": None}),
        ("gemma2", {"softcap": None}),
        ("gpt_oss", {"sinks": False}),
    ],
)
def test_the_sweep_catches_a_feature_the_engine_would_ignore(model_type, strip, monkeypatch):
    """Guards the sweep: the tiny models exercise each feature, so an engine that ignored it would be `wrong`."""
    probe = model_probe.probe

    def ignoring(model):
        layers = probe(model)
        layers.specs = [dataclasses.replace(s, **strip) for s in layers.specs]
        return layers

    monkeypatch.setattr(model_probe, "probe", ignoring)
    v = check_model(model_type, lambda: tiny_model(model_type), ("batched",), id_range=prompt_id_range())
    assert v.status == "wrong", v.detail


def test_the_readme_lists_each_family_under_its_verdict():
    """README's "Supported models" is the sweep's table: each type under the verdict it gets."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Supported models")[1].split("\n### ")[0]
    bullets = section.split("\n- ")[1:]
    listed: dict[str, set[str]] = {"exact": set(), "refused": set(), "skipped": set()}
    for bullet in bullets:
        kind = (
            "exact"
            if bullet.startswith("**Exact**")
            else "skipped"
            if bullet.startswith("Not buildable")
            else "refused"
        )
        listed[kind] |= set(re.findall(r"`([\w.-]+)`", bullet)) & set(TYPES)
    for kind, names in listed.items():
        assert names == {t for t in TYPES if verdict(t).status == kind}, kind


@pytest.mark.parametrize(
    "model_type", ["gpt_oss", "granite_swa", "flint", "gemma2", "vaultgemma", "mimo_v2_flash"]
)
def test_eager_families_round_as_transformers_does_in_bfloat16(model_type):
    """Layers SDPA cannot compute (soft-capping, sinks), and every layer of a model that came with eager attention,
    run the model's own eager function: bf16 rounds exactly as `generate`'s does (each of these families takes its
    softmax in its own precision), with no tie allowed."""
    target = Target("cpu", "bfloat16", 0.0)
    v = check_model(model_type, lambda: tiny_model(model_type), id_range=prompt_id_range(), target=target)
    assert v.status == "exact", v.detail
