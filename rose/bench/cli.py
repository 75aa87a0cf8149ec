"""Argument parsers and entry points of `rose bench engine|step|worker`, shared by `benchmarks/bench_*.py`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rose.bench.baselines import HFContinuousBatchingConfig, StaticBatchingConfig
from rose.bench.cli_args import (
    add_common_args,
    add_target_args,
    parse_ints,
    parse_range,
    setup_logging,
    target_ok,
    where_ran,
)
from rose.bench.engine_bench import HF_CB, ROSE, STATIC, TARGET_RATIO, EngineBenchConfig, run_engine_bench
from rose.bench.latency import latency_rows
from rose.bench.report import (
    engine_rows,
    markdown_table,
    print_extras,
    print_table,
    roofline_summary,
    step_rows,
    write_json,
)
from rose.bench.rose_runner import RoseConfig
from rose.bench.step_bench import StepBenchConfig, run_step_bench
from rose.bench.structured_cli import structured_main
from rose.bench.worker_bench import TARGET_RATIO as WORKER_TARGET_RATIO
from rose.bench.worker_bench import WorkerBenchConfig, run_worker_bench, throughput_rows
from rose.bench.worker_procs import BenchProcessError

DEFAULT_ENGINE_JSON = "benchmarks/results/bench_engine.json"
DEFAULT_STEP_JSON = "benchmarks/results/bench_step.json"
DEFAULT_WORKER_JSON = "benchmarks/results/bench_worker.json"


def build_engine_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="rose's engine vs transformers' static batching and continuous batching (one process).",
    )
    add_common_args(p, DEFAULT_ENGINE_JSON)
    add_target_args(p)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len-range", type=parse_range, default=(16, 128), metavar="LO,HI")
    p.add_argument(
        "--output-len-range", type=parse_range, default=(16, 128), metavar="LO,HI", help="max_tokens range"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="timed passes per system, round-robin; median reported"
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each pass wait up to SECONDS for other processes to leave the CPUs idle (shared machines)",
    )
    p.add_argument(
        "--structured",
        action="store_true",
        help="rose only: the workload unconstrained, every request constrained by a JSON schema, then half of "
        "them; throughput of each vs unconstrained, grammar compile time and the per-step mask cost",
    )
    p.add_argument(
        "--structured-outputs-backend",
        choices=["auto", "xgrammar", "guidance"],
        default="auto",
        help="rose's grammar engine (auto: guidance)",
    )
    p.add_argument("--skip-rose", action="store_true")
    p.add_argument("--skip-static", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true")
    g = p.add_argument_group("static batching (model.generate)")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument(
        "--static-sort", action="store_true", help="batch requests sorted by length (default: in order)"
    )
    g.add_argument("--static-cache", default=None, help="generate's cache_implementation (default: dynamic)")
    g = p.add_argument_group("transformers continuous batching")
    d = HFContinuousBatchingConfig()
    g.add_argument("--hf-cb-page-size", type=int, default=d.page_size)
    g.add_argument(
        "--hf-cb-num-blocks", type=int, default=None, help="default: room for every request at once"
    )
    g.add_argument(
        "--hf-cb-max-batch-tokens",
        type=int,
        default=d.max_batch_tokens,
        help="tokens per step (default: 512 on CPU, 2048 on CUDA)",
    )
    g.add_argument(
        "--hf-cb-max-requests",
        type=int,
        default=d.max_requests_per_batch,
        help="max requests per step (0: all; default: 24 on CPU, where transformers' CB gets slower with more, "
        "see benchmarks/README.md; all on CUDA)",
    )
    g.add_argument("--hf-cb-block-sharing", action="store_true", help="allow prefix block sharing")
    g = p.add_argument_group("rose")
    g.add_argument("--max-num-seqs", type=int, default=RoseConfig().max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    g.add_argument(
        "--detokenize",
        action="store_true",
        help="rose also detokenizes every token (the transformers baselines return token ids only)",
    )
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineBenchConfig:
    systems = [
        name
        for name, skip in ((ROSE, args.skip_rose), (STATIC, args.skip_static), (HF_CB, args.skip_hf_cb))
        if not skip
    ]
    return EngineBenchConfig(
        model=args.model,
        num_requests=args.num_requests,
        prompt_len_range=args.prompt_len_range,
        output_len_range=args.output_len_range,
        seed=args.seed,
        repeats=args.repeats,
        device=args.device,
        dtype=args.dtype,
        num_threads=args.threads,
        wait_idle_s=args.wait_idle,
        systems=tuple(systems),
        static=StaticBatchingConfig(
            batch_size=args.batch_size,
            sort_by_length=args.static_sort,
            cache_implementation=args.static_cache,
        ),
        hf_cb=HFContinuousBatchingConfig(
            page_size=args.hf_cb_page_size,
            num_blocks=args.hf_cb_num_blocks,
            max_batch_tokens=args.hf_cb_max_batch_tokens,
            max_requests_per_batch=args.hf_cb_max_requests,
            allow_block_sharing=args.hf_cb_block_sharing,
        ),
        rose=RoseConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            detokenize=args.detokenize,
            structured_outputs_backend=args.structured_outputs_backend,
            device=args.device,
            dtype=args.dtype,
        ),
    )


def engine_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_engine_parser(prog).parse_args(argv)
    setup_logging(args.verbose)
    if args.structured:
        return structured_main(args, engine_config_from_args(args))
    cfg = engine_config_from_args(args)
    if not cfg.systems:
        print("nothing to run: every system skipped", file=sys.stderr)
        return 2
    if not target_ok(cfg.device, cfg.dtype):
        return 2
    report = run_engine_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    wl, env = report.workload, report.environment
    title = (
        f"{cfg.model}: {wl['num_requests']} requests, prompts {cfg.prompt_len_range}, max_tokens "
        f"{cfg.output_len_range}, {wl['requested_tokens']} tokens requested; {where_ran(env)}, repeats {cfg.repeats}"
    )
    headers, rows = engine_rows(report)
    print_table(title, headers, rows, use_rich=not args.plain)
    for key, value in report.ratios.items():
        verdict = "meets" if value >= TARGET_RATIO else "BELOW"
        print(f"{key}: {value:.2f}x ({verdict} the {TARGET_RATIO:.0f}x target)")
    for key, value in report.agreement.items():
        print(
            f"greedy agreement {key}: {value['identical']:.0%} identical, {value['mean_prefix_share']:.0%} prefix"
        )
    print(f"load average before/after: {report.load_average['before']} / {report.load_average['after']}")
    print_extras(args.markdown, args.json_out, headers, rows, report.to_dict())
    ok = all(s.token_counts_ok for s in report.systems.values())
    return 0 if ok else 1


def build_step_parser(prog: str | None = None) -> argparse.ArgumentParser:
    d = StepBenchConfig()
    p = argparse.ArgumentParser(
        prog=prog, description="rose decode-step time vs batch size and context length."
    )
    add_common_args(p, DEFAULT_STEP_JSON)
    add_target_args(p)
    p.add_argument("--batch-sizes", type=parse_ints, default=d.batch_sizes, metavar="B,B,...")
    p.add_argument("--batch-sweep-context", type=int, default=d.batch_sweep_context)
    p.add_argument("--context-lens", type=parse_ints, default=d.context_lens, metavar="L,L,...")
    p.add_argument("--context-sweep-batch", type=int, default=d.context_sweep_batch)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--timed-steps", type=int, default=d.timed_steps)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument(
        "--copy-mib",
        type=int,
        default=None,
        help="size of the copy that measures the memory bandwidth (default: 256 on CPU, 1024 on CUDA)",
    )
    p.add_argument("--profile", action="store_true", help="split one decode step: model forward vs the rest")
    p.add_argument("--profile-batch", type=int, default=d.profile_batch)
    p.add_argument("--profile-context", type=int, default=d.profile_context)
    return p


def step_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_step_parser(prog).parse_args(argv)
    setup_logging(args.verbose)
    cfg = StepBenchConfig(
        model=args.model,
        batch_sizes=args.batch_sizes,
        batch_sweep_context=args.batch_sweep_context,
        context_lens=args.context_lens,
        context_sweep_batch=args.context_sweep_batch,
        warmup_steps=args.warmup_steps,
        timed_steps=args.timed_steps,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        copy_bytes=args.copy_mib * 2**20 if args.copy_mib else None,
        num_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens,
        profile=args.profile,
        profile_batch=args.profile_batch,
        profile_context=args.profile_context,
    )
    if not target_ok(cfg.device, cfg.dtype):
        return 2
    report = run_step_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    env = report.environment
    title = (
        f"{cfg.model} decode step (rose engine), {cfg.timed_steps} timed steps per point; {where_ran(env)}"
    )
    headers, rows = step_rows(report.points)
    print_table(title, headers, rows, use_rich=not args.plain)
    if report.roofline:
        print(roofline_summary(report.roofline, report.points))
    if report.fit:
        f = report.fit
        print(
            f"fit: step ms = {f['fixed_ms']:.2f} + {f['per_seq_ms']:.3f}·B + "
            f"{f['per_cached_token_us']:.4f} µs·B·ctx   (R² = {f['r2']:.3f})"
        )
    if report.profile:
        pr = report.profile
        print(
            f"profile at batch {pr['batch_size']}, ctx {pr['context_len']}: {pr['wall_ms_per_step']:.2f} ms/step, "
            f"model forward {pr['model_forward_ms_per_step']:.2f} ms, "
            f"outside forward {pr['outside_model_forward_ms_per_step']:.2f} ms"
        )
        print(pr["top_ops"])
    print_extras(args.markdown, args.json_out, headers, rows, report.to_dict())
    return 0


def build_worker_parser(prog: str | None = None) -> argparse.ArgumentParser:
    d = WorkerBenchConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description="rose end to end (redis-server + rose-worker process) vs the engine alone, "
        "plus latency under Poisson load (--rate).",
    )
    add_common_args(p, DEFAULT_WORKER_JSON)
    add_target_args(p)
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--prompt-len-range", type=parse_range, default=d.prompt_len_range, metavar="LO,HI")
    p.add_argument(
        "--output-len-range",
        type=parse_range,
        default=d.output_len_range,
        metavar="LO,HI",
        help="max_tokens range",
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument(
        "--rate", type=float, default=d.rate, help="req/s of the Poisson latency run (0: no latency run)"
    )
    p.add_argument("--latency-requests", type=int, default=d.latency_requests)
    p.add_argument("--warmup-requests", type=int, default=d.warmup_requests)
    p.add_argument("--skip-engine", action="store_true", help="no engine-alone run (no ratio)")
    p.add_argument(
        "--repeats",
        type=int,
        default=d.repeats,
        help="throughput passes of each, worker and engine alternating; medians compared",
    )
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per phase before giving up")
    return p


def worker_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_worker_parser(prog).parse_args(argv)
    setup_logging(args.verbose)
    if not target_ok(args.device, args.dtype):
        return 2
    cfg = WorkerBenchConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        num_requests=args.num_requests,
        prompt_len_range=args.prompt_len_range,
        output_len_range=args.output_len_range,
        seed=args.seed,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        rate=args.rate,
        latency_requests=args.latency_requests,
        skip_engine=args.skip_engine,
        repeats=args.repeats,
        warmup_requests=args.warmup_requests,
        timeout_s=args.timeout,
    )
    try:
        report = run_worker_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except BenchProcessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wl, env = report.workload, report.environment
    title = (
        f"{cfg.model}: {wl['num_requests']} requests at once, prompts {cfg.prompt_len_range}, max_tokens "
        f"{cfg.output_len_range}, {wl['requested_tokens']} tokens requested; {where_ran(env)}"
    )
    headers, rows = throughput_rows(report)
    print_table(title, headers, rows, use_rich=not args.plain)
    if report.ratio is not None:
        verdict = "meets" if report.ratio >= WORKER_TARGET_RATIO else "BELOW"
        print(
            f"worker / engine alone: {report.ratio:.1%} of the tokens/s ({verdict} the "
            f"{WORKER_TARGET_RATIO:.0%} target); greedy outputs identical: {report.agreement:.0%}"
        )
        if len(report.pass_ratios) > 1:
            paired = report.paired_ratio
            verdict = "meets" if paired >= WORKER_TARGET_RATIO else "BELOW"
            print(
                f"median of the pairs (each worker pass / the engine pass next to it): {paired:.1%} ({verdict} "
                "the target); pairs: " + ", ".join(f"{r:.1%}" for r in report.pass_ratios)
            )
    md = [markdown_table(headers, rows)]
    lat = report.latency
    if lat is not None:
        lat_title = (
            f"latency: {lat['num_requests']} requests, Poisson arrivals at {lat['rate_req_per_s']:g} req/s; "
            f"achieved {lat['achieved_requests_per_s']:.2f} req/s, {lat['achieved_tokens_per_s']:.0f} tok/s; "
            f"{lat['tokens_per_event']:.2f} tokens per event; counts ok: {'yes' if lat['token_counts_ok'] else 'NO'}"
        )
        lh, lr = latency_rows(lat)
        print_table(lat_title, lh, lr, use_rich=not args.plain)
        md.append(markdown_table(lh, lr))
    print(f"load average before/after: {report.load_average['before']} / {report.load_average['after']}")
    if args.markdown:
        print("\n\n".join(md))
    if args.json_out:
        print(f"wrote {write_json(args.json_out, report.to_dict())}")
    ok = all(s.token_counts_ok for s in report.systems.values()) and (lat is None or lat["token_counts_ok"])
    return 0 if ok else 1
