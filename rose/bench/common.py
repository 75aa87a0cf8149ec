"""Shared pieces of the benchmarks: run results, token accounting, environment description, model loading."""

from __future__ import annotations

import gc
import os
import platform
import time
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
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)  # generated ids; not in to_dict()

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("outputs")
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
        outputs=outputs,
    )


def cpu_busy_fraction(interval_s: float = 0.5) -> float | None:
    """Share of all CPUs' time that *other* processes kept busy over `interval_s` (Linux /proc/stat minus this
    process's own CPU time; None elsewhere). Sampled before a timed pass, it says whether someone else was
    competing for the cores the benchmark is about to use."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        own0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(interval_s)
        total1, idle1 = sample()
        own1, wall1 = time.process_time(), time.perf_counter()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    if total <= 0:
        return None
    busy = 1.0 - (idle1 - idle0) / total
    own = (own1 - own0) / ((wall1 - wall0) * (os.cpu_count() or 1))
    return round(min(max(busy - own, 0.0), 1.0), 3)


def wait_for_idle(max_wait_s: float, threshold: float = 0.15, interval_s: float = 1.0) -> float | None:
    """Wait (up to `max_wait_s`) until other processes keep less than `threshold` of the CPUs busy; returns the last
    busy share seen. For shared machines: a pass timed while another job runs measures that job too."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy_fraction(interval_s)
    while busy is not None and busy >= threshold and time.monotonic() < deadline:
        busy = cpu_busy_fraction(interval_s)
    return busy


def sync(device: torch.device) -> None:
    """Wait for the device's queued work before reading a clock (CUDA launches are asynchronous); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(num_threads: int | None) -> int:
    """Apply `num_threads` (None: leave torch's choice) and return what torch will use."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def resolve_target(device: str | torch.device, dtype: str | torch.dtype) -> tuple[torch.device, torch.dtype]:
    """The benchmarks' `--device` / `--dtype` as the engine resolves them ('auto': CUDA when available; bfloat16 on
    CUDA, float32 on CPU). Raises ValueError for CUDA on a machine without it."""
    from rose.engine.loader import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:  # one index, so every system lands on the same GPU
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev, resolve_dtype(dtype, dev)


def environment(device: torch.device | None = None, dtype: torch.dtype | None = None) -> dict[str, Any]:
    import transformers

    dev = device if device is not None else torch.device("cpu")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "device": str(dev),
        "dtype": str(dtype if dtype is not None else torch.float32).removeprefix("torch."),
        "gpu_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "cuda": torch.version.cuda if dev.type == "cuda" else None,
    }


def prompt_vocab_size(model: str) -> int:
    """Ids a benchmark prompt may use: the model's vocabulary, cut to the tokenizer's size where the tokenizer is
    smaller (`qwen2.5-0.5b`, a config without its tokenizer), so every system, rose with its tokenizer included,
    accepts the same prompts."""
    from rose.engine import loader

    vocab = int(loader.model_config(model).get_text_config().vocab_size)
    return min(vocab, len(loader.model_tokenizer(model)))


def load_model(
    model: str,
    seed: int = 0,
    attn_implementation: str | None = "sdpa",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
):
    """A fresh copy of the model (a preset or a config: random weights, the same for the same seed and device type;
    or a checkpoint directory) and its tokenizer, on `device` in `dtype`. Each system gets its own copy, so one
    system switching attention implementations cannot affect another. Random weights are drawn in float32 on the
    device itself, then cast."""
    from rose.engine.loader import build_model

    dev, torch_dtype = resolve_target(device, dtype)
    model, tokenizer = build_model(
        model, seed=seed, device=None if dev.type == "cpu" else dev, dtype=torch_dtype
    )
    model = model.to(device=dev, dtype=torch_dtype)
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    model.eval()
    return model, tokenizer


def small_llama(vocab_size: int, seed: int = 0, **config: Any):
    """The benchmarks' "small" model: a Llama of hidden 512, 4 layers (random float32 weights, eval mode) over a
    vocabulary of `vocab_size`; `config` overrides or adds LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rose.engine.presets import model_from_config

    shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8)
    shape.update(num_key_value_heads=4, max_position_embeddings=1024)
    return model_from_config(
        LlamaConfig(vocab_size=vocab_size, **{**shape, **config}), LlamaForCausalLM, seed
    ).eval()


def release_memory(device: torch.device) -> None:
    """Between systems on a GPU: return the last system's cached blocks, so the next one sizes its cache from what
    is really free (a no-op on CPU, where the figures were taken without it)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
