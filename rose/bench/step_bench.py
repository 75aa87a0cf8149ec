"""Decode-step time of rose's engine versus batch size and context length.

For each point (B, L) the engine gets B requests with L-token prompts (greedy, EOS ignored, max_tokens large enough
that none finishes), is stepped until every request has its first token (prefill done), takes a few untimed decode
steps, then `timed_steps` decode steps are timed one by one. One engine, sized for the largest point, serves every
point, so a cost that follows the allocated capacity rather than the live work would show up as a flat line.

If step time follows attention work only, t ≈ a + b·B + c·B·ctx: a fixed per-step cost, a per-sequence cost (the
MLPs, projections and LM head of one token) and a cost per cached token attended to. The least-squares fit and its
R² are reported with the points.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rose.bench.common import cpu_busy_fraction, environment, load_model, set_threads
from rose.bench.rose_runner import RoseConfig, build_llm, greedy_params
from rose.bench.workload import RESERVED_IDS

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

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def min_ms(self) -> float:
        return min(self.step_ms)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(median_ms=self.median_ms, min_ms=self.min_ms, ms_per_seq=self.median_ms / self.batch_size)
        return out


@dataclass
class StepBenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    points: list[StepPoint]
    fit: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "environment": self.environment,
            "points": [p.to_dict() for p in self.points],
            "fit": self.fit,
            "profile": self.profile,
        }


class _ForwardTimer:
    """Wall time spent inside a module's forward (hooks, so it works however the engine calls the model)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.total = 0.0
        self.calls = 0
        self._t0 = 0.0
        self._handles = [
            module.register_forward_pre_hook(self._pre),
            module.register_forward_hook(self._post),
        ]

    def _pre(self, *_: Any) -> None:
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.total += time.perf_counter() - self._t0
        self.calls += 1

    def reset(self) -> None:
        self.total, self.calls = 0.0, 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class _Driver:
    """Drives `llm.engine` directly: add B requests, finish prefill, time pure decode steps, abort them."""

    def __init__(self, engine: Any, vocab_size: int, max_model_len: int, seed: int) -> None:
        self.engine = engine
        self.vocab_size = vocab_size
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
            t0 = time.perf_counter()
            outs = self.engine.step()
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


def _profile_hook(model: torch.nn.Module, with_profiler: bool, row_limit: int = 25):
    """A start() -> stop() pair measuring, over the timed steps, the wall time per step spent inside the model's
    forward (the whole causal LM, and its decoder alone: whichever the engine calls) versus outside it, and
    optionally a torch profiler table of the ops (self CPU time)."""

    def start():
        timers = {"causal_lm": _ForwardTimer(model), "decoder": _ForwardTimer(model.base_model)}
        prof = (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            if with_profiler
            else None
        )
        t0 = time.perf_counter()
        if prof is not None:
            prof.__enter__()

        def stop() -> dict[str, Any]:
            if prof is not None:
                prof.__exit__(None, None, None)
            wall = time.perf_counter() - t0
            out: dict[str, Any] = {"wall_s": wall}
            for name, timer in timers.items():
                timer.remove()
                out[f"{name}_forward_s"] = timer.total
                out[f"{name}_forward_calls"] = timer.calls
            if prof is not None:
                out["top_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
            return out

        return stop

    return start


def _profile(driver: _Driver, model: torch.nn.Module, cfg: StepBenchConfig) -> dict[str, Any]:
    """Where one decode step's time goes at (profile_batch, profile_context)."""
    m = driver.measure(
        cfg.profile_batch, cfg.profile_context, cfg.warmup_steps, cfg.timed_steps, _profile_hook(model, False)
    )
    times, split = m.step_ms, m.extra
    steps = len(times)
    fwd = split["causal_lm_forward_s"] if split["causal_lm_forward_calls"] else split["decoder_forward_s"]
    out: dict[str, Any] = {
        "batch_size": cfg.profile_batch,
        "context_len": cfg.profile_context,
        "steps": steps,
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "pure_decode": m.pure_decode,
        "wall_ms_per_step": split["wall_s"] * 1e3 / steps,
        "model_forward_ms_per_step": fwd * 1e3 / steps,
        "decoder_forward_ms_per_step": split["decoder_forward_s"] * 1e3 / steps,
        "outside_model_forward_ms_per_step": (split["wall_s"] - fwd) * 1e3 / steps,
        "forward_calls": {k: v for k, v in split.items() if k.endswith("_calls")},
    }
    prof = driver.measure(
        cfg.profile_batch, cfg.profile_context, cfg.warmup_steps, cfg.timed_steps, _profile_hook(model, True)
    ).extra
    out["profiler_wall_ms_per_step"] = prof["wall_s"] * 1e3 / steps
    out["top_ops"] = prof["top_ops"]
    return out


def run_step_bench(cfg: StepBenchConfig, progress: Any = None) -> StepBenchReport:
    threads = set_threads(cfg.num_threads)
    model, tokenizer = load_model(cfg.model, seed=0)
    vocab = int(model.config.vocab_size)
    max_batch = max([*cfg.batch_sizes, cfg.context_sweep_batch, cfg.profile_batch if cfg.profile else 1])
    max_ctx = max([*cfg.context_lens, cfg.batch_sweep_context, cfg.profile_context if cfg.profile else 1])
    # room to decode while the rest of the batch prefills (>= 1 step per 1024 prompt tokens), then warm up and time
    margin = cfg.warmup_steps + cfg.timed_steps + 32 + max_batch * max_ctx // 1024
    rose_cfg = RoseConfig(max_num_seqs=max_batch, max_num_batched_tokens=cfg.max_num_batched_tokens)
    model_context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2048
    max_model_len = min(-(-(max_ctx + margin) // 64) * 64, model_context)
    if max_ctx + cfg.warmup_steps + cfg.timed_steps + 2 > max_model_len:
        raise ValueError(
            f"context {max_ctx} leaves no room to decode within the model's {model_context} positions"
        )
    points: list[StepPoint] = []
    profile = None
    with torch.inference_mode():
        llm, llm_kwargs = build_llm(model, tokenizer, rose_cfg, max_model_len)
        driver = _Driver(llm.engine, vocab, max_model_len, cfg.seed)
        driver.measure(min(4, max_batch), min(32, max_ctx), 2, 4)  # warm the engine up
        plan = [("batch", b, cfg.batch_sweep_context) for b in cfg.batch_sizes]
        plan += [("context", cfg.context_sweep_batch, c) for c in cfg.context_lens]
        for sweep, batch, ctx in plan:
            busy = cpu_busy_fraction(0.3)
            t0 = time.perf_counter()
            m = driver.measure(batch, ctx, cfg.warmup_steps, cfg.timed_steps)
            point = StepPoint(
                sweep, batch, ctx, m.step_ms, m.num_running, m.mean_context, m.prefill_steps, m.pure_decode
            )
            point.cpu_busy_before = busy
            points.append(point)
            msg = (
                f"{sweep} sweep: batch {batch} ctx {ctx}: {point.median_ms:.2f} ms/step median, "
                f"{point.min_ms:.2f} min "
                f"({time.perf_counter() - t0:.1f} s incl. prefill)"
            )
            logger.info(msg)
            if progress is not None:
                progress(msg)
        if cfg.profile:
            profile = _profile(driver, model, cfg)
    fit = _fit(points)
    env = environment()
    env["torch_num_threads"] = threads
    config = asdict(cfg)
    config.update(llm_kwargs=llm_kwargs, max_num_seqs=max_batch, max_model_len=max_model_len)
    return StepBenchReport(config, env, points, fit, profile)
