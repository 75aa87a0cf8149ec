#!/usr/bin/env python
"""Decode-step time of rose's engine vs batch size and context length (with an optional profile of one step).

python benchmarks/bench_step.py                        # batch 1..128 at ctx 256; ctx 128..2048 at batch 64
python benchmarks/bench_step.py --profile --profile-batch 64 --profile-context 512
python benchmarks/bench_step.py --help
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rose.bench.cli import step_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(step_main(prog="bench_step.py"))
