"""benchmarks/stress_full.py on a tiny input: a real rose-worker against a real redis-server that refuses every write
for two seconds mid-run; the script says what Redis refused and received, and every job audits clean after."""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_stress_full_reports_what_a_full_redis_refused_and_no_job_is_wrong(run_benchmark):
    lines = run_benchmark("stress_full.py", "--jobs", "80", "--tokens", "32", "--full-s", "2")
    m = re.match(
        r"full 2 s \(every write refused\): (\d+) commands refused for memory, ([\d.]+) MB received", lines[0]
    )
    assert m, lines
    assert (
        int(m[1]) > 0
    )  # the worker went on writing (and Redis refused): a heartbeat, a take, events, results
    assert re.fullmatch(r"\d+ jobs finished while full; the other \d+ in [\d.]+ s after", lines[1]), lines
    assert lines[2] == "80 jobs, 0 bad; worker alive: True", lines
