"""Smoke tests of the benchmarks on tiny workloads: structure and token accounting only, never timings."""

from __future__ import annotations

import json
import logging

import pytest

from rose.bench.baselines import (
    HFContinuousBatchingConfig,
    StaticBatchingConfig,
    run_hf_continuous_batching,
    run_static_batching,
)
from rose.bench.cli import build_engine_parser, engine_config_from_args, engine_main, step_main
from rose.bench.common import count_tokens, load_model
from rose.bench.workload import RESERVED_IDS, make_workload

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


RESULT_KEYS = {
    "name",
    "num_requests",
    "prompt_tokens",
    "requested_tokens",
    "generated_tokens",
    "wall_s",
    "token_counts_ok",
    "settings",
    "extra",
    "requests_per_s",
    "generated_tokens_per_s",
}


def tiny_workload(n: int = 3, seed: int = 1):
    return make_workload(n, (4, 12), (2, 6), vocab_size=8192, seed=seed)


def test_workload_is_seeded_and_in_range():
    a, b = make_workload(20, (16, 128), (16, 128), seed=7), make_workload(20, (16, 128), (16, 128), seed=7)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.max_tokens for r in a.requests] == [r.max_tokens for r in b.requests]
    assert make_workload(20, seed=8).requests[0].prompt_token_ids != a.requests[0].prompt_token_ids
    for r in a.requests:
        assert 16 <= r.prompt_len <= 128 and 16 <= r.max_tokens <= 128
        assert all(RESERVED_IDS <= t < 8192 for t in r.prompt_token_ids)
    assert a.requested_tokens == sum(r.max_tokens for r in a.requests)
    assert len({r.request_id for r in a.requests}) == 20
    assert [r.request_id for r in a.head(2, "w-").requests] == ["w-req-0", "w-req-1"]


@pytest.mark.parametrize("bad", [(0, 5), (6, 5)])
def test_workload_rejects_bad_ranges(bad):
    with pytest.raises(ValueError):
        make_workload(2, bad, (1, 2))


def test_count_tokens_credits_only_what_was_asked():
    wl = tiny_workload(2)
    r0, r1 = wl.requests
    outputs = {r0.request_id: [5] * (r0.max_tokens + 3), r1.request_id: [5] * (r1.max_tokens - 1)}
    credited, ok, short = count_tokens(wl, outputs)
    assert credited == r0.max_tokens + r1.max_tokens - 1
    assert not ok and short == [r1.request_id]


def _check_result(result, wl):
    d = result.to_dict()
    assert set(d) >= RESULT_KEYS
    assert "outputs" not in d
    assert result.token_counts_ok
    assert result.generated_tokens == wl.requested_tokens
    assert result.num_requests == len(wl)
    assert result.wall_s > 0
    for req in wl.requests:
        assert len(result.outputs[req.request_id]) >= req.max_tokens
    json.dumps(d)


def test_static_batching_counts_requested_tokens_only():
    wl = tiny_workload(5)
    model, _ = load_model("tiny-llama")
    result = run_static_batching(model, wl, StaticBatchingConfig(batch_size=2))
    _check_result(result, wl)
    assert result.extra["num_batches"] == 3
    assert result.extra["tokens_generated_incl_surplus"] >= wl.requested_tokens


def test_hf_continuous_batching_counts_requested_tokens():
    wl = tiny_workload(4)
    model, _ = load_model("tiny-llama")
    result = run_hf_continuous_batching(
        model, wl, HFContinuousBatchingConfig(max_batch_tokens=64, warmup_requests=1)
    )
    _check_result(result, wl)
    assert all(len(result.outputs[r.request_id]) == r.max_tokens for r in wl.requests)
    assert model.config._attn_implementation == "sdpa"  # restored after the run


