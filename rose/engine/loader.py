"""Resolve `model`, `tokenizer`, `device` and `dtype` arguments into a ready model and tokenizer.

A model (or tokenizer) name resolves the same way in `load`, `build_model`, `model_config`, `model_tokenizer` and
`load_tokenizer` (`resolve_model`), in this order:

1. a preset (`presets.PRESET_NAMES`): random weights drawn from a seed, the presets' in-memory tokenizer;
2. an existing `.json` file: a config, random weights (the tokenizer next to it, else the presets');
3. an existing directory: a checkpoint (its config, weights and tokenizer);
4. a name that looks like a path (`./x`, `/x`, `~/x`, more than one `/`, a `.json` name, anything that is not a
   valid hub id) but does not exist: `ModelNotFoundError`, without trying the hub;
5. otherwise a hub id (`org/name`, or a bare `name`): the snapshot in the local Hugging Face cache when it holds the
   files the caller needs (config, weights, tokenizer), else (unless `HF_HUB_OFFLINE` / `TRANSFORMERS_OFFLINE`) the
   hub (`HF_ENDPOINT`) is asked once, with a timeout and no retries, and the files are downloaded into that cache.

A hub id thus becomes one local snapshot directory, and config, weights and tokenizer all load from it: they cannot
come from different commits and loading makes no further lookup. A cached snapshot is used as it is, without asking
the hub for a newer commit, so a worker starts the same with or without a network (`hf download org/name` refreshes
it). The cache directory (`HF_HUB_CACHE`, else `HF_HOME/hub`), the offline switch and the endpoint are read from the
environment at each call, not from `huggingface_hub.constants` (frozen when that module was imported). A name that
resolves to nothing raises `ModelNotFoundError` (a `ValueError`) naming the model, the presets, the cache directory
and, when the hub was asked, its answer.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id
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

Part = Literal["config", "weights", "tokenizer"]
_ALL_PARTS: tuple[Part, ...] = ("config", "weights", "tokenizer")
# What a hub snapshot must hold for each part, and what to download for it. Weights: the transformers names only
# (not `original/`, `consolidated*`, ONNX or GGUF copies that some repos also carry), safetensors when the repo has
# them, else PyTorch pickles. "*.json" brings the configs (model, generation, tokenizer, weight index) every time.
_CONFIG_PATTERNS = ["*.json", "*.py"]  # *.py: remote code, for trust_remote_code
_TOKENIZER_PATTERNS = ["tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken", "*.jinja"]
_SAFETENSORS, _PICKLES = "model*.safetensors", "pytorch_model*.bin"
_WEIGHTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)
_TRUE = {"1", "ON", "YES", "TRUE"}


class ModelNotFoundError(ValueError):
    """A model or tokenizer name that is no preset, no existing path, and no hub id found in the local Hugging Face
    cache or (online) on the hub."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any | None
    name: str
    device: torch.device
    dtype: torch.dtype


@dataclass(frozen=True)
class ModelSource:
    """What a name resolved to: a preset, a config file (random weights) or a checkpoint directory; `repo_id` is
    set when that directory is a hub id's local snapshot."""

    name: str
    kind: Literal["preset", "config", "checkpoint"]
    path: Path | None = None
    repo_id: str | None = None


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
    path = Path(model).expanduser()
    return path if path.suffix == ".json" and path.is_file() else None


