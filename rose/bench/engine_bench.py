"""rose's engine against transformers' static batching and transformers' continuous batching, in one process.

All systems get the same workload (same prompt token ids, same max_tokens, greedy, EOS ignored), their own fresh
copy of the same model (same weights, on the same `device` in the same `dtype`), are warmed up before timing, and
are credited only with the tokens each request asked for. With `repeats > 1` the systems run round-robin (A B C A B
C ...) so that a slow patch of a shared machine hits all of them alike; the summary keeps the median and the best
pass of each.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from rose.bench.baselines import (
    HFContinuousBatchingConfig,
    StaticBatchingConfig,
    run_hf_continuous_batching,
    run_static_batching,
)
from rose.bench.common import (
    RunResult,
    cpu_busy_fraction,
    environment,
    load_model,
    prompt_vocab_size,
    release_memory,
    resolve_target,
    set_threads,
    wait_for_idle,
)
from rose.bench.rose_runner import RoseConfig, run_rose
from rose.bench.workload import Workload, make_workload
from rose.engine.attention import sdpa_backends
from rose.engine.host_malloc import tune_malloc

logger = logging.getLogger(__name__)

ROSE, STATIC, HF_CB = "rose", "hf-static", "hf-continuous-batching"
SYSTEMS = (ROSE, STATIC, HF_CB)
TARGET_RATIO = 3.0
BUSY_WARNING = 0.25  # share of CPU time other processes took just before a pass: figures are suspect


@dataclass
class EngineBenchConfig:
    model: str = "tiny-llama"
    num_requests: int = 128
    prompt_len_range: tuple[int, int] = (16, 128)
    output_len_range: tuple[int, int] = (16, 128)
    seed: int = 0
    repeats: int = 1
    device: str = "cpu"  # 'auto': CUDA when available; every system runs there
    dtype: str = "float32"  # 'auto': bfloat16 on CUDA, float32 on CPU
    num_threads: int | None = None  # None: torch's default
    wait_idle_s: float = (
        0.0  # before each pass, wait up to this long for other processes to leave the CPUs idle
    )
    systems: tuple[str, ...] = SYSTEMS
    static: StaticBatchingConfig = field(default_factory=StaticBatchingConfig)
    hf_cb: HFContinuousBatchingConfig = field(default_factory=HFContinuousBatchingConfig)
    rose: RoseConfig = field(default_factory=RoseConfig)


@dataclass
class SystemSummary:
    name: str
    runs: list[RunResult]

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(r.tokens_per_s for r in self.runs)

    @property
    def best_tokens_per_s(self) -> float:
        return max(r.tokens_per_s for r in self.runs)

    @property
    def median_requests_per_s(self) -> float:
        return statistics.median(r.requests_per_s for r in self.runs)

    @property
    def median_wall_s(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def token_counts_ok(self) -> bool:
        return all(r.token_counts_ok for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "median_wall_s": self.median_wall_s,
            "median_requests_per_s": self.median_requests_per_s,
            "median_generated_tokens_per_s": self.median_tokens_per_s,
            "best_generated_tokens_per_s": self.best_tokens_per_s,
            "token_counts_ok": self.token_counts_ok,
            "runs": [r.to_dict() for r in self.runs],
        }


@dataclass
class EngineBenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    workload: dict[str, Any]
    systems: dict[str, SystemSummary]
    ratios: dict[str, float]
    agreement: dict[str, dict[str, float]]
    load_average: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "environment": self.environment,
            "workload": self.workload,
            "systems": {name: s.to_dict() for name, s in self.systems.items()},
            "ratios": self.ratios,
            "target_ratio": TARGET_RATIO,
            "agreement": self.agreement,
            "load_average": self.load_average,
        }


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return []


def _runner(
    name: str, cfg: EngineBenchConfig, device: torch.device, dtype: torch.dtype
) -> Callable[[Workload], RunResult]:
    def load():
        return load_model(cfg.model, seed=0, device=device, dtype=dtype)

    if name == ROSE:
        # the engine is told the same device and dtype the model already has (no copy)
        rose_cfg = replace(cfg.rose, device=str(device), dtype=str(dtype).removeprefix("torch."))

        def run(workload: Workload) -> RunResult:
            model, tokenizer = load()
            return run_rose(model, tokenizer, workload, rose_cfg)

    # transformers' passes run under the SDPA backends rose's steps do: cuDNN's per-shape plans slow it too (an
    # H100's first hf-continuous-batching pass: 678 tok/s with cuDNN, 2,676 without; benchmarks/README.md)
    elif name == STATIC:

        def run(workload: Workload) -> RunResult:
            model, _ = load()
            with sdpa_backends(device):
                return run_static_batching(model, workload, cfg.static)

    elif name == HF_CB:

        def run(workload: Workload) -> RunResult:
            model, _ = load()
            with sdpa_backends(device):
                return run_hf_continuous_batching(model, workload, cfg.hf_cb)

    else:
        raise ValueError(f"unknown system {name!r}; systems are {', '.join(SYSTEMS)}")
    return run


def agreement(a: RunResult, b: RunResult) -> dict[str, float]:
    """How alike two systems' greedy outputs are: the share of requests with identical tokens, and the mean share
    of each request's tokens before the first difference. fp32 kernels differ in summation order (padding, batch
    shapes), so near-ties can flip a token and everything after it; expect high but not always perfect agreement."""
    same = 0
    prefix_share = 0.0
    common = [k for k in a.outputs if k in b.outputs]
    for key in common:
        x, y = a.outputs[key], b.outputs[key]
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        same += int(x == y)
        prefix_share += k / max(len(x), len(y), 1)
    total = max(len(common), 1)
    return {"identical": same / total, "mean_prefix_share": prefix_share / total}


def run_engine_bench(
    cfg: EngineBenchConfig, progress: Callable[[str], None] | None = None
) -> EngineBenchReport:
    unknown = [s for s in cfg.systems if s not in SYSTEMS]
    if unknown or not cfg.systems:
        raise ValueError(f"systems must be a non-empty subset of {SYSTEMS}, got {cfg.systems!r}")
    threads = set_threads(cfg.num_threads)
    device, dtype = resolve_target(cfg.device, cfg.dtype)
    # process-wide, so every system in this run gets the same allocator settings (rose's engine would apply them)
    malloc = tune_malloc()
    workload = make_workload(
        cfg.num_requests,
        cfg.prompt_len_range,
        cfg.output_len_range,
        vocab_size=prompt_vocab_size(cfg.model),
        seed=cfg.seed,
    )
    runners = {name: _runner(name, cfg, device, dtype) for name in cfg.systems}
    results: dict[str, list[RunResult]] = {name: [] for name in cfg.systems}
    load_before = _load_avg()
    for rep in range(cfg.repeats):
        for name, run in runners.items():
            busy = wait_for_idle(cfg.wait_idle_s) if cfg.wait_idle_s > 0 else cpu_busy_fraction()
            t0 = time.perf_counter()
            result = run(workload)
            release_memory(device)
            result.extra["cpu_busy_before"] = busy
            results[name].append(result)
            msg = (
                f"[{rep + 1}/{cfg.repeats}] {name}: {result.tokens_per_s:.0f} tok/s "
                f"({result.wall_s:.2f} s timed, {time.perf_counter() - t0:.1f} s with setup)"
            )
            if busy is not None and busy > BUSY_WARNING:
                msg += f"; WARNING: other processes kept {busy:.0%} of the CPUs busy just before this pass"
            logger.info(msg)
            if progress is not None:
                progress(msg)
    summaries = {name: SystemSummary(name, runs) for name, runs in results.items()}
    ratios: dict[str, float] = {}
    agree: dict[str, dict[str, float]] = {}
    if ROSE in summaries:
        for other in (STATIC, HF_CB):
            if other in summaries:
                ratios[f"rose/{other}"] = (
                    summaries[ROSE].median_tokens_per_s / summaries[other].median_tokens_per_s
                )
                agree[f"rose~{other}"] = agreement(summaries[ROSE].runs[0], summaries[other].runs[0])
    if STATIC in summaries and HF_CB in summaries:
        agree[f"{STATIC}~{HF_CB}"] = agreement(summaries[STATIC].runs[0], summaries[HF_CB].runs[0])
    env = environment(device, dtype)
    env["torch_num_threads"] = threads
    env["malloc_tuning"] = malloc
    config = asdict(cfg)
    config["systems"] = list(cfg.systems)
    return EngineBenchReport(
        config=config,
        environment=env,
        workload=workload.describe(),
        systems=summaries,
        ratios=ratios,
        agreement=agree,
        load_average={"before": load_before, "after": _load_avg()},
    )
