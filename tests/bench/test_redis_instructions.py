"""benchmarks/redis_instructions.py on a tiny input: the workload runs with Redis under callgrind and the
instructions of the measured window are read from its dump (each figure checked for shape and order, never for
value)."""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("redis-server", "valgrind", "callgrind_control")),
    reason="needs redis-server and valgrind",
)


def test_redis_instructions_counts_a_jobs_instructions_with_and_without_the_timer(run_benchmark):
    lines = run_benchmark(
        "redis_instructions.py", "--num-jobs", "3", "--max-tokens", "8", "--modes", "not-streamed"
    )
    assert lines[0] == "3 jobs x 8 tokens, tiny-llama, Redis under callgrind"
    m = re.fullmatch(
        r"not-streamed: ([\d,]+) instructions a job \(([\d,]+) a token\), ([\d,]+) less the timer; "
        r"([\d.]+) commands a job",
        lines[1],
    )
    assert m, lines[1]
    job, token, less_timer = (int(m[i].replace(",", "")) for i in (1, 2, 3))
    assert 0 < less_timer < job and abs(token * 8 - job) <= 8  # Redis's timer ran in the window
    assert float(m[4]) > 10  # a job's take, start and retirement at least
    assert len(lines) == 2
