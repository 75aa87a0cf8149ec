"""Benchmarks of rose's engine against transformers' baselines (static batching, continuous batching).

Entry points: `rose.bench.cli.engine_main` / `step_main` (also `benchmarks/bench_engine.py`, `bench_step.py`);
library functions: `run_engine_bench`, `run_step_bench`, `make_workload`.
"""

from rose.bench.engine_bench import EngineBenchConfig, EngineBenchReport, run_engine_bench
from rose.bench.step_bench import StepBenchConfig, StepBenchReport, run_step_bench
from rose.bench.workload import BenchRequest, Workload, make_workload

__all__ = [
    "BenchRequest",
    "EngineBenchConfig",
    "EngineBenchReport",
    "StepBenchConfig",
    "StepBenchReport",
    "Workload",
    "make_workload",
    "run_engine_bench",
    "run_step_bench",
]
