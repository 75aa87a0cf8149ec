"""benchmarks/stress_full.py on a tiny input: a real rose-worker against a real redis-server that refuses every write,
or some, for two seconds mid-run; the script says what Redis refused and received, and every job audits clean
after."""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


@pytest.mark.parametrize("margin", [0, 100_000])
def test_stress_full_reports_what_a_full_redis_refused_and_no_job_is_wrong(run_benchmark, margin):
    """margin 0: every write refused; 100 KB: Redis at its limit, taking some writes and refusing others."""
    args = ["--jobs", "160", "--tokens", "32", "--full-s", "2", "--margin", str(margin)]
    lines = run_benchmark("stress_full.py", *args)
    full = "every write refused" if not margin else f"{margin:,} bytes of room"
    m = re.match(rf"full 2 s \({full}\): (\d+) commands refused for memory, ([\d.]+) MB received", lines[0])
    assert m, lines
    # the worker went on writing, and Redis refused: a heartbeat, a take, events, results
    assert int(m[1]) > 0
    assert re.fullmatch(r"\d+ jobs finished while full; the other \d+ in [\d.]+ s after", lines[1]), lines
    assert lines[2] == "160 jobs, 0 bad; worker alive: True", lines
