"""benchmarks/bench_fair_take.py on a tiny input: it takes every job both ways on a real redis-server and prints
each policy's Redis CPU and commands a job and their ratio; the commands (Redis's count, the same from run to run)
are compared, never the timings."""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_bench_fair_take_prints_both_policies_and_their_ratio(run_benchmark):
    args = ["--jobs", "24", "--first", "8", "--batch", "3", "--tenants", "2", "--repeats", "2"]
    lines = run_benchmark("bench_fair_take.py", *args)
    commands = {}
    for policy, line in zip(("fair", "fcfs"), lines[:2], strict=True):
        m = re.fullmatch(
            rf"{policy}: Redis CPU [\d.]+ µs a job \(runs [\d.]+ / [\d.]+\), ([\d.]+) commands a job", line
        )
        assert m, line
        commands[policy] = float(m[1])
    # fcfs: a script a take, LMOVE and HGETALL a job; fair: a look and a take, the index's writes and reads besides
    assert commands["fcfs"] < 3 < commands["fair"] < 30
    assert re.fullmatch(r"fair / fcfs: \d+\.\d\d", lines[2])
