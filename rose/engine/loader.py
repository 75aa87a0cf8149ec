"""Resolve `model`, `tokenizer`, `device` and `dtype` arguments into a ready model and tokenizer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rose.engine import presets

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any | None
    name: str
    device: torch.device
    dtype: torch.dtype


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(sorted(_DTYPES))}, got {dtype!r}")
    return _DTYPES[dtype]


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object, a preset name, a local directory or a hub id."""
    if tokenizer is None or not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    if presets.is_preset(tokenizer):
        return presets.build_tokenizer()
    return AutoTokenizer.from_pretrained(str(tokenizer))


def load(
    model: str | os.PathLike | PreTrainedModel,
    tokenizer: Any = None,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
) -> LoadedModel:
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if isinstance(model, PreTrainedModel):
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        tok = load_tokenizer(tokenizer)
    elif presets.is_preset(model):
        name = str(model)
        model, tok = presets.build_preset(name)
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer)
    elif isinstance(model, str | os.PathLike):
        name = str(model)
        if not os.path.isdir(name) and os.path.sep in name and not os.path.exists(name):
            raise ValueError(
                f"model {name!r} is neither a preset ({', '.join(presets.PRESET_NAMES)}) nor an existing directory"
            )
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
        tok = load_tokenizer(tokenizer if tokenizer is not None else name)
    else:
        raise TypeError(
            f"model must be a preset name, a path, a hub id or a PreTrainedModel, got {type(model)}"
        )
    model = model.to(device=dev, dtype=torch_dtype).eval()
    model.requires_grad_(False)
    logger.info("loaded model %s on %s (%s)", name, dev, str(torch_dtype).removeprefix("torch."))
    return LoadedModel(model=model, tokenizer=tok, name=name, device=dev, dtype=torch_dtype)
