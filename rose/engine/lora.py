"""LoRA adapters served together in one batch (vLLM's `enable_lora`, the S-LoRA / Punica idea in torch).

A `LoRARequest` (vLLM's: `lora_name`, `lora_int_id`, `lora_path`) names a PEFT adapter directory
(`adapter_config.json` + `adapter_model.safetensors`), or a hub id whose snapshot is in the local Hugging Face
cache. The `LoRAManager` owns everything about adapters:

- `register(request)` reads an adapter from disk once (CPU tensors), checks it against the base model (every
  targeted module a linear layer of the right shapes, rank <= `max_lora_rank`, only what plain LoRA computes: no
  DoRA, biases, `modules_to_save`, ...) and raises `LoRAError` naming the problem;
- `max_loras` slots hold the adapters resident on the model's device. `acquire(name)` gives a running sequence its
  adapter's slot (loading the adapter into the least recently used free slot), `release(name)` gives it back; an
  adapter stays resident while any sequence runs with it, so a slot is taken only when none runs with it;
- at construction, every linear layer that runs on all of a forward's tokens (one traced forward says which: not the
  LM head, not mixture-of-experts experts that see a subset) is wrapped (`LoRALinear`) with its slots' buffers, so
  they are allocated before the KV store takes the device's free memory: the base layer's output plus each token's
  delta through its adapter's A then B, times the adapter's scaling, as PEFT computes `lora_B(lora_A(x)) *
  scaling` (rose.engine.lora_layers). One forward serves a batch that mixes adapters and the base model, never a
  forward per adapter; a layer no adapter of the step targets costs nothing more.

The model runner sets the step's token → slot mapping (`begin_step`) around its forward, with each adapter's decode
rows and prefill chunks together (its tokens then make a few runs of consecutive rows: `kernel` "runs").
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors.torch import load_file
from torch import nn

from rose.engine import loader
from rose.engine.config import EngineConfig
from rose.engine.lora_layers import (
    KERNELS,
    LoRALinear,
    Siblings,
    StepMapping,
    masked_mapping,
    padded_runs,
    step_runs,
    token_linears,
)

log = logging.getLogger(__name__)

_PREFIX = "base_model.model."
# PEFT LoraConfig fields that change what an adapter computes, which rose does not implement: refused when set
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "modules_to_save (full copies of modules)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out weights",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}


class LoRAError(ValueError):
    """An adapter that cannot be served: unknown, unreadable, or not fitting the base model."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, a positive integer id unique to it, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise LoRAError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter read from disk: per targeted module (its path in the base model), A [r, in] and B [out, r]."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def adapter_dir(path: str, where: str) -> Path:
    """`path` itself, or for a hub id that is no directory here, its snapshot in the local Hugging Face cache (never
    the network: a worker starts the same with or without one); LoRAError when it is neither."""
    local = Path(path).expanduser()
    if local.is_dir() or not loader.is_hub_id(path):
        return local
    cache = loader.hub_cache_dir()
    try:
        return Path(snapshot_download(path, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        raise LoRAError(
            f"{where}: not a directory, and not in the local Hugging Face cache at {cache} (rose does not download "
            f"adapters: `hf download {path}` does)"
        ) from None


def read_adapter(
    request: LoRARequest, model: nn.Module, max_lora_rank: int, unservable: dict[str, str] | None = None
) -> LoRAAdapter:
    """The adapter at `request.lora_path`, checked against `model` (its linear layers, or the LoRALinear layers
    that wrap them); LoRAError naming what does not fit. `unservable`: linear layers that cannot take an adapter,
    with the reason."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    path = adapter_dir(request.lora_path, where)
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        tensors = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise LoRAError(
            f"{where}: cannot read adapter_config.json and adapter_model.safetensors: {exc}"
        ) from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAError(f"{where}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias {config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoRAError(f"{where}: adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    if rank > max_lora_rank:
        raise LoRAError(f"{where}: rank {rank} is above max_lora_rank {max_lora_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = dict(model.named_modules())
    head = next((n for n, m in modules.items() if m is model.get_output_embeddings()), None)
    on_head = [k for k in tensors if head is not None and k.removeprefix(_PREFIX).startswith(head + ".")]
    if on_head:  # the runner computes the LM head's output for the sampled rows only
        raise LoRAError(f"{where}: adapters of the LM head ({head}) are not supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise LoRAError(
                f"{where}: unexpected tensor {key!r} (only lora_A / lora_B weights are supported)"
            )
        pairs.setdefault(name, {})[part[0]] = tensor
    weights = {}
    for name, pair in pairs.items():
        if unservable and name in unservable:
            raise LoRAError(f"{where}: {name} {unservable[name]}")
        module = modules.get(name)
        base = module.base if isinstance(module, LoRALinear) else module
        if not isinstance(base, nn.Linear):
            raise LoRAError(f"{where}: the base model has no linear layer {name!r}")
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise LoRAError(f"{where}: {name} lacks its lora_{'A' if a is None else 'B'} weight")
        if tuple(a.shape) != (rank, base.in_features) or tuple(b.shape) != (base.out_features, rank):
            raise LoRAError(
                f"{where}: {name}'s lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit its "
                f"{base.in_features} -> {base.out_features} layer at rank {rank}"
            )
        weights[name] = (a, b)
    if not weights:
        raise LoRAError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(request, rank, scaling, weights)


class LoRAManager:
    """The adapters of one engine (this module's docstring): registered, resident in `max_loras` slots, and the
    wrapped layers with the step's token -> slot mapping."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_lora_rank: int, kernel: str | None = None
    ) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_lora_rank}")
        if any(isinstance(m, LoRALinear) for m in model.modules()):
            raise ValueError(
                "this model's layers already carry another engine's LoRA adapters: build the engine from a fresh "
                "copy of the model"
            )
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.step = StepMapping()
        self._adapters: dict[str, LoRAAdapter] = {}  # registered (read from disk), by name
        self._slots: list[str | None] = [None] * max_loras  # the adapter resident in each slot
        self._users: dict[str, int] = {}  # resident adapter -> sequences running with it
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unused, least recently used first
        self._scaling = [0.0] * max_loras  # the resident adapter's, by slot
        self._rank = [0] * max_loras
        # LoRALinear's forms: "runs" (each token's own adapter's arithmetic; the faster on CPU, and on an H200 as
        # fast or faster in two alternating pairs: benchmarks/README.md) or "masked" (every present slot's columns)
        self.kernel = kernel or "runs"
        served, self._unservable, siblings = token_linears(model)
        self._layers: dict[str, LoRALinear] = {}  # by module path
        self._siblings: list[Siblings] = []
        try:
            for name in served:
                self._layers[name] = self._wrap(name)
            self._siblings = [Siblings([self._layers[name] for name in names]) for names in siblings]
        except BaseException:  # e.g. out of memory for the slots: the model as it was
            self.unwrap()
            raise
        self.loads: Counter[str] = Counter()  # by adapter: loaded into a slot
        self.evictions: Counter[str] = Counter()  # by adapter: evicted from its slot for another

    @property
    def adapters(self) -> list[str]:
        return list(self._adapters)

    def get_stats(self) -> dict[str, int]:
        """Loads and evictions: `lora_loads` / `lora_evictions` in all, `lora_loads/NAME` / `lora_evictions/NAME`
        by adapter."""
        stats = {"lora_loads": self.num_loads, "lora_evictions": self.num_evictions}
        for name in self._adapters:
            stats[f"lora_loads/{name}"] = self.loads[name]
            stats[f"lora_evictions/{name}"] = self.evictions[name]
        return stats

    @property
    def num_loads(self) -> int:
        return self.loads.total()

    @property
    def num_evictions(self) -> int:
        return self.evictions.total()

    def register(self, request: LoRARequest) -> LoRAAdapter:
        """Read `request`'s adapter once (the same name with another id or path is refused)."""
        known = self._adapters.get(request.lora_name)
        if known is not None:
            if known.request != request:
                raise LoRAError(
                    f"LoRA adapter {request.lora_name!r} is already registered as {known.request}; got {request}"
                )
            return known
        taken = [a for a in self._adapters.values() if a.request.lora_int_id == request.lora_int_id]
        if taken:
            raise LoRAError(
                f"lora_int_id {request.lora_int_id} already names adapter {taken[0].request.lora_name!r}"
            )
        adapter = read_adapter(request, self.model, self.max_lora_rank, self._unservable)
        self._adapters[request.lora_name] = adapter
        return adapter

    def slot_of(self, name: str) -> int:
        return self._slots.index(name)

    def can_acquire(self, name: str) -> bool:
        return name in self._users or None in self._slots or bool(self._idle)

    def acquire(self, name: str) -> int:
        """A slot holding adapter `name` for one more running sequence (loaded if not resident)."""
        if name in self._users:
            self._users[name] += 1
            self._idle.pop(name, None)
            return self._slots.index(name)
        if None in self._slots:
            slot = self._slots.index(None)
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self._slots.index(evicted)
            del self._users[evicted]
            self.evictions[evicted] += 1
        else:
            raise RuntimeError(f"no free LoRA slot for {name!r}: every one of {self.max_loras} is in use")
        self._slots[slot] = None  # until loaded: a load that raises leaves a free, empty slot
        try:
            self._load(slot, self._adapters[name])
        except BaseException:
            for layer in self._layers.values():
                layer.set_slot(slot, None)
            raise
        self._users[name] = 1
        return slot

    def release(self, name: str) -> None:
        self._users[name] -= 1
        if not self._users[name]:
            self._idle[name] = None  # stays resident until its slot is needed

    @property
    def kernel(self) -> str:
        """LoRALinear's form (rose.engine.lora_layers): "runs" or "masked"."""
        return self._kernel

    @kernel.setter
    def kernel(self, value: str) -> None:
        if value not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {value!r}")
        self._kernel = value

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def nbytes(self) -> int:
        """The slots' buffers, in every wrapped layer."""
        return sum(layer.nbytes for layer in self._layers.values()) + sum(s.nbytes for s in self._siblings)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, layer in self._layers.items():
            layer.set_slot(slot, adapter.weights.get(name))
        self._slots[slot] = adapter.request.lora_name
        self._scaling[slot] = adapter.scaling
        self._rank[slot] = adapter.rank
        self.loads[adapter.request.lora_name] += 1
        log.info("LoRA adapter %r loaded into slot %d", adapter.request.lora_name, slot)

    def unwrap(self) -> None:
        """Put the model's own linear layers back: an engine that failed to build leaves the caller's model as it
        was."""
        for name, layer in self._layers.items():
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, layer.base)
        self._layers = {}

    def _wrap(self, name: str) -> LoRALinear:
        parent_name, _, child = name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        layer = LoRALinear(getattr(parent, child), self.max_loras, self.max_lora_rank, self.step)
        setattr(parent, child, layer)
        return layer

    def begin_step(self, slots: list[int | None], lengths: list[int]) -> None:
        """The step's tokens: sequence i has `lengths[i]` consecutive tokens, with adapter slot `slots[i]` (None:
        the base model)."""
        step = self.step
        step.num_tokens = sum(lengths)
        step.runs = step_runs(slots, lengths, self._rank, self._scaling)
        step.slots = frozenset(run.slot for run in step.runs)
        step.drop = step.scaling = step.padded = None
        if not step.runs:
            return
        device = next(iter(self._layers.values())).lora_a.device
        if self.kernel == "runs":
            step.padded = padded_runs(step.runs, step.num_tokens, device)
        else:
            step.first, step.last, step.drop, step.scaling = masked_mapping(
                slots, lengths, self.max_lora_rank, self._scaling, device
            )

    def end_step(self) -> None:
        self.step.runs = []
        self.step.slots = frozenset()
        for siblings in self._siblings:
            siblings.clear()
        self.step.drop = self.step.scaling = self.step.padded = None


def lora_manager(model: nn.Module, config: EngineConfig) -> LoRAManager | None:
    """The engine's LoRAManager (None without `enable_lora`), its slots allocated and logged."""
    if not config.enable_lora:
        return None
    lora = LoRAManager(model, config.max_loras, config.max_lora_rank)
    log.info(
        "LoRA: %d slots of rank %d in %d linear layers (%.1f MiB)",
        config.max_loras,
        config.max_lora_rank,
        lora.num_layers,
        lora.nbytes / 2**20,
    )
    return lora
