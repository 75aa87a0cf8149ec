"""Random PEFT LoRA adapters for tests and benchmarks (rose.engine.lora serves them): written as PEFT's
`save_pretrained` writes them, A and B drawn at random (PEFT's default B of zeros would change nothing) and B scaled
up so that the adapter changes a random model's greedy tokens; the reference a served adapter's tokens are checked
against (`peft_greedy`: transformers' `generate` on the PEFT model); and a model of another architecture to draw an
adapter that does not fit tiny-llama (`tiny_phi3`). Needs `peft` (the test extras)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_adapter(
    path: Path,
    targets: list[str],
    rank: int,
    seed: int,
    model: Any = "tiny-llama",
    alpha: float | None = None,
    **config: Any,
) -> str:
    """Write an adapter of `model` (a preset name or a built model, left unchanged) at `path`; returns its path.
    `alpha`: lora_alpha (default 2 * rank); `config`: more LoraConfig fields (e.g. use_rslora=True)."""
    import peft

    from rose.engine.presets import build_preset

    torch.manual_seed(seed)
    base = build_preset(model)[0] if isinstance(model, str) else model
    alpha = 2 * rank if alpha is None else alpha
    lora = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config
    )
    wrapped = peft.get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.mul_(20)
    wrapped.save_pretrained(str(path))
    wrapped.unload()  # PEFT wrapped `base`'s layers in place: give them back
    return str(path)


def tiny_phi3() -> Any:
    """A one-layer Phi-3 (random weights) as wide as tiny-llama: its o_proj has tiny-llama's shape, its fused
    qkv_proj and gate_up_proj are modules tiny-llama lacks. An adapter of it is one of another architecture."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=64,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Phi3ForCausalLM(config)


def peft_greedy(
    path: str | None, prompt_ids: list[int], max_new_tokens: int, model: str = "tiny-llama"
) -> list[int]:
    """transformers' greedy `generate` of exactly `max_new_tokens` tokens (EOS an ordinary token, as the engine's
    `ignore_eos` makes it) on preset `model` (float32) wrapped by PEFT with the adapter at `path` (None: the base model
    alone): what rose must give a request with that adapter (issue 27)."""
    import peft

    from rose.engine.presets import build_preset

    base = build_preset(model)[0]
    wrapped = base if path is None else peft.PeftModel.from_pretrained(base, path)
    input_ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = wrapped.eval().generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=[],
            pad_token_id=base.config.pad_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()
