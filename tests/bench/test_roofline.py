"""The memory-bandwidth floor of `rose bench step`, the `qwen2.5-0.5b` preset and the --device / --dtype flags.

The 0.5B preset is only ever built on the meta device here (shapes, no memory, no time)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rose.bench.baselines import HFContinuousBatchingConfig, _resolve_cb_config, best_cb_attention
from rose.bench.cli import build_engine_parser, build_step_parser, engine_config_from_args, step_main
from rose.bench.common import environment, load_model, prompt_vocab_size
from rose.bench.roofline import (
    Roofline,
    WeightBytes,
    decode_weight_bytes,
    kv_bytes_per_token,
    measure_copy_bandwidth,
)
from rose.bench.step_bench import StepBenchConfig, _max_model_len
from rose.bench.workload import make_workload
from rose.engine.presets import build_preset, preset_config

F32 = 4


def llama_layer_params(
    hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool
) -> int:
    """One decoder layer by hand: q, k, v, o projections, gate/up/down MLP, two RMSNorm weights."""
    q = hidden * heads * head_dim + (heads * head_dim if qkv_bias else 0)
    kv = 2 * (hidden * kv_heads * head_dim + (kv_heads * head_dim if qkv_bias else 0))
    o = heads * head_dim * hidden
    return q + kv + o + 3 * hidden * inter + 2 * hidden


def test_qwen2_5_0_5b_preset_has_the_published_dimensions():
    c = preset_config("qwen2.5-0.5b")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (896, 4864, 24)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (14, 2, 151936)
    assert c.tie_word_embeddings and c.max_position_embeddings == 32768 and c.rms_norm_eps == 1e-6
    assert c.rope_parameters["rope_theta"] == 1000000.0 and not c.use_sliding_window
    model, tok = build_preset("qwen2.5-0.5b", device="meta")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = 24 * llama_layer_params(896, 4864, 14, 2, 64, qkv_bias=True) + 896 + 151936 * 896
    assert expected == 494_032_768  # Qwen2.5-0.5B's published 0.49B
    assert sum(p.numel() for p in model.parameters()) == expected
    # the in-memory tokenizer is smaller: benchmark prompts stay inside it so every system accepts them
    assert len(tok) == 8192 and prompt_vocab_size("qwen2.5-0.5b") == 8192 == prompt_vocab_size("tiny-llama")


def test_weight_bytes_of_untied_tiny_llama_by_hand():
    model, _ = build_preset("tiny-llama", device="meta")
    w = decode_weight_bytes(model)
    layers = 4 * llama_layer_params(256, 1024, 8, 4, 32, qkv_bias=False)
    lm_head = 8192 * 256
    rotary = 2 * (32 // 2) * F32  # inv_freq and original_inv_freq, head_dim / 2 floats each
    assert (
        w.parameters == (layers + 256 + lm_head) * F32
    )  # + final norm; the input embedding is only gathered
    assert w.embeddings_not_counted == 8192 * 256 * F32 and not w.tied_embeddings
    assert w.lm_head == lm_head * F32
    assert w.buffers == rotary and w.total == w.parameters + rotary
    assert kv_bytes_per_token(build_preset("tiny-llama")[0], torch.float32) == 4 * 2 * 4 * 32 * F32
    half = decode_weight_bytes(model.to(torch.bfloat16))
    assert half.parameters == w.parameters // 2


def test_weight_bytes_of_tied_tiny_qwen2_count_the_shared_table_once():
    model, _ = build_preset("tiny-qwen2", device="meta")
    w = decode_weight_bytes(model)
    layers = 4 * llama_layer_params(256, 1024, 8, 2, 32, qkv_bias=True)
    assert w.tied_embeddings and w.embeddings_not_counted == 0
    assert w.parameters == (layers + 256 + 8192 * 256) * F32  # the tied table once, as the LM head
    assert w.lm_head == 8192 * 256 * F32
    assert kv_bytes_per_token(build_preset("tiny-qwen2")[0], torch.bfloat16) == 4 * 2 * 2 * 32 * 2


def test_gpt2_position_table_is_not_counted_but_its_tied_lm_head_is():
    model, _ = build_preset("tiny-gpt2", device="meta")
    w = decode_weight_bytes(model)
    assert w.tied_embeddings and w.embeddings_not_counted == 4096 * 256 * F32  # wpe: n_positions x n_embd
    every = sum(p.nbytes for p in model.parameters())
    assert w.parameters == every - w.embeddings_not_counted


def test_floor_is_bytes_over_bandwidth():
    weights = WeightBytes(
        total=1_000_000,
        parameters=999_872,
        buffers=128,
        lm_head=0,
        embeddings_not_counted=0,
        tied_embeddings=False,
    )
    r = Roofline(bandwidth_bytes_per_s=1e9, weights=weights, kv_bytes_per_token=4096, copy={})
    assert r.kv_bytes(64, 100.5) == 64 * 100.5 * 4096
    assert r.floor_ms(64, 100.5) == pytest.approx((1_000_000 + 64 * 100.5 * 4096) / 1e9 * 1e3)
    assert r.floor_ms(1, 0) == pytest.approx(1.0)


def test_copy_bandwidth_is_positive_and_finite():
    bw = measure_copy_bandwidth("cpu", nbytes=4 * 2**20, repeats=2)
    assert math.isfinite(bw["bytes_per_s"]) and bw["bytes_per_s"] > 0
    assert bw["copy_bytes"] == 4 * 2**20 and bw["best_copy_s"] > 0
    with pytest.raises(ValueError):
        measure_copy_bandwidth("cpu", nbytes=0)


def test_gpu_command_sizes_the_store_sanely():
    """`rose bench step --model qwen2.5-0.5b --device cuda --dtype bfloat16 --batch-sizes 1,16,64,256`."""
    args = build_step_parser().parse_args(
        ["--model", "qwen2.5-0.5b", "--device", "cuda", "--dtype", "bfloat16", "--batch-sizes", "1,16,64,256"]
    )
    assert (args.device, args.dtype, args.batch_sizes) == ("cuda", "bfloat16", (1, 16, 64, 256))
    cfg = StepBenchConfig(model=args.model, batch_sizes=args.batch_sizes)
    max_len = _max_model_len(cfg, preset_config("qwen2.5-0.5b").max_position_embeddings)
    assert max(cfg.context_lens) + cfg.warmup_steps + cfg.timed_steps < max_len <= 4096
    store = 256 * max_len * 24 * 2 * 2 * 64 * 2  # 24 layers x K and V x 2 KV heads x head dim 64, bf16
    assert store < 8 * 2**30  # bf16 KV for 256 rows: well inside one GPU next to 1 GB of weights


def test_device_and_dtype_flags_reach_the_configs():
    cfg = engine_config_from_args(build_engine_parser().parse_args([]))
    assert (cfg.device, cfg.dtype, cfg.rose.device, cfg.rose.dtype) == ("cpu", "float32", "cpu", "float32")
    cfg = engine_config_from_args(build_engine_parser().parse_args(["--device", "cuda:1", "--dtype", "bf16"]))
    assert (cfg.device, cfg.dtype, cfg.rose.device, cfg.rose.dtype) == ("cuda:1", "bf16", "cuda:1", "bf16")
    assert build_step_parser().parse_args(["--device", "auto"]).device == "auto"
    for bad in (["--dtype", "int8"], ["--device", "tpu:x"]):
        with pytest.raises(SystemExit):
            build_engine_parser().parse_args(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys):
    assert step_main(["--device", "cuda", "--json-out", ""]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_cb_defaults_per_device():
    wl = make_workload(4, (4, 12), (2, 6), vocab_size=8192, seed=1)
    cpu = _resolve_cb_config(wl, HFContinuousBatchingConfig(), torch.device("cpu"))
    assert (cpu["max_batch_tokens"], cpu["max_requests_per_batch"]) == (512, 24)  # as measured on CPU
    assert cpu["use_cuda_graph"] is False and cpu["use_async_batching"] is False
    assert best_cb_attention(torch.device("cpu")) is None  # the model's SDPA
    gpu = _resolve_cb_config(wl, HFContinuousBatchingConfig(), torch.device("cuda"))
    assert (gpu["max_batch_tokens"], gpu["max_requests_per_batch"]) == (2048, 4)  # every request
    assert gpu["use_cuda_graph"] is None and gpu["use_async_batching"] is None  # transformers decides
    every = _resolve_cb_config(wl, HFContinuousBatchingConfig(max_requests_per_batch=0), torch.device("cpu"))
    assert every["max_requests_per_batch"] == 4


def test_load_model_casts_the_same_weights():
    fp32, _ = load_model("tiny-llama")
    bf16, _ = load_model("tiny-llama", dtype="bfloat16")
    w32, w16 = fp32.model.layers[0].mlp.up_proj.weight, bf16.model.layers[0].mlp.up_proj.weight
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))
    env = environment(torch.device("cpu"), torch.bfloat16)
    assert (env["device"], env["dtype"], env["gpu_name"]) == ("cpu", "bfloat16", None)


def test_step_bench_reports_the_floor_in_bfloat16(tmp_path, capsys):
    argv = ["--batch-sizes", "1,4", "--batch-sweep-context", "8", "--context-lens", "16", "--context-sweep-batch",
            "4", "--warmup-steps", "1", "--timed-steps", "3", "--dtype", "bfloat16", "--copy-mib", "8",
            "--json-out", str(tmp_path / "step.json"), "--plain"]  # fmt: skip
    assert step_main(argv) == 0
    out = capsys.readouterr().out
    assert "memory-bandwidth floor" in out and "floor / median" in out
    report = json.loads((tmp_path / "step.json").read_text())
    assert report["environment"]["dtype"] == "bfloat16" and report["environment"]["device"] == "cpu"
    assert report["config"]["llm_kwargs"]["dtype"] == "bfloat16"
    roof = report["roofline"]
    assert roof["kv_bytes_per_token"] == 4 * 2 * 4 * 32 * 2  # bf16 K/V
    assert roof["bandwidth_gb_s"] > 0 and roof["copy"]["copy_bytes"] == 8 * 2**20
    weights = roof["weight_bytes"]["total"]
    assert weights == roof["weight_bytes"]["parameters"] + roof["weight_bytes"]["buffers"]
    assert [(p["batch_size"], p["context_len"]) for p in report["points"]] == [(1, 8), (4, 8), (4, 16)]
    for p in report["points"]:
        assert p["kv_context"] == pytest.approx(p["mean_context"] + 1)  # averaged over the 3 timed steps
        floor_bytes = weights + p["batch_size"] * p["kv_context"] * roof["kv_bytes_per_token"]
        assert p["weight_bytes"] == weights and p["kv_bytes"] == pytest.approx(floor_bytes - weights)
        assert p["floor_ms"] == pytest.approx(floor_bytes / (roof["bandwidth_gb_s"] * 1e9) * 1e3)
        assert p["floor_fraction_median"] == pytest.approx(p["floor_ms"] / p["median_ms"])
        assert p["floor_fraction_best"] == pytest.approx(p["floor_ms"] / p["min_ms"])
        assert 0 < p["floor_fraction_median"] <= p["floor_fraction_best"]
