#!/usr/bin/env python
"""What a job costs Redis in instructions: `rose bench redis`'s workload with redis-server run under valgrind's
callgrind, which counts the instructions Redis executes (user space; the kernel's share of a round trip is not in
them). A count repeats from run to run where this VM's CPU time swings by a quarter, so an A/B of two revisions
reads in one run of each.

    python benchmarks/redis_instructions.py [--num-jobs 200 --max-tokens 128 --modes streamed,not-streamed]
    PYTHONPATH=/path/to/other/checkout python /path/to/other/checkout/benchmarks/redis_instructions.py  # its code

Per mode: a fresh redis-server under callgrind and a real rose-worker (tiny-llama, CPU), a warm-up job, then the
counters zeroed (`callgrind_control -z`), `--num-jobs` jobs enqueued at once and waited for, the counters dumped.
Prints instructions a job and a token, in all and less Redis's timer (`serverCron`: memory statistics ten times a
second, whatever the load; under valgrind a run lasts longer, so it is counted apart), and Redis's commands a job.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rose.bench.redis_cost import NOT_STREAMED, STREAMED, RedisCostConfig, cpu_split, run_mode  # noqa: E402
from rose.harness.redis_server import RedisServerProcess  # noqa: E402


class Callgrind:
    """redis-server under callgrind (`binary`, a wrapper script), and the instructions of one window."""

    def __init__(self, directory: Path) -> None:
        self.out = directory / "callgrind.out"
        self.binary = directory / "redis-server"
        redis = shutil.which("redis-server")
        if redis is None or shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            raise SystemExit("needs redis-server, valgrind and callgrind_control on PATH")
        self.binary.write_text(
            f'#!/bin/sh\nexec valgrind --tool=callgrind --callgrind-out-file={self.out} {redis} "$@"\n'
        )
        self.binary.chmod(0o755)
        self.total = self.cron = 0
        self.dump = self.out

    @contextlib.contextmanager
    def window(self, server: RedisServerProcess) -> Iterator[None]:
        pid = str(server.pid)
        subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
        yield
        subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
        # valgrind writes the dump once the server next runs: its first part file, once its totals are in
        dump = self.out.with_name(self.out.name + ".1")
        deadline = time.monotonic() + 60
        while not (dump.exists() and b"\ntotals:" in dump.read_bytes()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"callgrind wrote no dump at {dump}")
            time.sleep(0.2)
        self.dump = dump
        self.total, self.cron = totals(dump)


def totals(dump: Path) -> tuple[int, int]:
    """(all instructions, those under serverCron) of a callgrind dump."""
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    total = re.search(r"^\s*([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", annotated, re.M)
    cron = re.search(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+\S*:serverCron ", annotated, re.M)
    if total is None:
        raise RuntimeError(f"no totals in {dump}")
    return (int(total[1].replace(",", "")), int(cron[1].replace(",", "")) if cron else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-jobs", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--modes", default=f"{STREAMED},{NOT_STREAMED}")
    p.add_argument("--worker-args", default="", help="more rose-worker flags, e.g. '--intake-policy fcfs'")
    p.add_argument(
        "--keep", default="", help="a folder to keep each mode's callgrind dump in (callgrind_annotate)"
    )
    args = p.parse_args()
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    cfg = RedisCostConfig(
        num_jobs=args.num_jobs,
        max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs,
        modes=modes,
        worker_args=tuple(args.worker_args.split()),
        idle_s=0.5,
    )
    print(f"{args.num_jobs} jobs x {args.max_tokens} tokens, tiny-llama, Redis under callgrind")
    with tempfile.TemporaryDirectory(prefix="rose-callgrind-") as tmp:
        for mode in modes:
            (Path(tmp) / mode).mkdir()
            grind = Callgrind(Path(tmp) / mode)
            result = run_mode(cfg, mode, cpu_split(True), redis_binary=str(grind.binary), window=grind.window)
            jobs, tokens = result.jobs, result.tokens
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(grind.dump, Path(args.keep) / f"callgrind.{mode}")
            print(
                f"{mode}: {grind.total / jobs:,.0f} instructions a job ({grind.total / tokens:,.0f} a token), "
                f"{(grind.total - grind.cron) / jobs:,.0f} less the timer; "
                f"{result.per_job['commands']:.1f} commands a job"
            )


if __name__ == "__main__":
    main()
