"""benchmarks/bench_event_cpu.py and bench_event_bytes.py on tiny inputs: they run on a real redis-server and print
their table; the bytes compare the forms (a stream's bytes are Redis's allocation, the same from run to run), never
the timings."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_bench_event_cpu_prints_each_forms_time_and_bytes():
    lines = run("bench_event_cpu.py", "--jobs", "4", "--events", "40", "--repeats", "1")
    assert lines[0] == "4 jobs x 40 token events of 4 tokens; medians of 1"
    rows = {
        m[1]: m
        for line in lines
        if (m := re.fullmatch(r" *(json|fields) +([\d.]+) +[\d., ]+ +([\d,]+)", line))
    }
    assert set(rows) == {"json", "fields"}
    stored = {form: int(m[3].replace(",", "")) for form, m in rows.items()}
    assert stored["fields"] < stored["json"] * 0.75  # a token event's JSON keys are not stored
    assert re.fullmatch(r"fields / json: \d+\.\d\d of the time", lines[-1])


def test_bench_event_bytes_prints_a_row_per_count_of_events():
    lines = run("bench_event_bytes.py", "--events", "17,49")
    assert [line.split()[0] for line in lines[1:]] == ["18", "50"]
    for line in lines[1:]:
        numbers = [int(x.replace(",", "")) for x in line.split()[1:]]
        json_id_stored, json_stored, fields_stored = numbers[1], numbers[3], numbers[5]
        assert fields_stored < json_stored < json_id_stored