# ---- hub ids and the local Hugging Face cache ------------------------------------------------------------------


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub computes it, but from the environment now: HF_HUB_CACHE, else
    HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (~/.cache by default)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache is None:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def _offline_switch() -> str | None:
    """What keeps the hub off, read now: HF_HUB_OFFLINE (else TRANSFORMERS_OFFLINE) as huggingface_hub reads them;
    when neither is set, huggingface_hub's own switch, which a program may have set in code. None: online."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if value := os.environ.get(var):
            return f"{var}={value}" if value.upper() in _TRUE else None
    return "huggingface_hub.constants.HF_HUB_OFFLINE" if hf_constants.HF_HUB_OFFLINE else None


def _hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or hf_constants.ENDPOINT).rstrip("/")


def _hub_timeout() -> float:
    # The hub's own request timeout: HfApi calls default to none (an unreachable host holds the connect for minutes)
    return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or hf_constants.DEFAULT_ETAG_TIMEOUT)


def is_hub_id(name: object) -> bool:
    """A string the hub accepts as a model id (`org/name` or `name`), which is not a `.json` file name."""
    if not isinstance(name, str) or name.endswith(".json"):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _has_weights(folder: Path) -> bool:
    for index, single in _WEIGHTS:
        if (folder / index).is_file():
            shards = set(json.loads((folder / index).read_text())["weight_map"].values())
            return all((folder / shard).is_file() for shard in shards)
        if (folder / single).is_file():
            return True
    return False


def _has_tokenizer(folder: Path) -> bool:
    return any(
        fnmatch.fnmatch(f.name, p) for f in folder.iterdir() if f.is_file() for p in _TOKENIZER_PATTERNS
    )


def _missing(folder: Path, parts: tuple[Part, ...]) -> list[str]:
    checks = {
        "config": lambda: (folder / "config.json").is_file(),
        "weights": lambda: _has_weights(folder),
        "tokenizer": lambda: _has_tokenizer(folder),
    }
    return [part for part in parts if not checks[part]()]


def _patterns(parts: tuple[Part, ...], repo_files: list[str]) -> list[str]:
    patterns = list(_CONFIG_PATTERNS)
    if "tokenizer" in parts:
        patterns += _TOKENIZER_PATTERNS
    if "weights" in parts:
        safetensors = any(fnmatch.fnmatch(f, _SAFETENSORS) for f in repo_files)
        patterns.append(_SAFETENSORS if safetensors else _PICKLES)
    return patterns


def _not_found(name: str, why: str) -> ModelNotFoundError:
    close = difflib.get_close_matches(name, presets.PRESET_NAMES, n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ModelNotFoundError(
        f"model {name!r} is not a preset ({', '.join(presets.PRESET_NAMES)}), not an existing path, and {why}{hint}"
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _cached_snapshot(repo_id: str, cache: Path) -> Path | None:
    """The snapshot of the default branch of `repo_id` in `cache`, or None; no network."""
    try:
        # allow_patterns=[]: whether the snapshot holds enough is for _missing to say, for the parts needed here,
        # not huggingface_hub (it would want every file in the repo's listing, ONNX and GGUF copies included)
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True, allow_patterns=[]))
    except LocalEntryNotFoundError:
        return None


def _from_hub(repo_id: str, parts: tuple[Part, ...]) -> Path:
    """The local snapshot directory of `repo_id` holding `parts`: the cached one, else one downloaded now."""
    cache = hub_cache_dir()
    where = f"in the local Hugging Face cache at {cache}"
    cached = _cached_snapshot(repo_id, cache)
    if cached is None:
        state = f"not {where}"
    elif missing := _missing(cached, parts):
        state = f"is {where} without its {' and '.join(missing)} (snapshot {cached.name})"
    else:
        logger.info("%s: snapshot %s from the local Hugging Face cache %s", repo_id, cached.name, cache)
        return cached
    if switch := _offline_switch():
        raise _not_found(repo_id, f"{state}; the hub was not tried ({switch})")

    endpoint = _hub_endpoint()
    try:  # one request with a timeout, no retries: whether the hub has the model, and which weight files
        info = HfApi(endpoint=endpoint).model_info(repo_id, timeout=_hub_timeout())
    except HfHubHTTPError as exc:  # 404, 401, gated, 5xx: the hub's own reason
        raise _not_found(repo_id, f"{state}; the hub at {endpoint} answered: {_one_line(exc)}") from exc
    except Exception as exc:  # connection refused, DNS, timeout, proxy: whatever the HTTP stack raises
        reason = f"{type(exc).__name__}: {_one_line(exc)}"
        raise _not_found(repo_id, f"{state}; the hub at {endpoint} could not be reached ({reason})") from exc
    patterns = _patterns(parts, [s.rfilename for s in info.siblings or []])
    logger.info("%s: downloading %s from %s into %s", repo_id, ", ".join(parts), endpoint, cache)
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                cache_dir=cache,
                endpoint=endpoint,
                allow_patterns=patterns,
                etag_timeout=_hub_timeout(),
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:  # e.g. a gated repo: metadata public, files not
        raise ModelNotFoundError(
            f"model {repo_id!r}: downloading it from the hub at {endpoint} failed: {_one_line(exc)}"
        ) from exc
    if missing := _missing(folder, parts):
        raise ModelNotFoundError(
            f"model {repo_id!r} on the hub at {endpoint} has no {' and '.join(missing)} files that transformers "
            f"loads (downloaded into {folder})"
        )
    return folder


def resolve_model(model: str | os.PathLike, parts: tuple[Part, ...] = _ALL_PARTS) -> ModelSource:
    """Where `model` comes from (see the module docstring); a hub id's snapshot must hold `parts`."""
    name = os.fspath(model)
    if presets.is_preset(name):
        return ModelSource(name, "preset")
    path = Path(name).expanduser()
    if path.suffix == ".json" and path.is_file():
        return ModelSource(name, "config", path)
    if path.is_dir():
        return ModelSource(name, "checkpoint", path)
    if isinstance(model, str) and not path.exists() and is_hub_id(name):
        return ModelSource(name, "checkpoint", _from_hub(name, parts), repo_id=name)
    raise ModelNotFoundError(
        f"model {name!r} is neither a preset ({', '.join(presets.PRESET_NAMES)}), a config file nor an existing "
        "directory"
    )


