"""Random PEFT LoRA adapters for tests and benchmarks (rose.engine.lora serves them): written as PEFT's
`save_pretrained` writes them, A and B drawn at random (PEFT's default B of zeros would change nothing) and B scaled
up so that the adapter changes a random model's greedy tokens. Needs `peft` (the test extras)."""

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
