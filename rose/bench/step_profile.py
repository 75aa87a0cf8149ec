"""`rose bench step --profile`: where one decode step's time goes (inside the model's forward vs outside it), and
the torch profiler's top ops."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from rose.bench.common import sync


class _ForwardTimer:
    """Wall time spent inside a module's forward (hooks, so it works however the engine calls the model). On CUDA
    each boundary synchronizes, so the time is the kernels' and not just their launches'."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.total = 0.0
        self.calls = 0
        self._t0 = 0.0
        self._device = device
        self._handles = [
            module.register_forward_pre_hook(self._pre),
            module.register_forward_hook(self._post),
        ]

    def _pre(self, *_: Any) -> None:
        sync(self._device)
        self._t0 = time.perf_counter()

    def _post(self, *_: Any) -> None:
        sync(self._device)
        self.total += time.perf_counter() - self._t0
        self.calls += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def profile_hook(model: torch.nn.Module, device: torch.device, with_profiler: bool, row_limit: int = 25):
    """A start() -> stop() pair measuring, over the timed steps, the wall time per step spent inside the model's
    forward (the whole causal LM, and its decoder alone: whichever the engine calls) versus outside it, and
    optionally a torch profiler table of the ops (self CPU time; self device time on CUDA)."""
    cuda = device.type == "cuda"

    def start():
        timers = {
            "causal_lm": _ForwardTimer(model, device),
            "decoder": _ForwardTimer(model.base_model, device),
        }
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities) if with_profiler else None
        sync(device)
        t0 = time.perf_counter()
        if prof is not None:
            prof.__enter__()

        def stop() -> dict[str, Any]:
            sync(device)
            if prof is not None:
                prof.__exit__(None, None, None)
            wall = time.perf_counter() - t0
            out: dict[str, Any] = {"wall_s": wall}
            for name, timer in timers.items():
                timer.remove()
                out[f"{name}_forward_s"] = timer.total
                out[f"{name}_forward_calls"] = timer.calls
            if prof is not None:
                sort = "self_device_time_total" if cuda else "self_cpu_time_total"
                out["top_ops"] = prof.key_averages().table(sort_by=sort, row_limit=row_limit)
            return out

        return stop

    return start


def profile_step(driver: Any, model: torch.nn.Module, cfg: Any) -> dict[str, Any]:
    """Where one decode step's time goes at (cfg.profile_batch, cfg.profile_context); `driver` is step_bench's."""

    def measure(with_profiler: bool) -> Any:
        hook = profile_hook(model, driver.device, with_profiler)
        return driver.measure(cfg.profile_batch, cfg.profile_context, cfg.warmup_steps, cfg.timed_steps, hook)

    m = measure(False)
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
    prof = measure(True).extra
    out["profiler_wall_ms_per_step"] = prof["wall_s"] * 1e3 / steps
    out["top_ops"] = prof["top_ops"]
    return out
