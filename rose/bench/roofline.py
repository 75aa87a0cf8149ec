"""The memory-bandwidth floor of a decode step: the bytes it must read over the device's measured copy bandwidth.

A decode step of B sequences reads every weight once (one token per sequence: the matrix multiplies are
memory-bound at small B) and every cached K/V position of every sequence once. What is counted:

- weights: every parameter and buffer of the model, once per tensor (a LM head tied to the input embedding is one
  tensor, read whole by the LM head), except embedding tables (`nn.Embedding`) that are not the LM head: a step only
  gathers B of their rows (B × hidden elements, < 0.1 % of the total here), so they are left out. The buffers are
  the rotary frequency tables (a few hundred bytes).
- KV: B × mean context × the K and V bytes of one position over every attention layer as the engine stores them
  (each layer's KV heads × (K + V head dims) × element size, read off the model by rose.engine.model_probe), the
  context being the positions each sequence attends to, averaged over the timed steps.
- Not counted: activations, logits (B × vocab), the new token's K/V write, the sampler's reads.

floor = bytes / bandwidth, where bandwidth is the best of a few copies of one large buffer (bytes read + bytes
written per second, as STREAM's copy counts them; on CUDA between `torch.cuda.synchronize()` calls). A step can
only be as fast as the floor, so floor / measured is the fraction of the achievable memory bandwidth a step uses.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rose.bench.common import sync
from rose.engine.kv_cache import KVCache
from rose.engine.model_probe import probe

DEFAULT_COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 2**30}


@dataclass
class WeightBytes:
    """Bytes of model state one decode step reads (see the module docstring for what is counted)."""

    total: int
    parameters: int  # counted parameters
    buffers: int
    lm_head: int  # the output projection's weight (the embedding table when tied), included in `parameters`
    embeddings_not_counted: (
        int  # embedding tables only gathered from (input embedding when untied, positions)
    )
    tied_embeddings: bool


def decode_weight_bytes(model: torch.nn.Module) -> WeightBytes:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embed is not None and head_weight is not None and embed.weight is head_weight
    gathered = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.weight is not head_weight
    }
    params = skipped = 0
    seen: set[int] = set()
    for p in model.parameters():  # parameters() yields a tied tensor once; `seen` guards other sharing too
        if id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in gathered:
            skipped += p.nbytes
        else:
            params += p.nbytes
    buffers = sum(b.nbytes for b in model.buffers())  # buffers() yields a shared buffer once
    lm_head = head_weight.nbytes if head_weight is not None else 0
    return WeightBytes(params + buffers, params, buffers, lm_head, skipped, tied)


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """K and V of one position across all attention layers, as the engine stores them. Probes the model (on a real
    device), so a model rose cannot serve raises rose.engine.model_probe.UnsupportedModelError here already."""
    return KVCache.bytes_per_token(probe(model).specs, dtype)


def measure_copy_bandwidth(
    device: str | torch.device, nbytes: int | None = None, repeats: int = 5
) -> dict[str, float]:
    """Best of `repeats` copies of an `nbytes` buffer (default 256 MiB on CPU, 1 GiB on CUDA) after one untimed
    copy that faults the pages in; bandwidth = 2 × nbytes / seconds (read + written)."""
    dev = torch.device(device)
    n = nbytes if nbytes is not None else DEFAULT_COPY_BYTES.get(dev.type, DEFAULT_COPY_BYTES["cpu"])
    if n < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be >= 1, got {n} and {repeats}")
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return {
        "bytes_per_s": 2 * n / best,
        "copy_bytes": float(n),
        "best_copy_s": best,
        "repeats": float(repeats),
    }


@dataclass
class Roofline:
    bandwidth_bytes_per_s: float
    weights: WeightBytes
    kv_bytes_per_token: int
    copy: dict[str, float]

    @classmethod
    def measure(
        cls, model: torch.nn.Module, device: str | torch.device, copy_bytes: int | None = None
    ) -> Roofline:
        dtype = next(model.parameters()).dtype
        copy = measure_copy_bandwidth(device, copy_bytes)
        return cls(copy["bytes_per_s"], decode_weight_bytes(model), kv_bytes_per_token(model, dtype), copy)

    def kv_bytes(self, batch: int, mean_context: float) -> float:
        return batch * mean_context * self.kv_bytes_per_token

    def step_bytes(self, batch: int, mean_context: float) -> float:
        return self.weights.total + self.kv_bytes(batch, mean_context)

    def floor_ms(self, batch: int, mean_context: float) -> float:
        return self.step_bytes(batch, mean_context) / self.bandwidth_bytes_per_s * 1e3

    def to_dict(self) -> dict[str, Any]:
        return {
            "bandwidth_gb_s": self.bandwidth_bytes_per_s / 1e9,
            "weight_bytes": asdict(self.weights),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "copy": self.copy,
            "counted": "weights once (tied LM head once; embedding tables only gathered from are left out) "
            "+ batch x mean context x KV bytes per token; bandwidth = 2 x copy bytes / best copy time",
        }
