"""`rose bench redis` and `rose bench fleet`: Redis's accounting between snapshots, the engine stand-in's pace, the
saturation arithmetic, and both benchmarks end to end on a tiny workload (real redis-server, real workers)."""

from __future__ import annotations

import json
import time

import pytest

from rose.bench import redis_meter
from rose.bench.fleet import FleetPoint, FleetReport
from rose.bench.redis_cli import fleet_main, redis_main
from rose.bench.sim_engine import LATENCY_PROMPT, SimEngine, produced_ms
from rose.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)


def test_usage_counts_what_redis_did_between_two_snapshots(new_redis_server):
    r = new_redis_server.client()  # a server of its own: nobody else's commands in between
    a = redis_meter.snapshot(r)
    # one round trip, 100 commands: under redis-py's 6,000-byte chunk, so that Redis reads them in one go (larger
    # pipelines are sent in several writes, which a busy machine may deliver as several reads)
    with r.pipeline(transaction=False) as pipe:
        for i in range(100):
            pipe.set(f"k{i}", "x" * 10)
        pipe.execute()
    b = redis_meter.snapshot(r)
    used = redis_meter.usage(a, b, idle_cpu_per_s=0.0)
    assert used.commands == 100 and used.reads == 1  # the snapshots' own INFO left out
    assert used.commandstats["set"]["calls"] == 100 and used.memory > 100 * 10
    assert used.net_cpu_s == used.cpu_s >= 0
    per = used.per(100)
    assert per["commands"] == 1.0 and per["bytes"] == used.memory / 100
    assert redis_meter.usage(a, b, idle_cpu_per_s=1e9).net_cpu_s == 0  # idle never makes it negative


def test_usage_takes_out_the_latency_histogram_redis_makes_at_a_commands_first_call(new_redis_server):
    """Redis 7 allocates a histogram for each command at its first call, once a server: not a workload's memory."""
    r = new_redis_server.client()
    histogram = redis_meter.histogram_bytes(r)
    tracking = bool(r.info("latencystats"))  # Redis 7's latency-tracking (on by default); nothing before 7
    assert (histogram > 10_000) == tracking
    a = redis_meter.snapshot(r)
    r.pfadd("hll", "a")  # a command nobody called yet: a small key, and its histogram
    b = redis_meter.snapshot(r)
    used = redis_meter.usage(a, b, histogram=histogram)
    assert used.histograms == (1 if tracking else 0)
    assert b.memory - a.memory - used.memory == histogram * used.histograms
    assert 0 < used.memory < 1000  # the key alone
    a = redis_meter.snapshot(r)
    r.pfadd("hll2", "b")  # called before: no new histogram
    assert redis_meter.usage(a, redis_meter.snapshot(r), histogram=histogram).histograms == 0


def test_memory_by_family_groups_keys_by_their_first_two_parts(new_redis_server):
    r = new_redis_server.client()
    for i in range(3):
        r.xadd(f"rose:stream:{i}", {"event": "{}"})
    r.set("rq:job:a", "x")
    families = redis_meter.memory_by_family(r)
    assert families["rose:stream"]["keys"] == 3 and families["rq:job"]["keys"] == 1
    assert families["rose:stream"]["bytes"] == 3 * families["rose:stream"]["bytes_per_key"] > 0


def test_the_stand_in_generates_at_its_pace_and_times_its_probes():
    engine = SimEngine(max_num_seqs=3, steps_per_s=50.0)
    engine.add_request("a", "some prompt", SamplingParams(max_tokens=5))
    engine.add_request("b", LATENCY_PROMPT, SamplingParams(max_tokens=5))
    engine.add_request("c", "x", SamplingParams(max_tokens=5))
    engine.add_request("d", "y", SamplingParams(max_tokens=5))  # waits: three at a time
    assert engine.num_running == 3 and engine.num_waiting == 1 and engine.num_admittable() == 0
    t0 = time.monotonic()
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "b":
                assert abs(out.new_token_ids[0] - produced_ms(time.time())) < 1000
            if out.finished:
                finished.append(out.output)
    assert time.monotonic() - t0 >= 9 / 50  # ten steps, at most 50 a second
    assert sorted(o.request_id for o in finished) == ["a", "b", "c", "d"]
    assert all(len(o.token_ids) == 5 and o.text for o in finished)


def point(mode: str, workers: int, cpu: float) -> FleetPoint:
    return FleetPoint(mode, workers, 5000.0 * workers, 5120.0 * workers, cpu, cpu, 0.0, 0.0)


def test_saturation_is_the_least_squares_slope_extended_to_one_core():
    report = FleetReport(config={"modes": ["streamed"]}, cpus={})
    report.points = [point("streamed", 1, 0.011), point("streamed", 2, 0.019), point("streamed", 4, 0.041)]
    sat = report.saturation("streamed")
    slope = (1 * 0.011 + 2 * 0.019 + 4 * 0.041) / (1 + 4 + 16)
    assert sat["cpu_per_worker"] == pytest.approx(slope)
    assert sat["workers"] == pytest.approx(1 / slope) and sat["tokens_per_s"] == pytest.approx(5000 / slope)
    assert report.saturation("mixed") == {}


def test_rose_bench_redis_end_to_end(tmp_path, capsys):
    out = tmp_path / "redis.json"
    argv = ["--num-jobs", "6", "--max-tokens", "8", "--max-num-seqs", "4", "--json-out", str(out), "--plain"]
    assert redis_main(argv) == 0
    report = json.loads(out.read_text())
    by_mode = {r["mode"]: r for r in report["results"]}
    assert set(by_mode) == {"streamed", "not-streamed"}
    for result in by_mode.values():
        assert result["tokens"] == 48 and result["per_token"]["commands"] > 0
        assert result["memory_by_family"]["rose:stream"]["keys"] == 7  # the warm-up job's and the six
    # a job not streamed writes no token events: fewer commands than a streamed one
    assert by_mode["not-streamed"]["per_job"]["commands"] < by_mode["streamed"]["per_job"]["commands"]
    assert "What a token costs Redis" in capsys.readouterr().out


def test_rose_bench_fleet_end_to_end(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    argv = ["--workers", "1", "--modes", "streamed", "--max-num-seqs", "16", "--max-tokens", "16"]
    argv += ["--warmup", "1", "--window", "2", "--latency", "1", "--json-out", str(out), "--plain"]
    assert fleet_main(argv) == 0
    report = json.loads(out.read_text())
    (p,) = report["points"]
    assert p["workers"] == 1 and p["tokens_per_s"] > 0 and p["commands_per_s"] > 0
    assert p["event_latency_ms"]["p50"] >= 0 and report["saturation"]["streamed"]["workers"] > 0
    assert "Fleet on one Redis" in capsys.readouterr().out


def test_bad_modes_are_one_clear_line(capsys):
    assert redis_main(["--modes", "sometimes"]) == 2
    assert "--modes takes" in capsys.readouterr().err
