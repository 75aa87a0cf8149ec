"""The worker's LoRA adapters (`--enable-lora`, `--lora-modules NAME=PATH ...`): which adapter a job's `lora` field
names, and what each adapter did (tokens generated, and the engine's loads and evictions, on /metrics and in the
info hash).

`lora_requests(settings)` gives each adapter its vLLM `LoRARequest`, ids 1, 2, ... in the order given; rose.worker.cli
registers them all with the engine at start (a bad one stops the worker). `Adapters.request_for(name)` is what the job
loop hands `add_request`: None for the base model, else the adapter's request; a name the worker does not serve, or
any name on a worker without --enable-lora, raises ValueError, which fails that job alone without retry (the other
jobs of the batch go on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from rose.engine.lora import LoRARequest

if TYPE_CHECKING:
    from rose.config import WorkerSettings
    from rose.worker.metrics import WorkerMetrics


def lora_requests(settings: WorkerSettings) -> dict[str, LoRARequest]:
    """Each --lora-modules adapter's LoRARequest, by name: ids 1, 2, ... in the order given (a leading ~ expanded:
    the shell leaves `name=~/dir` as it is)."""
    return {
        name: LoRARequest(name, i, os.path.expanduser(path))
        for i, (name, path) in enumerate(settings.lora_modules.items(), start=1)
    }


class Adapters:
    """The adapters a worker serves, and their counters. `metrics`: the worker's (its registry, its model label);
    it reads the engine's `lora_loads` / `lora_evictions` through `read_stats` with its other counters."""

    def __init__(self, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self.enabled = settings.enable_lora
        self.requests = lora_requests(settings)
        self.tokens: dict[str, int] = dict.fromkeys(self.requests, 0)  # generated, by adapter
        self.loads: dict[str, int] = dict.fromkeys(self.requests, 0)  # the engine's counters, as last read
        self.evictions: dict[str, int] = dict.fromkeys(self.requests, 0)
        self._tokens: dict[str, Any] = {}
        if not self.enabled:
            return
        reg, ln, model = metrics.registry, ["model_name"], metrics.model
        tokens = Counter(
            "rose_lora_generation_tokens",
            "Tokens generated with each LoRA adapter (every job, finished or not).",
            [*ln, "adapter"],
            registry=reg,
        )
        loads = Counter(
            "rose_lora_loads",
            "Each LoRA adapter's loads into a slot (--max-loras slots: an adapter no running job uses gives its "
            "slot up).",
            [*ln, "adapter"],
            registry=reg,
        )
        evictions = Counter(
            "rose_lora_evictions",
            "Each LoRA adapter's evictions from its slot for another adapter.",
            [*ln, "adapter"],
            registry=reg,
        )
        self._tokens = {name: tokens.labels(model, name) for name in self.requests}
        self._loads = {name: loads.labels(model, name) for name in self.requests}
        self._evictions = {name: evictions.labels(model, name) for name in self.requests}
        metrics.lora = self

    def request_for(self, name: str | None) -> LoRARequest | None:
        """The LoRARequest of a job's `lora` (None: the base model); ValueError for an adapter not served here."""
        if name is None:
            return None
        if not self.enabled:
            raise ValueError(
                f"this job asks for LoRA adapter {name!r}, but this worker serves no adapters: start rose-worker "
                f"with --enable-lora --lora-modules {name}=PATH (ROSE_ENABLE_LORA=1, ROSE_LORA_MODULES), or leave "
                "'lora' out to use the base model"
            )
        request = self.requests.get(name)
        if request is None:
            served = ", ".join(self.requests) or "none (no --lora-modules)"
            raise ValueError(f"unknown LoRA adapter {name!r}: this worker serves {served}")
        return request

    def on_tokens(self, name: str, n: int) -> None:
        """`n` tokens generated with adapter `name` (one of ours: a job naming another never runs)."""
        self.tokens[name] += n
        self._tokens[name].inc(n)

    def read_stats(self, stats: Mapping[str, float]) -> None:
        """The engine's cumulative `lora_loads/NAME` / `lora_evictions/NAME` (rose.engine.engine.Engine.get_stats)."""
        for seen, counters, key in (
            (self.loads, self._loads, "lora_loads"),
            (self.evictions, self._evictions, "lora_evictions"),
        ):
            for name, counter in counters.items():
                now = int(stats.get(f"{key}/{name}", 0))
                if now > seen[name]:
                    counter.inc(now - seen[name])
                    seen[name] = now

    def info(self) -> dict[str, Any]:
        """The info hash's fields (`rose status`): nothing without --enable-lora."""
        if not self.enabled:
            return {}
        return {
            # adapter -> count, in --lora-modules order
            "lora_tokens": json.dumps(self.tokens),
            "lora_loads": json.dumps(self.loads),
            "lora_evictions": json.dumps(self.evictions),
        }
