"""Shared pieces of the benchmarks: run results, token accounting, environment description, model loading."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rose.bench.workload import Workload


@dataclass
class RunResult:
    """One system's timed pass over a workload.

    `generated_tokens` counts, per request, at most the tokens it asked for (static batching generates up to the
    longest request of its batch; the surplus is not credited). `token_counts_ok` says every request got exactly
    `max_tokens` tokens, as it must with ignore_eos.
    """

    name: str
    num_requests: int
    prompt_tokens: int
    requested_tokens: int
    generated_tokens: int
    wall_s: float
    token_counts_ok: bool
    settings: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["requests_per_s"] = self.requests_per_s
        out["generated_tokens_per_s"] = self.tokens_per_s
        return out


def count_tokens(workload: Workload, outputs: dict[str, list[int]]) -> tuple[int, bool, list[str]]:
    """Credited tokens (each request's output truncated to its max_tokens), whether every request got exactly its
    max_tokens, and the ids of the requests that did not."""
    credited = 0
    short: list[str] = []
    for req in workload.requests:
        got = outputs.get(req.request_id)
        n = 0 if got is None else min(len(got), req.max_tokens)
        credited += n
        if got is None or len(got) < req.max_tokens:
            short.append(req.request_id)
    return credited, not short, short


def make_result(
    name: str,
    workload: Workload,
    outputs: dict[str, list[int]],
    wall_s: float,
    settings: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> RunResult:
    credited, ok, short = count_tokens(workload, outputs)
    extra = dict(extra or {})
    if short:
        extra["short_requests"] = short[:20]
    return RunResult(
        name=name,
        num_requests=len(workload),
        prompt_tokens=workload.prompt_tokens,
        requested_tokens=workload.requested_tokens,
        generated_tokens=credited,
        wall_s=wall_s,
        token_counts_ok=ok,
        settings=dict(settings or {}),
        extra=extra,
    )


def set_threads(num_threads: int | None) -> int:
    """Apply `num_threads` (None: leave torch's choice) and return what torch will use."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def environment() -> dict[str, Any]:
    import transformers

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
    }


def load_model(preset: str, seed: int = 0, attn_implementation: str | None = "sdpa"):
    """A fresh copy of a preset model (same weights for the same seed) and its tokenizer. Each system gets its own
    copy, so one system switching attention implementations cannot affect another."""
    from rose.engine.presets import build_preset

    model, tokenizer = build_preset(preset, seed=seed)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    model.eval()
    return model, tokenizer
