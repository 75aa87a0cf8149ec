"""benchmarks/bench_lora.py on a tiny workload (issue 27's benchmark): it runs, and prints its three runs, the ratio
against the base model alone, and the adapter read and swap latencies. Structure only, never timings."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("peft")


def test_bench_lora_prints_its_ratio_and_the_read_and_swap_latencies(run_benchmark):
    args = ["--batch", "4", "--adapters", "2", "--max-tokens", "2", "--repeats", "1", "--prompt-len", "4"]
    lines = run_benchmark("bench_lora.py", *args)
    assert lines[0].startswith("tiny-llama (hidden 256, 4 layers), batch 4, 2 adapters of rank 16"), lines[0]
    for run in ("base alone", "LoRA engine, base requests", "mixed adapters"):
        assert any(
            re.fullmatch(rf"\| {run} \| [\d,]+ \| [\d,]+ \| \d\.\d{{3}} \|", line) for line in lines
        ), run
    assert any(
        re.fullmatch(r"target: mixed >= 0\.85 x base alone: (PASS|FAIL) \(\d+\.\d{3}\)", line)
        for line in lines
    ), "\n".join(lines)
    assert any(
        re.fullmatch(
            r"adapter read from disk and checked: \d+\.\d ms each; swap into slot \d+ \(LRU\): \d+\.\d\d ms",
            line,
        )
        for line in lines
    ), "\n".join(lines)
    # both adapters loaded by the warm-up; the swap's extra adapter evicted one of them
    assert lines[-1] == "loads 3, evictions 1"