def test_engine_parser_defaults_match_the_issue():
    cfg = engine_config_from_args(build_engine_parser().parse_args([]))
    assert cfg.model == "tiny-llama" and cfg.num_requests == 128
    assert cfg.prompt_len_range == (16, 128) and cfg.output_len_range == (16, 128)
    assert cfg.static.batch_size == 16
    assert cfg.hf_cb == HFContinuousBatchingConfig()  # the flags' defaults are the library's
    assert set(cfg.systems) == {"rose", "hf-static", "hf-continuous-batching"}
    assert cfg.rose.detokenize is False  # token ids, like the baselines
    args = build_engine_parser().parse_args(["--prompt-len-range", "4:8", "--skip-hf-cb", "--skip-rose"])
    cfg = engine_config_from_args(args)
    assert cfg.prompt_len_range == (4, 8) and cfg.systems == ("hf-static",)
    assert engine_config_from_args(build_engine_parser().parse_args(["--detokenize"])).rose.detokenize


def _engine_argv(tmp_path, *extra):
    return [
        "--num-requests",
        "3",
        "--prompt-len-range",
        "4,10",
        "--output-len-range",
        "2,5",
        "--batch-size",
        "2",
        "--hf-cb-max-batch-tokens",
        "64",
        "--json-out",
        str(tmp_path / "engine.json"),
        "--plain",
        *extra,
    ]


def _check_engine_json(path, systems):
    report = json.loads(path.read_text())
    assert set(report["systems"]) == set(systems)
    for s in report["systems"].values():
        assert s["token_counts_ok"]
        for run in s["runs"]:
            assert run["generated_tokens"] == report["workload"]["requested_tokens"]
    assert report["environment"]["torch_num_threads"] >= 1
    return report


def test_engine_bench_baselines_only(tmp_path, capsys):
    assert engine_main(_engine_argv(tmp_path, "--skip-rose")) == 0
    out = capsys.readouterr().out
    assert "hf-static" in out and "hf-continuous-batching" in out
    report = _check_engine_json(tmp_path / "engine.json", ["hf-static", "hf-continuous-batching"])
    assert report["ratios"] == {}


def test_engine_bench_all_systems(tmp_path, capsys):
    assert engine_main(_engine_argv(tmp_path, "--repeats", "2")) == 0
    out = capsys.readouterr().out
    assert "rose/hf-static" in out
    report = _check_engine_json(tmp_path / "engine.json", ["rose", "hf-static", "hf-continuous-batching"])
    assert set(report["ratios"]) == {"rose/hf-static", "rose/hf-continuous-batching"}
    assert len(report["systems"]["rose"]["runs"]) == 2


def test_engine_bench_takes_a_config_or_a_checkpoint(tmp_path, capsys):
    """--model: a config.json (random weights, seed 0) or a checkpoint directory, for every system."""
    from rose.engine import presets

    config = tmp_path / "qwen" / "config.json"
    config.parent.mkdir()
    presets.preset_config("tiny-qwen2").to_json_file(config)
    checkpoint = tmp_path / "ckpt"
    model, tokenizer = presets.build_preset("tiny-gpt2")
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    for source, arch in ((config, "qwen2"), (checkpoint, "gpt2")):
        assert engine_main(_engine_argv(tmp_path, "--model", str(source))) == 0
        report = _check_engine_json(tmp_path / "engine.json", ["rose", "hf-static", "hf-continuous-batching"])
        assert report["config"]["model"] == str(source)
        assert load_model(str(source))[0].config.model_type == arch


@pytest.mark.parametrize(
    ("kind", "model_type", "fields", "reason"),
    [
        ("engine", "falcon", {"num_attention_heads": 4}, "falcon: its attention does not use transformers'"),
        (
            "step",
            "mamba",
            {"state_size": 4},
            "mamba: linear-attention / state-space layers keep a recurrent state",
        ),
    ],
)
def test_rose_bench_refuses_a_model_rose_cannot_serve(kind, model_type, fields, reason, tmp_path, capsys):
    """`rose bench` checks the model through the same probe as the worker and the LLM API, before measuring."""
    from transformers import AutoConfig

    from rose.cli import main

    config = tmp_path / model_type / "config.json"
    config.parent.mkdir()
    AutoConfig.for_model(
        model_type, hidden_size=32, num_hidden_layers=1, vocab_size=64, **fields
    ).to_json_file(config)
    step_argv = [
        "--model",
        str(config),
        "--batch-sizes",
        "1",
        "--context-lens",
        "16",
        "--batch-sweep-context",
        "8",
    ]
    argv = _engine_argv(tmp_path, "--model", str(config)) if kind == "engine" else step_argv
    assert main(["bench", kind, *argv]) == 2
    assert reason in capsys.readouterr().err


