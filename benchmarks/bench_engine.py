#!/usr/bin/env python
"""rose's engine vs transformers' static batching and continuous batching, side by side in one process.

python benchmarks/bench_engine.py                      # the issue's workload: 128 requests, tiny-llama
python benchmarks/bench_engine.py --repeats 3 --json-out benchmarks/results/engine.json
python benchmarks/bench_engine.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rose.bench.cli import engine_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(engine_main(prog="bench_engine.py"))
