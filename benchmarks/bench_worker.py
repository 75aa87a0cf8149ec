#!/usr/bin/env python
"""rose end to end (a real redis-server + a rose-worker process) vs rose's engine alone, plus latency under load.

python benchmarks/bench_worker.py --markdown                       # 128 requests at once: worker vs engine alone
python benchmarks/bench_worker.py --rate 8 --latency-requests 64   # + TTFT / ITL / E2E under Poisson arrivals
python benchmarks/bench_worker.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rose.bench.cli import worker_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(worker_main(prog="bench_worker.py"))
