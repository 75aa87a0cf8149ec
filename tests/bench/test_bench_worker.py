"""Smoke test of `rose bench worker` on a tiny workload: structure, token counts, percentiles; never timings."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from rose.bench.cli import build_worker_parser, worker_main
from rose.bench.latency import percentiles

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); it has exited all the same.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_percentiles_are_ordered():
    p = percentiles([5.0, 1.0, 3.0, 2.0, 4.0, 100.0])
    assert p["count"] == 6 and p["min"] == 1.0 and p["max"] == 100.0
    assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"]
    assert percentiles([]) == {"count": 0}


def test_worker_parser_defaults_match_the_issue():
    args = build_worker_parser().parse_args([])
    assert args.num_requests == 128 and args.max_num_seqs == 128
    assert args.prompt_len_range == (16, 128) and args.output_len_range == (16, 128)
    assert args.rate == 0.0 and not args.skip_engine and args.repeats == 1
    assert (args.device, args.dtype) == ("cpu", "float32")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_worker_bench_on_a_missing_gpu_is_a_clear_error(capsys):
    assert worker_main(["--device", "cuda", "--dtype", "bfloat16", "--json-out", ""]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_worker_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "worker.json"
    argv = ["--num-requests", "6", "--prompt-len-range", "4,12", "--output-len-range", "4,4"]
    argv += ["--rate", "20", "--latency-requests", "4", "--warmup-requests", "2", "--threads", "1"]
    argv += ["--repeats", "2", "--json-out", str(out), "--plain", "--markdown"]
    assert worker_main(argv) == 0
    text = capsys.readouterr().out
    assert "rose-worker" in text and "rose-engine" in text and "TTFT" in text
    assert "median of the pairs" in text

    report = json.loads(out.read_text())
    assert report["benchmark"] == "worker"
    assert report["workload"]["requested_tokens"] == 6 * 4
    for name in ("rose-worker", "rose-engine"):
        s = report["systems"][name]
        assert s["token_counts_ok"] and s["generated_tokens"] == 24 and s["num_requests"] == 6
        assert s["wall_s"] > 0
        assert len(s["extra"]["pass_wall_s"]) == 2 and s["wall_s"] in s["extra"]["pass_wall_s"]
    assert report["worker_vs_engine_tokens_per_s"] > 0
    pairs = report["worker_vs_engine_per_pass"]
    assert len(pairs) == 2 and report["worker_vs_engine_paired_median"] == pytest.approx(sum(pairs) / 2)

    lat = report["latency"]
    assert lat["completed"] == 4 and lat["token_counts_ok"]
    assert lat["received_tokens"] == lat["requested_tokens"] == 16
    for key in ("ttft_ms", "itl_ms_per_event", "tpot_ms_per_token", "e2e_ms"):
        p = lat[key]
        assert p["count"] > 0
        assert 0 <= p["p50"] <= p["p90"] <= p["p99"]
    assert lat["ttft_ms"]["p50"] <= lat["e2e_ms"]["max"]

    procs = report["processes"]
    command = procs["worker_command"]  # the worker runs where the engine-alone pass does
    assert (
        command[command.index("--device") + 1] == "cpu" and command[command.index("--dtype") + 1] == "float32"
    )
    assert report["environment"]["device"] == "cpu" and report["environment"]["dtype"] == "float32"
    assert _gone(procs["worker_pid"]) and _gone(procs["redis_pid"])


def test_missing_redis_server_is_a_clear_error(monkeypatch, capsys):
    real_which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **k: None if name == "redis-server" else real_which(name)
    )
    assert worker_main(["--num-requests", "2", "--json-out", ""]) == 2
    assert "redis-server not found" in capsys.readouterr().err
