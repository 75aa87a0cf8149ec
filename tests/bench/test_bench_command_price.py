"""benchmarks/bench_command_price.py on a tiny input: it prices a command sent three ways and a finished job's streams
written three ways on a real redis-server; the memory (Redis's count, the same from run to run) is compared, never
the timings."""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_bench_command_price_prints_each_way_and_what_storing_at_size_saves(run_benchmark):
    lines = run_benchmark("bench_command_price.py", "--jobs", "64", "--batch", "16", "--repeats", "1")
    for way, line in zip(("pipeline", "MULTI/EXEC", "script"), lines[:3], strict=True):
        assert re.fullmatch(rf"{way}: [\d.]+ µs a command \(runs [\d.]+\)", line), line
    stored = {}
    for way, line in zip(("as written", "copied", "restored"), lines[3:], strict=True):
        m = re.fullmatch(rf"{way}: [\d.]+ µs a job, ([\d,]+) bytes a job \(two streams\)", line)
        assert m, line
        stored[way] = int(m[1].replace(",", ""))
    # each stream's first node is given 4 KB at its first entry; copied or restored, the two are stored at their size
    assert stored["as written"] - stored["copied"] > 4096
    assert stored["restored"] == stored["copied"]
    assert len(lines) == 6