def test_step_bench_structure(tmp_path, capsys):
    argv = [
        "--batch-sizes",
        "1,2",
        "--batch-sweep-context",
        "8",
        "--context-lens",
        "8,16",
        "--context-sweep-batch",
        "2",
        "--warmup-steps",
        "1",
        "--timed-steps",
        "2",
        "--profile",
        "--profile-batch",
        "2",
        "--profile-context",
        "8",
        "--json-out",
        str(tmp_path / "step.json"),
        "--plain",
    ]
    assert step_main(argv) == 0
    report = json.loads((tmp_path / "step.json").read_text())
    points = report["points"]
    assert [(p["sweep"], p["batch_size"], p["context_len"]) for p in points] == [
        ("batch", 1, 8),
        ("batch", 2, 8),
        ("context", 2, 8),
        ("context", 2, 16),
    ]
    for p in points:
        assert len(p["step_ms"]) == 2 and p["pure_decode"]
        assert p["num_running"] == p["batch_size"]
    assert {"fixed_ms", "per_seq_ms", "per_cached_token_us", "r2"} <= set(report["fit"])
    prof = report["profile"]
    assert prof["model_forward_ms_per_step"] > 0 and "top_ops" in prof
    assert "fit:" in capsys.readouterr().out


def test_engine_bench_structured_flag(tmp_path, capsys):
    argv = ["--structured", "--num-requests", "4", "--prompt-len-range", "4,8", "--output-len-range", "3,6"]
    assert engine_main([*argv, "--max-num-seqs", "4", "--json-out", str(tmp_path / "s.json"), "--plain"]) == 0
    out = capsys.readouterr().out
    assert "json-schema / unconstrained:" in out and "grammar compile: first" in out
    report = json.loads((tmp_path / "s.json").read_text())
    modes = report["modes"]
    assert set(modes) == {"unconstrained", "json-schema", "mixed", "mask-first"}
    # the bench schema keeps greedy rows writing to max_tokens: the modes generate the same token count
    assert len({m["passes"][0]["generated_tokens"] for m in modes.values()}) == 1
    assert modes["unconstrained"]["mean_masked_rows"] == 0 and modes["json-schema"]["mean_masked_rows"] > 0
    assert 0 < modes["mixed"]["mean_masked_rows"] < modes["mask-first"]["mean_masked_rows"]
    # by default a row is drawn, then checked; mask-first masks every constrained row of every step
    checked = modes["json-schema"]["passes"][0]
    assert checked["checked_rows"] > 0 and 0 < checked["refused_rows"] <= checked["checked_rows"]
    assert checked["masked_rows"] == checked["refused_rows"] and checked["check_s"] > 0
    first = modes["mask-first"]["passes"][0]
    assert first["checked_rows"] == 0 and first["masked_rows"] == first["generated_tokens"]
    assert first["check_s"] == 0
    assert "mask-first / unconstrained:" in out
    assert report["first_compile_s"] > report["cache_hit_s"] >= 0
    # the mask's cost per step: fill per row and apply, one sample per masking step of the pass
    constrained = modes["json-schema"]["passes"][0]
    assert (
        len(constrained["fill_us_per_row"]) == len(constrained["apply_us"]) == constrained["mask_calls"] > 0
    )
    p50, p99 = modes["json-schema"]["fill_us_per_row_p50_p99"]
    assert 0 < p50 <= p99 and "fill µs/row p50 / p99" in out
    assert modes["unconstrained"]["passes"][0]["fill_us_per_row"] == []
