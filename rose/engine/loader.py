"""Resolve `model`, `tokenizer`, `device` and `dtype` arguments into a ready model and tokenizer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

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


def random_weights_config(model: object) -> Path | None:
    """The config file to build a random-weight model from, when `model` names a JSON file (a `config.json`); None
    otherwise (a preset, a checkpoint directory, a hub id). Only an explicit file: a checkpoint directory whose
    weights are missing must fail, not serve random weights."""
    if not isinstance(model, str | os.PathLike) or presets.is_preset(model):
        return None
    path = Path(model)
    return path if path.suffix == ".json" and path.is_file() else None


def _check_source(name: str) -> None:
    if not os.path.isdir(name) and os.path.sep in name and not os.path.exists(name):
        raise ValueError(
            f"model {name!r} is neither a preset ({', '.join(presets.PRESET_NAMES)}), a config file nor an "
            "existing directory"
        )


def model_config(model: str | os.PathLike) -> PretrainedConfig:
    """The config of a preset, a config file, a checkpoint directory or a hub id, without its weights."""
    if presets.is_preset(model):
        return presets.preset_config(str(model))
    config_file = random_weights_config(model)
    if config_file is None:
        _check_source(str(model))
    return AutoConfig.from_pretrained(str(config_file if config_file is not None else model))


def model_tokenizer(model: str | os.PathLike) -> Any:
    """The tokenizer that goes with `model`: a preset's, or a config file's, is the presets' in-memory one (unless
    the config's directory holds a tokenizer); a checkpoint's is its own."""
    if presets.is_preset(model):
        return presets.build_tokenizer()
    config_file = random_weights_config(model)
    if config_file is None:
        _check_source(str(model))
        return load_tokenizer(str(model))
    own = config_file.parent
    if any((own / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return load_tokenizer(str(own))
    return presets.build_tokenizer()


def build_model(
    model: str | os.PathLike,
    tokenizer: Any = None,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) from a preset or a config file (random weights drawn with `seed` in float32 on `device`:
    None for the CPU), or a checkpoint directory / hub id (its weights in `dtype`, on the CPU). The tokenizer:
    `tokenizer` if given, else `model_tokenizer(model)`."""
    config_file = random_weights_config(model)
    if presets.is_preset(model):
        built = presets.preset_model(str(model), seed=seed, device=device)
    elif config_file is not None:
        logger.info("%s: random weights (seed %d)", config_file, seed)
        built = presets.model_from_config(
            AutoConfig.from_pretrained(str(config_file)), seed=seed, device=device
        )
    else:
        _check_source(str(model))
        built = AutoModelForCausalLM.from_pretrained(
            str(model), dtype=dtype, trust_remote_code=trust_remote_code
        )
    tok = load_tokenizer(tokenizer) if tokenizer is not None else model_tokenizer(model)
    return built, tok


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
    elif isinstance(model, str | os.PathLike):
        name = str(model)
        model, tok = build_model(model, tokenizer, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    else:
        raise TypeError(
            f"model must be a preset name, a config file, a path, a hub id or a PreTrainedModel, got {type(model)}"
        )
    model = model.to(device=dev, dtype=torch_dtype).eval()
    model.requires_grad_(False)
    logger.info("loaded model %s on %s (%s)", name, dev, str(torch_dtype).removeprefix("torch."))
    return LoadedModel(model=model, tokenizer=tok, name=name, device=dev, dtype=torch_dtype)
