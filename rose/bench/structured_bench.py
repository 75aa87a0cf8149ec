"""`rose bench engine --structured`: what structured outputs cost rose's engine, in one process.

The same workload (prompts, max_tokens, greedy) runs four ways on one engine: unconstrained (EOS ignored), every
request constrained by a JSON schema, half of them constrained (alternating), and every request constrained with
each row masked before its draw (`mask-first`: what vLLM does; by default rose checks a drawn token and masks only
where the grammar refuses it, rose.engine.sampler). A constrained request ends when its grammar does, so
throughput is generated tokens (whatever each request produced) per second of wall time. The schema (one string
field of exactly 4,096 characters: minLength and maxLength) keeps every row writing until max_tokens, so every pass
generates the same tokens (with maxLength alone a greedy random row may close its string early, and a pass with
fewer rows per step has fewer tokens per second for that reason alone). It is the case where checking after the
draw gains most (inside the string nearly every token is allowed): a schema with more structure is refused more
often. Also measured: the grammar's first compile and a
cache hit, the per-step mask cost (bitmask fill + apply on the constrained rows) and the time spent checking drawn
tokens, from the engine's own counters (`get_stats`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rose.bench.common import environment, load_model, prompt_vocab_size, resolve_target, set_threads, sync
from rose.bench.rose_runner import RoseConfig, build_llm
from rose.bench.workload import Workload, make_workload
from rose.engine.sampling_params import SamplingParams
from rose.engine.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

TARGET_SHARE = 0.9  # constrained throughput / unconstrained, at batch 64 on CPU
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4096, "maxLength": 4096}},
    "required": ["text"],
}
MODES = ("unconstrained", "json-schema", "mixed", "mask-first")


@dataclass
class StructuredBenchConfig:
    model: str = "tiny-llama"
    num_requests: int = 64
    prompt_len_range: tuple[int, int] = (16, 128)
    output_len_range: tuple[int, int] = (16, 128)
    seed: int = 0
    repeats: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int | None = None
    rose: RoseConfig = field(default_factory=RoseConfig)


@dataclass
class ModePass:
    wall_s: float
    generated_tokens: int
    steps: int
    mask_calls: int
    mask_s: float
    masked_rows: int
    checked_rows: int = 0  # rows drawn unmasked and checked after the draw
    refused_rows: int = 0  # of which the grammar refused the token (then masked and drawn again)
    check_s: float = 0.0  # asking the grammars about the drawn tokens
    fill_us_per_row: list[float] = field(default_factory=list)  # per masking step: the fill / rows masked
    apply_us: list[float] = field(default_factory=list)  # per masking step: the apply (its launch on CUDA)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s


@dataclass
class StructuredBenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    workload: dict[str, Any]
    passes: dict[str, list[ModePass]]
    first_compile_s: float
    cache_hit_s: float

    def median_tokens_per_s(self, mode: str) -> float:
        return statistics.median(p.tokens_per_s for p in self.passes[mode])

    def ratio(self, mode: str) -> float:
        """Median over the rounds of this mode's throughput / the unconstrained pass of the same round: the
        passes of one round run back to back, so a shared machine's drift cancels out of the pair."""
        pairs = zip(self.passes[mode], self.passes["unconstrained"], strict=True)
        return statistics.median(p.tokens_per_s / base.tokens_per_s for p, base in pairs)

    def mask_ms_per_step(self, mode: str) -> float:
        """Mask time (fill + apply) per engine step, over every step of the mode's passes."""
        steps = sum(p.steps for p in self.passes[mode])
        return 1e3 * sum(p.mask_s for p in self.passes[mode]) / steps if steps else 0.0

    def percentiles(self, mode: str, name: str) -> tuple[float, float]:
        """p50 and p99 (nearest rank) of a per-step sample over this mode's passes; NaN without samples."""
        values = sorted(v for p in self.passes[mode] for v in getattr(p, name))
        if not values:
            return float("nan"), float("nan")
        return values[(len(values) - 1) // 2], values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]

    def check_ms_per_step(self, mode: str) -> float:
        """Time checking drawn tokens against their grammars per engine step, over every step of the mode."""
        steps = sum(p.steps for p in self.passes[mode])
        return 1e3 * sum(p.check_s for p in self.passes[mode]) / steps if steps else 0.0

    def mean_masked_rows(self, mode: str) -> float:
        """Rows masked per engine step, over every step of the mode's passes."""
        steps = sum(p.steps for p in self.passes[mode])
        return sum(p.masked_rows for p in self.passes[mode]) / steps if steps else 0.0

    def refused_share(self, mode: str) -> float:
        """Of the rows checked after their draw, the share whose token the grammar refused (NaN: none checked)."""
        checked = sum(p.checked_rows for p in self.passes[mode])
        return sum(p.refused_rows for p in self.passes[mode]) / checked if checked else float("nan")

    def rows(self) -> tuple[list[str], list[list[Any]]]:
        headers = [
            "mode",
            "generated tok/s",
            "vs unconstrained (paired)",
            "tokens",
            "mask ms/step",
            "check ms/step",
            "rows masked/step",
            "refused / checked",
            "fill µs/row p50 / p99",
            "apply µs p50 / p99",
        ]
        rows = []
        for mode in MODES:
            best = max(self.passes[mode], key=lambda p: p.tokens_per_s)
            rows.append(
                [
                    mode,
                    f"{self.median_tokens_per_s(mode):,.0f}",
                    f"{self.ratio(mode):.1%}",
                    best.generated_tokens,
                    f"{self.mask_ms_per_step(mode):.3f}",
                    f"{self.check_ms_per_step(mode):.3f}",
                    f"{self.mean_masked_rows(mode):.1f}",
                    f"{self.refused_share(mode):.1%}",
                    "{:.0f} / {:.0f}".format(*self.percentiles(mode, "fill_us_per_row")),
                    "{:.0f} / {:.0f}".format(*self.percentiles(mode, "apply_us")),
                ]
            )
        return headers, rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "environment": self.environment,
            "workload": self.workload,
            "first_compile_s": self.first_compile_s,
            "cache_hit_s": self.cache_hit_s,
            "target_share": TARGET_SHARE,
            "modes": {
                mode: {
                    "median_generated_tokens_per_s": self.median_tokens_per_s(mode),
                    "ratio_vs_unconstrained": self.ratio(mode),
                    "mask_ms_per_step": self.mask_ms_per_step(mode),
                    "check_ms_per_step": self.check_ms_per_step(mode),
                    "mean_masked_rows": self.mean_masked_rows(mode),
                    "refused_share": self.refused_share(mode),
                    "fill_us_per_row_p50_p99": self.percentiles(mode, "fill_us_per_row"),
                    "apply_us_p50_p99": self.percentiles(mode, "apply_us"),
                    "passes": [{**asdict(p), "tokens_per_s": p.tokens_per_s} for p in self.passes[mode]],
                }
                for mode in MODES
            },
        }


