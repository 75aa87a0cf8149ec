"""Decode-step time of rose's engine versus batch size and context length.

For each point (B, L) the engine gets B requests with L-token prompts (greedy, EOS ignored, max_tokens large enough
that none finishes), is stepped until every request has its first token (prefill done), takes a few untimed decode
steps, then `timed_steps` decode steps are timed one by one. One engine, sized for the largest point, serves every
point, so a cost that follows the allocated capacity rather than the live work would show up as a flat line.

If step time follows attention work only, t ≈ a + b·B + c·B·ctx: a fixed per-step cost, a per-sequence cost (the
MLPs, projections and LM head of one token) and a cost per cached token attended to. The least-squares fit and its
R² are reported with the points.

Each point also gets its memory-bandwidth floor (`rose.bench.roofline`): the weight bytes plus the KV bytes a step
must read, over the device's measured copy bandwidth, and the fraction floor / measured step time (median and
fastest step); on a GPU the issue's goal is ≥ 50 % at batch 64. Runs on `device` in `dtype` (CUDA: clocks read
after `torch.cuda.synchronize()`).
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rose.bench.common import cpu_busy_fraction, environment, load_model, resolve_target, set_threads, sync
from rose.bench.roofline import Roofline
from rose.bench.rose_runner import RoseConfig, build_llm, greedy_params
from rose.bench.step_profile import profile_step
from rose.bench.workload import RESERVED_IDS
from rose.engine.model_runner import model_context

logger = logging.getLogger(__name__)


@dataclass
class StepBenchConfig:
    model: str = "tiny-llama"
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64, 128)
    batch_sweep_context: int = 256
    context_lens: tuple[int, ...] = (128, 512, 1024, 2048)
    context_sweep_batch: int = 64
    warmup_steps: int = 3
    timed_steps: int = 16
    seed: int = 0
    device: str = "cpu"  # 'auto': CUDA when available
    dtype: str = "float32"  # 'auto': bfloat16 on CUDA, float32 on CPU
    copy_bytes: int | None = None  # bandwidth probe size; None: 256 MiB on CPU, 1 GiB on CUDA
    num_threads: int | None = None
    max_num_batched_tokens: int | None = None  # None: the engine's default
    profile: bool = False  # torch profiler + model-forward split at (profile_batch, profile_context)
    profile_batch: int = 64
    profile_context: int = 512


@dataclass
class StepPoint:
    sweep: str
    batch_size: int
    context_len: int
    step_ms: list[float]
    num_running: int | None = None
    mean_context: float | None = None  # mean tokens per row in the store when the timed steps began
    prefill_steps: int = 0
    pure_decode: bool = True  # every timed step decoded exactly one token for each of the batch's requests
    fit_ms: float | None = None
    cpu_busy_before: float | None = None  # share of the CPUs other processes kept busy just before the point
    # memory-bandwidth floor: positions each row attends to, averaged over the timed steps; bytes read per step
    kv_context: float | None = None
    weight_bytes: int | None = None
    kv_bytes: float | None = None
    floor_ms: float | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def min_ms(self) -> float:
        return min(self.step_ms)

    @property
    def floor_fraction_median(self) -> float | None:
        return self.floor_ms / self.median_ms if self.floor_ms is not None else None

    @property
    def floor_fraction_best(self) -> float | None:
        return self.floor_ms / self.min_ms if self.floor_ms is not None else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(median_ms=self.median_ms, min_ms=self.min_ms, ms_per_seq=self.median_ms / self.batch_size)
        out.update(
            floor_fraction_median=self.floor_fraction_median, floor_fraction_best=self.floor_fraction_best
        )
        return out


@dataclass
class StepBenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    points: list[StepPoint]
    fit: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] | None = None
    roofline: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "environment": self.environment,
            "points": [p.to_dict() for p in self.points],
            "fit": self.fit,
            "roofline": self.roofline,
            "profile": self.profile,
        }


class _Driver:
    """Drives `llm.engine` directly: add B requests, finish prefill, time pure decode steps, abort them."""

    def __init__(self, engine: Any, max_model_len: int, seed: int) -> None:
        self.engine = engine
        self.device: torch.device = engine.device
        self.vocab_size = engine.vocab_size  # ids its prompts may use (the tokenizer's, where it is smaller)
        self.max_model_len = max_model_len
        self.rng = random.Random(seed)
        self.counter = 0

    def _add(self, batch: int, context: int) -> list[str]:
        # As many tokens as the context allows: requests prefilled early decode while later ones prefill, and
        # none may finish before the timed steps are over. They are aborted once measured.
        max_tokens = self.max_model_len - context
        ids = []
        for _ in range(batch):
            rid = f"step-{self.counter}"
            self.counter += 1
            prompt = [self.rng.randrange(RESERVED_IDS, self.vocab_size) for _ in range(context)]
            self.engine.add_request(rid, prompt, greedy_params(max_tokens))
            ids.append(rid)
        return ids

    def _finish(self, ids: list[str]) -> None:
        abort = getattr(self.engine, "abort", None)
        if abort is not None:
            for rid in ids:
                abort(rid)
        guard = 0
        while self.engine.has_unfinished():
            self.engine.step()
            guard += 1
            if guard > 100_000:
                raise RuntimeError("engine did not drain")

    def _mean_context(self, ids: list[str]) -> float | None:
        get = getattr(self.engine, "get_request", None)
        seqs = [get(rid) for rid in ids] if get is not None else []
        lens = [s.num_tokens for s in seqs if s is not None]
        return sum(lens) / len(lens) if lens else None

    def measure(self, batch: int, context: int, warmup: int, timed: int, hook: Any = None) -> _Measured:
        if self.engine.has_unfinished():
            self._finish([])
        ids = self._add(batch, context)
        pending = set(ids)
        prefill_steps = 0
        while pending:  # prefill (possibly chunked) until every request has its first token
            for out in self.engine.step():
                if out.new_token_ids:
                    pending.discard(out.request_id)
            prefill_steps += 1
            if prefill_steps > batch * context + 100:
                raise RuntimeError("prefill did not finish")
        for _ in range(warmup):
            self.engine.step()
        running = getattr(self.engine, "num_running", None)
        mean_context = self._mean_context(ids)
        times: list[float] = []
        pure = True
        stop = hook() if hook is not None else None
        for _ in range(timed):
            sync(self.device)
            t0 = time.perf_counter()
            outs = self.engine.step()
            sync(self.device)
            times.append((time.perf_counter() - t0) * 1e3)
            pure &= len(outs) == batch and all(len(o.new_token_ids) == 1 and not o.finished for o in outs)
        extra = stop() if stop is not None else None
        if not pure:
            logger.warning(
                "batch %d ctx %d: some timed steps were not pure decode steps of the batch", batch, context
            )
        self._finish(ids)
        return _Measured(times, running, mean_context, prefill_steps, pure, extra)


@dataclass
class _Measured:
    step_ms: list[float]
    num_running: int | None
    mean_context: float | None
    prefill_steps: int
    pure_decode: bool
    extra: Any = None


def _ctx(p: StepPoint) -> float:
    return p.mean_context if p.mean_context is not None else float(p.context_len)


def _fit(points: list[StepPoint]) -> dict[str, float]:
    """Least squares t = a + b·B + c·B·ctx over all points (ms), on each point's fastest step: on a shared machine
    the minimum is the least disturbed estimate of what a step costs."""
    if len(points) < 3:
        return {}
    x = torch.tensor([[1.0, p.batch_size, p.batch_size * _ctx(p)] for p in points], dtype=torch.float64)
    y = torch.tensor([p.min_ms for p in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1)
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    for p, f in zip(points, pred.tolist(), strict=True):
        p.fit_ms = f
    return {
        "fixed_ms": float(coef[0]),
        "per_seq_ms": float(coef[1]),
        "per_cached_token_us": float(coef[2]) * 1e3,
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
    }


def _plan(cfg: StepBenchConfig) -> list[tuple[str, int, int]]:
    plan = [("batch", b, cfg.batch_sweep_context) for b in cfg.batch_sizes]
    return plan + [("context", cfg.context_sweep_batch, c) for c in cfg.context_lens]


def _max_model_len(cfg: StepBenchConfig, model_context: int) -> int:
    """Positions per row: the longest point's prompt, plus room to decode while the rest of its batch prefills
    (>= 1 step per 1024 prompt tokens: twice the engine's default token budget), then to warm up and time."""
    points = [(b, c) for _, b, c in _plan(cfg)]
    if cfg.profile:
        points.append((cfg.profile_batch, cfg.profile_context))
    need = max(c + b * c // 1024 for b, c in points) + cfg.warmup_steps + cfg.timed_steps + 32
    max_model_len = min(-(-need // 64) * 64, model_context)
    longest = max(c for _, c in points)
    if longest + cfg.warmup_steps + cfg.timed_steps + 2 > max_model_len:
        raise ValueError(
            f"context {longest} leaves no room to decode within the model's {model_context} positions"
        )
    return max_model_len


def _add_floor(point: StepPoint, roofline: Roofline, timed_steps: int) -> None:
    # step i of the timed ones attends to (tokens when timing began + i) positions per row
    ctx = (point.mean_context if point.mean_context is not None else point.context_len) + (
        timed_steps - 1
    ) / 2
    point.kv_context = ctx
    point.weight_bytes = roofline.weights.total
    point.kv_bytes = roofline.kv_bytes(point.batch_size, ctx)
    point.floor_ms = roofline.floor_ms(point.batch_size, ctx)


def run_step_bench(cfg: StepBenchConfig, progress: Any = None) -> StepBenchReport:
    threads = set_threads(cfg.num_threads)
    device, dtype = resolve_target(cfg.device, cfg.dtype)
    # rose sets its own attention: no baseline here needs SDPA (which state-space models refuse to switch to)
    model, tokenizer = load_model(cfg.model, seed=0, attn_implementation=None, device=device, dtype=dtype)
    max_batch = max([*cfg.batch_sizes, cfg.context_sweep_batch, cfg.profile_batch if cfg.profile else 1])
    max_ctx = max([*cfg.context_lens, cfg.batch_sweep_context, cfg.profile_context if cfg.profile else 1])
    max_model_len = _max_model_len(cfg, model_context(model.config))
    # before the engine exists, so the probe's buffers never compete with its KV store for memory
    roofline = Roofline.measure(model, device, cfg.copy_bytes)
    logger.info(
        "copy bandwidth %.1f GB/s; %d weight bytes per step",
        roofline.bandwidth_bytes_per_s / 1e9,
        roofline.weights.total,
    )
    rose_cfg = RoseConfig(
        max_num_seqs=max_batch,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
    )
    points: list[StepPoint] = []
    profile = None
    with torch.inference_mode():
        llm, llm_kwargs = build_llm(model, tokenizer, rose_cfg, max_model_len)
        driver = _Driver(llm.engine, max_model_len, cfg.seed)
        driver.measure(min(4, max_batch), min(32, max_ctx), 2, 4)  # warm the engine up
        for sweep, batch, ctx in _plan(cfg):
            busy = cpu_busy_fraction(0.3)
            t0 = time.perf_counter()
            m = driver.measure(batch, ctx, cfg.warmup_steps, cfg.timed_steps)
            point = StepPoint(
                sweep, batch, ctx, m.step_ms, m.num_running, m.mean_context, m.prefill_steps, m.pure_decode
            )
            point.cpu_busy_before = busy
            _add_floor(point, roofline, cfg.timed_steps)
            points.append(point)
            msg = (
                f"{sweep} sweep: batch {batch} ctx {ctx}: {point.median_ms:.2f} ms/step median, "
                f"{point.min_ms:.2f} min, bandwidth floor {point.floor_ms:.3f} ms "
                f"({point.floor_fraction_best:.0%} of it at the fastest step; "
                f"{time.perf_counter() - t0:.1f} s incl. prefill)"
            )
            logger.info(msg)
            if progress is not None:
                progress(msg)
        if cfg.profile:
            profile = profile_step(driver, model, cfg)
    fit = _fit(points)
    env = environment(device, dtype)
    env["torch_num_threads"] = threads
    config = asdict(cfg)
    config.update(llm_kwargs=llm_kwargs, max_num_seqs=max_batch, max_model_len=max_model_len)
    return StepBenchReport(config, env, points, fit, profile, roofline.to_dict())
