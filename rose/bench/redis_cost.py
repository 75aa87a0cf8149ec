"""What a generated token costs Redis, measured as an operator would (`rose bench redis`).

A real redis-server and a real rose-worker (tiny-llama on CPU); `num_jobs` jobs of `max_tokens` tokens each
(greedy, EOS ignored) enqueued at once with plain RQ, then waited for; Redis's own accounting (rose.bench.redis_meter)
from the enqueue to the last result, divided by the tokens generated and by the jobs: main-thread CPU net of Redis's
idle rate, commands, round trips, and the memory left until the streams and results expire (`used_memory`, less the
latency histograms Redis makes once a server: rose.bench.redis_meter). Once for each mode:
`streamed` (the default `stream: true`) and `not-streamed` (`stream: false`), each on a fresh Redis and worker.

Where the machine has CPUs to spare, Redis runs on a CPU of its own and the worker on the others (`taskset`), as in
production, where Redis does not share a core with a model's threads: sharing one makes Redis's CPU time swing with
the model's load, not with its own work.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

from rq import Queue
from rq.serializers import JSONSerializer

from rose.bench import redis_meter
from rose.harness.redis_server import RedisServerProcess
from rose.harness.worker_process import WorkerProcess, wait_for
from rose.jobs import keys

log = logging.getLogger(__name__)

STREAMED, NOT_STREAMED = "streamed", "not-streamed"
# the targets, per generated token
TARGETS = {STREAMED: {"cpu_us": 3.0, "bytes": 60.0}, NOT_STREAMED: {"cpu_us": 0.5}}


@dataclass
class RedisCostConfig:
    model: str = "tiny-llama"
    num_jobs: int = 200
    max_tokens: int = 128
    max_num_seqs: int = 64
    modes: tuple[str, ...] = (STREAMED, NOT_STREAMED)
    worker_args: tuple[str, ...] = ()  # more rose-worker flags (--stream-interval, --check-interval, ...)
    redis_args: tuple[str, ...] = ()  # more redis-server options
    pin: bool = True  # Redis on a CPU of its own when there are two or more
    repeats: int = 1  # runs per mode, alternating; the medians are reported
    idle_s: float = 3.0
    timeout_s: float = 900.0


@dataclass
class ModeResult:
    mode: str
    tokens: int
    jobs: int
    wall_s: float
    usage: dict[str, Any]
    per_token: dict[str, float]
    per_job: dict[str, float]
    memory_by_family: dict[str, dict[str, float]] = field(default_factory=dict)
    runs_cpu_us_per_token: list[float] = field(default_factory=list)  # every run's, when repeated

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def meets(self) -> dict[str, bool]:
        return {k: self.per_token[k] <= v for k, v in TARGETS.get(self.mode, {}).items()}


@dataclass
class RedisCostReport:
    config: dict[str, Any]
    cpus: dict[str, str | None]
    results: list[ModeResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "cpus": self.cpus,
            "results": [
                {**asdict(r), "tokens_per_s": r.tokens_per_s, "meets": r.meets()} for r in self.results
            ],
        }

    def rows(self) -> tuple[list[str], list[list[Any]]]:
        headers = [
            "mode",
            "tok/s",
            "CPU µs/token",
            "raw CPU µs/token",
            "cmd µs/token",
            "cmds/token",
            "round trips/token",
            "B/token",
            "CPU µs/job",
            "cmds/job",
        ]
        rows = [
            [
                r.mode,
                r.tokens_per_s,
                r.per_token["cpu_us"],
                r.per_token["cpu_raw_us"],
                r.per_token["command_usec"],
                r.per_token["commands"],
                r.per_token["round_trips"],
                r.per_token["bytes"],
                r.per_job["cpu_us"],
                r.per_job["commands"],
            ]
            for r in self.results
        ]
        return headers, rows


def cpu_split(pin: bool) -> dict[str, str | None]:
    """Redis's CPU and the worker's, as taskset lists (None: not pinned)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not pin or n < 2:
        return {"redis": None, "worker": None}
    cpus = sorted(os.sched_getaffinity(0))
    return {"redis": str(cpus[-1]), "worker": ",".join(map(str, cpus[:-1]))}