def _params(mode: str, index: int, max_tokens: int) -> SamplingParams:
    constrained = mode in ("json-schema", "mask-first") or (mode == "mixed" and index % 2 == 0)
    if not constrained:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    so = StructuredOutputsParams(json=BENCH_SCHEMA)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, structured_outputs=so)


def _run_mode(llm: Any, workload: Workload, mode: str) -> ModePass:
    engine = llm.engine
    prompts = [list(r.prompt_token_ids) for r in workload.requests]
    params = [_params(mode, i, r.max_tokens) for i, r in enumerate(workload.requests)]
    before = engine.get_stats()
    manager = engine.structured_outputs
    manager.take_step_samples()  # from this pass only
    manager.mask_first = mode == "mask-first"
    try:
        sync(engine.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(engine.device)
        wall = time.perf_counter() - start
    finally:
        manager.mask_first = False
    after = engine.get_stats()

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    tokens = sum(len(o.token_ids) for o in outs)
    samples = manager.take_step_samples()
    return ModePass(
        wall,
        tokens,
        int(delta("num_steps")),
        int(delta("structured_output_mask_calls")),
        delta("structured_output_mask_s"),
        int(delta("structured_output_masked_rows")),
        int(delta("structured_output_checked_rows")),
        int(delta("structured_output_refused_rows")),
        delta("structured_output_check_s"),
        [1e6 * fill for fill, _ in samples],
        [1e6 * apply for _, apply in samples],
    )


def run_structured_bench(
    cfg: StructuredBenchConfig, progress: Callable[[str], None] | None = None
) -> StructuredBenchReport:
    threads = set_threads(cfg.num_threads)
    device, dtype = resolve_target(cfg.device, cfg.dtype)
    workload = make_workload(
        cfg.num_requests,
        cfg.prompt_len_range,
        cfg.output_len_range,
        vocab_size=prompt_vocab_size(cfg.model),
        seed=cfg.seed,
    )
    model, tokenizer = load_model(cfg.model, seed=0, device=device, dtype=dtype)
    rose_cfg = RoseConfig(
        **{**asdict(cfg.rose), "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    )
    max_model_len = -(-workload.max_total_len // 64) * 64 + 64
    passes: dict[str, list[ModePass]] = {mode: [] for mode in MODES}
    with torch.inference_mode():
        llm, _ = build_llm(model, tokenizer, rose_cfg, max_model_len)  # constraints need the tokenizer
        manager = llm.engine.structured_outputs
        timings = []
        for _ in range(2):  # the first compiles, the second finds it in the cache
            t0 = time.perf_counter()
            manager.make_request(StructuredOutputsParams(json=BENCH_SCHEMA)).wait()
            timings.append(time.perf_counter() - t0)
        warm = workload.head(min(rose_cfg.warmup_requests, len(workload)), "warmup-")
        for mode in MODES:
            _run_mode(llm, warm, mode)
        for rep in range(cfg.repeats):
            for mode in (
                MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
            ):  # each mode leads a round in turn
                result = _run_mode(llm, workload, mode)
                passes[mode].append(result)
                msg = (
                    f"[{rep + 1}/{cfg.repeats}] {mode}: {result.tokens_per_s:,.0f} tok/s ({result.generated_tokens} "
                    f"tokens, {result.wall_s:.2f} s, {result.steps} steps)"
                )
                logger.info(msg)
                if progress is not None:
                    progress(msg)
    env = environment(device, dtype)
    env["torch_num_threads"] = threads
    config = asdict(cfg)
    config["schema"] = BENCH_SCHEMA
    return StructuredBenchReport(config, env, workload.describe(), passes, timings[0], timings[1])