# ---- configs, tokenizers, models -------------------------------------------------------------------------------


def _tokenizer_of(source: ModelSource) -> Any:
    if source.kind == "preset":
        return presets.build_tokenizer()
    assert source.path is not None
    if source.kind == "checkpoint":
        return AutoTokenizer.from_pretrained(str(source.path))
    own = source.path.parent  # a config's: the tokenizer saved next to it, else the presets'
    if any((own / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(str(own))
    return presets.build_tokenizer()


def model_config(model: str | os.PathLike) -> PretrainedConfig:
    """The config of a preset, a config file, a checkpoint directory or a hub id, without its weights."""
    source = resolve_model(model, ("config",))
    if source.kind == "preset":
        return presets.preset_config(source.name)
    return AutoConfig.from_pretrained(str(source.path))


def model_tokenizer(model: str | os.PathLike) -> Any:
    """The tokenizer that goes with `model`: a preset's, or a config file's, is the presets' in-memory one (unless
    the config's directory holds a tokenizer); a checkpoint's (or hub id's) is its own."""
    return _tokenizer_of(resolve_model(model, ("tokenizer",)))


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object (returned as is), or a name resolved as `model_tokenizer` resolves a model."""
    if tokenizer is None or not isinstance(tokenizer, str | os.PathLike):
        return tokenizer
    return model_tokenizer(tokenizer)


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
    `tokenizer` if given, else `model_tokenizer(model)`, from the same snapshot as the weights."""
    source = resolve_model(model, _ALL_PARTS if tokenizer is None else ("config", "weights"))
    if source.kind == "preset":
        built = presets.preset_model(source.name, seed=seed, device=device)
    elif source.kind == "config":
        logger.info("%s: random weights (seed %d)", source.path, seed)
        built = presets.model_from_config(
            AutoConfig.from_pretrained(str(source.path)), seed=seed, device=device
        )
    else:
        built = AutoModelForCausalLM.from_pretrained(
            str(source.path), dtype=dtype, trust_remote_code=trust_remote_code
        )
    tok = load_tokenizer(tokenizer) if tokenizer is not None else _tokenizer_of(source)
    return built, tok


def _wraps_pretrained(model: Any) -> bool:
    """A module that wraps a PreTrainedModel as PEFT's `PeftModel` does (`get_base_model()`, its attributes those of
    the model): served like the model, by what its forward hands the model (rose.engine.model_probe)."""
    base = getattr(model, "get_base_model", None) if isinstance(model, torch.nn.Module) else None
    return callable(base) and isinstance(base(), PreTrainedModel)


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
    if isinstance(model, PreTrainedModel) or _wraps_pretrained(model):
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        tok = load_tokenizer(tokenizer)
    elif isinstance(model, str | os.PathLike):
        name = str(model)
        model, tok = build_model(model, tokenizer, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    else:
        raise TypeError(
            "model must be a preset name, a config file, a path, a hub id or a PreTrainedModel (or a PEFT model "
            f"wrapping one), got {type(model)}"
        )
    model = model.to(device=dev, dtype=torch_dtype).eval()
    model.requires_grad_(False)
    logger.info("loaded model %s on %s (%s)", name, dev, str(torch_dtype).removeprefix("torch."))
    return LoadedModel(model=model, tokenizer=tok, name=name, device=dev, dtype=torch_dtype)
