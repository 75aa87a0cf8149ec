"""What the benchmark scripts' tests share: a script of benchmarks/ run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run_benchmark(script: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.fixture
def run_benchmark() -> Callable[..., list[str]]:
    """`run_benchmark("bench_x.py", *args)`: benchmarks/bench_x.py run with `args` in a fresh interpreter (it must
    exit 0): the lines it printed."""
    return _run_benchmark
