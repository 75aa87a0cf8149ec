"""benchmarks/bench_event_cpu.py and bench_event_bytes.py on tiny inputs: they run on a real redis-server and print
their table; the bytes compare the forms (a stream's bytes are Redis's allocation, the same from run to run), never
the timings."""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_bench_event_cpu_prints_each_forms_time_and_bytes(run_benchmark):
    lines = run_benchmark("bench_event_cpu.py", "--jobs", "4", "--events", "40", "--repeats", "1")
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


def test_bench_event_bytes_prints_a_row_per_count_of_events(run_benchmark):
    lines = run_benchmark("bench_event_bytes.py", "--events", "17,49")
    assert [line.split()[0] for line in lines[1:]] == ["18", "50"]
    for line in lines[1:]:
        numbers = [int(x.replace(",", "")) for x in line.split()[1:]]
        json_id_stored, json_stored, fields_stored = numbers[1], numbers[3], numbers[5]
        assert fields_stored < json_stored < json_id_stored