def run_mode(
    cfg: RedisCostConfig,
    mode: str,
    cpus: dict[str, str | None],
    *,
    redis_binary: str | None = None,
    window: Callable[[RedisServerProcess], AbstractContextManager[Any]] = lambda server: nullcontext(),
) -> ModeResult:
    """One mode on a fresh redis-server and rose-worker. `redis_binary`: what runs Redis (a wrapper, e.g. under
    valgrind); `window(server)`: a context around the measured window, from the enqueue to the last result."""
    env = dict(os.environ)
    if cpus["worker"] is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(len(cpus["worker"].split(",")))
    wargs = ["--model", cfg.model, "--device", "cpu", "--dtype", "float32", "--log-level", "WARNING"]
    wargs += ["--max-num-seqs", str(cfg.max_num_seqs), "--max-model-len", str(64 + cfg.max_tokens)]
    wargs += list(cfg.worker_args)
    fields = {"max_tokens": cfg.max_tokens, "ignore_eos": True, "temperature": 0, "stream": mode == STREAMED}
    redis = RedisServerProcess(binary=redis_binary, args=list(cfg.redis_args), cpus=cpus["redis"])
    with redis.start(timeout=10 if redis_binary is None else 120) as server:
        r = server.client()
        histogram = redis_meter.histogram_bytes(r)
        with WorkerProcess(server.url, "cost", wargs, env=env, cpus=cpus["worker"]) as worker:
            worker.wait_ready(engine_info=True)
            q = Queue(keys.DEFAULT_QUEUE, connection=r, serializer=JSONSerializer)
            warm = q.enqueue(keys.FUNC_PATH, kwargs={"prompt": "warm up", **fields, "max_tokens": 8})
            wait_for(lambda: warm.get_status() == "finished", 300, "the warm-up job", interval=0.1)
            finished = q.finished_job_registry
            idle = redis_meter.idle(r, cfg.idle_s)
            with window(server):
                before = redis_meter.snapshot(r)
                q.enqueue_many(
                    [
                        Queue.prepare_data(keys.FUNC_PATH, kwargs={"prompt": f"job {i}", **fields})
                        for i in range(cfg.num_jobs)
                    ]
                )
                # one ZCARD each half second: RQ's `count` (a ZREMRANGEBYSCORE first, five times a second) was this
                # bench's own work, counted as the worker's
                done = lambda: r.zcard(finished.key) >= cfg.num_jobs + 1  # noqa: E731
                wait_for(done, cfg.timeout_s, "every job", interval=0.5)
                after = redis_meter.snapshot(r)
            used = redis_meter.usage(before, after, idle, histogram)
            families = redis_meter.memory_by_family(r)
    tokens = cfg.num_jobs * cfg.max_tokens
    return ModeResult(
        mode=mode,
        tokens=tokens,
        jobs=cfg.num_jobs,
        wall_s=used.wall_s,
        usage=used.to_dict(),
        per_token=used.per(tokens),
        per_job=used.per(cfg.num_jobs),
        memory_by_family=families,
    )


def median_of(runs: list[ModeResult]) -> ModeResult:
    """One mode's runs summed up: each figure's median (memory by key family: the median-CPU run's)."""
    if len(runs) == 1:
        return runs[0]
    by_cpu = sorted(runs, key=lambda r: r.per_token["cpu_us"])
    middle = by_cpu[len(by_cpu) // 2]
    return ModeResult(
        mode=middle.mode,
        tokens=middle.tokens,
        jobs=middle.jobs,
        wall_s=statistics.median(r.wall_s for r in runs),
        usage=middle.usage,
        per_token={k: statistics.median(r.per_token[k] for r in runs) for k in middle.per_token},
        per_job={k: statistics.median(r.per_job[k] for r in runs) for k in middle.per_job},
        memory_by_family=middle.memory_by_family,
        runs_cpu_us_per_token=[r.per_token["cpu_us"] for r in runs],
    )


def run_redis_cost(cfg: RedisCostConfig, progress: Any = None) -> RedisCostReport:
    cpus = cpu_split(cfg.pin)
    report = RedisCostReport(config=asdict(cfg), cpus=cpus)
    runs: dict[str, list[ModeResult]] = {mode: [] for mode in cfg.modes}
    for repeat in range(cfg.repeats):
        for mode in cfg.modes:  # alternating: a machine's drift hits every mode alike
            if progress:
                progress(
                    f"{mode} (run {repeat + 1}/{cfg.repeats}): {cfg.num_jobs} jobs x {cfg.max_tokens} tokens"
                )
            t0 = time.monotonic()
            result = run_mode(cfg, mode, cpus)
            runs[mode].append(result)
            if progress:
                progress(
                    f"{mode}: {result.per_token['cpu_us']:.2f} us of Redis CPU per token, done in "
                    f"{time.monotonic() - t0:.0f} s"
                )
    report.results = [median_of(runs[mode]) for mode in cfg.modes]
    return report
