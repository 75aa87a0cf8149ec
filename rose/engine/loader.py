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


# Files whose presence makes a directory a checkpoint (weights), not a bare config.
_WEIGHT_GLOBS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)


def random_weights_config(model: object) -> Path | None:
    """The config file to build a random-weight model from, when `model` names a JSON config file or a directory
    that holds a `config.json` but no weights; None otherwise (a preset, a checkpoint, a hub id)."""
    if not isinstance(model, str | os.PathLike) or presets.is_preset(model):
        return None
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        return path
    has_weights = path.is_dir() and any(next(path.glob(pattern), None) for pattern in _WEIGHT_GLOBS)
    if path.is_dir() and (path / "config.json").is_file() and not has_weights:
        return path / "config.json"
    return None


def model_config(model: str | os.PathLike) -> PretrainedConfig:
    """The config of a preset, a config file, a checkpoint directory or a hub id, without its weights."""
    if presets.is_preset(model):
        return presets.preset_config(str(model))
    config_file = random_weights_config(model)
    return AutoConfig.from_pretrained(str(config_file if config_file is not None else model))


def build_model(
    model: str | os.PathLike,
    tokenizer: Any = None,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, Any]:
    """(model, tokenizer) from a preset or a config (random weights drawn with `seed` in float32 on `device`: None
    for the CPU), or a checkpoint directory / hub id (its weights in `dtype`, on the CPU). Without `tokenizer`: the
    checkpoint's or the config directory's own, else the presets' in-memory one (ids past its 8,192 decode to "")."""
    config_file = random_weights_config(model)
    if presets.is_preset(model):
        built, tok = presets.build_preset(str(model), seed=seed, device=device)
    elif config_file is not None:
        built = presets.model_from_config(
            AutoConfig.from_pretrained(str(config_file)), seed=seed, device=device
        )
        own = config_file.parent
        has_tokenizer = any((own / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        tok = load_tokenizer(str(own)) if has_tokenizer else presets.build_tokenizer()
    else:
        name = str(model)
        if not os.path.isdir(name) and os.path.sep in name and not os.path.exists(name):
            raise ValueError(
                f"model {name!r} is neither a preset ({', '.join(presets.PRESET_NAMES)}), a config file nor an "
                "existing directory"
            )
        built = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code)
        tok = load_tokenizer(name)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
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
