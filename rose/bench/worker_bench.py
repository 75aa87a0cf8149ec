"""rose end to end (a real redis-server + a `rose-worker` process) vs rose's engine alone, plus latency under load.

Throughput: the whole workload is submitted at once (`Client.submit_many`, greedy, EOS ignored, the workload's
max_tokens) to a warmed-up worker; the clock runs from the submission to the last result read back. Then the
engine alone (`rose_runner.run_rose`) runs the same workload in this process, with the same thread setting, while
the worker idles (blocked on its queue), so the two never compete for the CPUs. With `repeats` > 1 the two
alternate, pass after pass, and medians are compared: a shared machine's drift hits both alike.

Latency (`rate > 0`): Poisson arrivals on the same worker, seen by a subscriber (rose.bench.latency).
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rose.bench.common import (
    RunResult,
    cpu_busy_fraction,
    environment,
    load_model,
    make_result,
    resolve_target,
    set_threads,
)
from rose.bench.latency import percentiles, run_latency
from rose.bench.rose_runner import RoseConfig, run_rose
from rose.bench.worker_procs import RedisProcess, WorkerProcess
from rose.bench.workload import Workload, make_workload

logger = logging.getLogger(__name__)

WORKER, ENGINE = "rose-worker", "rose-engine"
TARGET_RATIO = 0.9
JOB_TIMEOUT_S = 900


@dataclass
class WorkerBenchConfig:
    model: str = "tiny-llama"
    device: str = (
        "cpu"  # the worker's and the engine-alone pass's, as the engine takes them ('auto': CUDA if there)
    )
    dtype: str = "float32"
    num_requests: int = 128
    prompt_len_range: tuple[int, int] = (16, 128)
    output_len_range: tuple[int, int] = (16, 128)
    seed: int = 0
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    num_threads: int | None = None
    rate: float = 0.0  # requests/s of the latency run; 0: no latency run
    latency_requests: int = 64
    skip_engine: bool = False
    repeats: int = 1  # worker and engine passes alternate; medians are compared
    warmup_requests: int = 8
    timeout_s: float = 600.0  # per phase


@dataclass
class WorkerBenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    workload: dict[str, Any]
    systems: dict[str, RunResult] = field(default_factory=dict)
    ratio: float | None = None  # median worker tok/s / median engine tok/s
    pass_ratios: list[float] = field(default_factory=list)  # worker / engine of each pair of adjacent passes

    @property
    def paired_ratio(self) -> float | None:
        """Median of the per-pair ratios: each worker pass against the engine pass run next to it, so a machine
        whose speed drifts over the run (shared VMs: ±10% within minutes) skews it less than the ratio of medians."""
        return statistics.median(self.pass_ratios) if self.pass_ratios else None

    agreement: float | None = None  # share of requests with identical greedy outputs, worker vs engine
    latency: dict[str, Any] | None = None
    processes: dict[str, Any] = field(default_factory=dict)
    load_average: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "worker",
            "config": self.config,
            "environment": self.environment,
            "workload": self.workload,
            "systems": {k: v.to_dict() for k, v in self.systems.items()},
            "worker_vs_engine_tokens_per_s": self.ratio,
            "worker_vs_engine_per_pass": self.pass_ratios,
            "worker_vs_engine_paired_median": self.paired_ratio,
            "target_ratio": TARGET_RATIO,
            "greedy_identical_share": self.agreement,
            "latency": self.latency,
            "processes": self.processes,
            "load_average": self.load_average,
        }


def model_len_for(workload: Workload) -> int:
    """The context limit rose_runner gives the engine alone: the longest request, rounded up, plus 64."""
    return -(-workload.max_total_len // 64) * 64 + 64


def _job_fields(workload: Workload, prefix: str) -> list[dict[str, Any]]:
    return [
        {
            "prompt_token_ids": list(r.prompt_token_ids),
            "max_tokens": r.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "job_id": f"{prefix}{r.request_id}",
            "job_timeout": JOB_TIMEOUT_S,
        }
        for r in workload.requests
    ]


def _run_all_at_once(
    client: Any, workload: Workload, prefix: str, timeout_s: float
) -> tuple[dict[str, list[int]], float, dict[str, Any]]:
    """Submit every request in one round trip, wait for every result; (outputs by request id, wall seconds)."""
    fields = _job_fields(workload, prefix)
    start = time.perf_counter()
    jobs = client.submit_many(fields)
    outputs: dict[str, list[int]] = {}
    queue_s: list[float] = []
    results = client.results(jobs, timeout=timeout_s)  # as a batch producer waits: all at once
    for req, result in zip(workload.requests, results, strict=True):
        outputs[req.request_id] = list(result["token_ids"])
        queue_s.append(float((result.get("metrics") or {}).get("queue_s", float("nan"))))
    wall = time.perf_counter() - start
    # The worker's own view: how long jobs waited in the queue before the engine took them.
    return outputs, wall, {"queue_s": percentiles(queue_s)}


def _load() -> list[float]:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_worker_bench(
    cfg: WorkerBenchConfig, progress: Callable[[str], None] | None = None
) -> WorkerBenchReport:
    from rose.jobs.client import Client

    say = progress or (lambda m: logger.info("%s", m))
    threads = set_threads(cfg.num_threads)
    workload = make_workload(cfg.num_requests, cfg.prompt_len_range, cfg.output_len_range, seed=cfg.seed)
    lat_wl = None
    if cfg.rate > 0:
        lat_wl = make_workload(
            cfg.latency_requests, cfg.prompt_len_range, cfg.output_len_range, seed=cfg.seed + 1
        )
    max_len = max(model_len_for(workload), model_len_for(lat_wl) if lat_wl else 0)
    device, dtype = resolve_target(cfg.device, cfg.dtype)
    env = environment(device, dtype)
    report = WorkerBenchReport(config=asdict(cfg), environment=env, workload=workload.describe())
    report.load_average["before"] = _load()
    report.processes["cpu_busy_before"] = cpu_busy_fraction()
    queue = f"rose-bench-{uuid.uuid4().hex[:8]}"
    say(f"starting redis-server and rose-worker (queue {queue}, {threads} torch threads)")
    with RedisProcess() as server:
        report.processes["redis_pid"] = server.pid
        with WorkerProcess(
            server.url,
            queue,
            f"bench-{uuid.uuid4().hex[:6]}",
            model=cfg.model,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=max_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_threads=threads,
        ) as worker:
            report.processes["worker_pid"] = worker.pid
            report.processes["worker_command"] = worker.command
            client = Client(server.url, queue=queue)
            try:
                if cfg.warmup_requests > 0:
                    say(f"warming the worker up ({cfg.warmup_requests} requests)")
                    _run_all_at_once(client, workload.head(cfg.warmup_requests), "warmup-", cfg.timeout_s)
                worker_runs, engine_runs = [], []
                for rep in range(cfg.repeats):
                    tag = f"[{rep + 1}/{cfg.repeats}] " if cfg.repeats > 1 else ""
                    # each pair in turn starts with the worker and with the engine: a machine speeding up or
                    # slowing down over the run favours neither
                    engine_first = rep % 2 == 1 and not cfg.skip_engine
                    if engine_first:
                        say(f"{tag}engine alone: {len(workload)} requests in this process (the worker idles)")
                        engine_runs.append(_engine_pass(cfg, workload, max_len))
                    say(f"{tag}worker: {len(workload)} requests at once")
                    outputs, wall, extra = _run_all_at_once(client, workload, f"tp{rep}-", cfg.timeout_s)
                    worker_runs.append(
                        make_result(
                            WORKER,
                            workload,
                            outputs,
                            wall,
                            settings={"queue": queue, "max_model_len": max_len},
                            extra=extra,
                        )
                    )
                    if not cfg.skip_engine and not engine_first:
                        say(f"{tag}engine alone: {len(workload)} requests in this process (the worker idles)")
                        engine_runs.append(_engine_pass(cfg, workload, max_len))
                if lat_wl is not None:
                    say(f"latency: {len(lat_wl)} requests, Poisson arrivals at {cfg.rate} req/s")
                    prefix = f"lat-{uuid.uuid4().hex[:6]}-"
                    report.latency = run_latency(
                        client,
                        server.url,
                        lat_wl,
                        _job_fields(lat_wl, prefix),
                        prefix,
                        cfg.rate,
                        cfg.seed,
                        cfg.timeout_s,
                    )
            finally:
                client.redis.close()
    say("worker and redis-server stopped")
    report.systems[WORKER] = _median_run(worker_runs)
    if engine_runs:
        report.systems[ENGINE] = _median_run(engine_runs)
        w, e = report.systems[WORKER], report.systems[ENGINE]
        report.ratio = w.tokens_per_s / e.tokens_per_s
        report.pass_ratios = [
            a.tokens_per_s / b.tokens_per_s for a, b in zip(worker_runs, engine_runs, strict=True)
        ]
        same = sum(w.outputs.get(r.request_id) == e.outputs.get(r.request_id) for r in workload.requests)
        report.agreement = same / len(workload)
    report.load_average["after"] = _load()
    return report


def _engine_pass(cfg: WorkerBenchConfig, workload: Workload, max_len: int) -> RunResult:
    model, tokenizer = load_model(cfg.model, seed=0, device=cfg.device, dtype=cfg.dtype)
    rose_cfg = RoseConfig(
        device=cfg.device,
        dtype=cfg.dtype,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=max_len,
        warmup_requests=cfg.warmup_requests,
        detokenize=True,  # the same work the worker does: it publishes and stores text
    )
    result = run_rose(model, tokenizer, workload, rose_cfg)
    result.name = ENGINE
    return result


def _median_run(runs: list[RunResult]) -> RunResult:
    """The pass with the median wall time (the lower middle one for an even count); every wall time in extra."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    median = ordered[(len(ordered) - 1) // 2]
    median.extra["pass_wall_s"] = [r.wall_s for r in runs]
    return median


def throughput_rows(report: WorkerBenchReport) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "system",
        "requests/s",
        "generated tok/s",
        "wall s",
        "tokens credited",
        "counts ok",
        "vs engine",
    ]
    engine = report.systems.get(ENGINE)
    rows = []
    for name, s in report.systems.items():
        ratio = s.tokens_per_s / engine.tokens_per_s if engine is not None else float("nan")
        rows.append(
            [
                name,
                s.requests_per_s,
                s.tokens_per_s,
                s.wall_s,
                s.generated_tokens,
                "yes" if s.token_counts_ok else "NO",
                ratio,
            ]
        )
    return headers, rows
