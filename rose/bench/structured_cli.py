"""`rose bench engine --structured`: what constrained decoding costs rose (rose.bench.structured_bench), printed."""

from __future__ import annotations

import argparse
import sys

from rose.bench.cli_args import target_ok, where_ran
from rose.bench.engine_bench import EngineBenchConfig
from rose.bench.report import print_extras, print_table
from rose.bench.structured_bench import TARGET_SHARE, StructuredBenchConfig, run_structured_bench


def structured_main(args: argparse.Namespace, base: EngineBenchConfig) -> int:
    """`rose bench engine --structured`: what constrained decoding costs rose, with the engine bench's settings
    (`base`, from the same arguments)."""
    if not target_ok(base.device, base.dtype):
        return 2
    cfg = StructuredBenchConfig(
        model=base.model,
        num_requests=base.num_requests,
        prompt_len_range=base.prompt_len_range,
        output_len_range=base.output_len_range,
        seed=base.seed,
        repeats=base.repeats,
        device=base.device,
        dtype=base.dtype,
        num_threads=base.num_threads,
        rose=base.rose,
    )
    report = run_structured_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    wl = report.workload
    title = (
        f"{cfg.model} structured outputs ({cfg.rose.structured_outputs_backend}): {wl['num_requests']} requests, prompts {cfg.prompt_len_range}, max_tokens "
        f"{cfg.output_len_range}, max_num_seqs {cfg.rose.max_num_seqs}; {where_ran(report.environment)}, "
        f"repeats {cfg.repeats}"
    )
    headers, rows = report.rows()
    print_table(title, headers, rows, use_rich=not args.plain)
    share = report.ratio("json-schema")
    verdict = "meets" if share >= TARGET_SHARE else "BELOW"
    print(f"json-schema / unconstrained: {share:.1%} ({verdict} the {TARGET_SHARE:.0%} target)")
    print(
        f"mask-first / unconstrained: {report.ratio('mask-first'):.1%} (every constrained row masked before its "
        f"draw); tokens refused after an unmasked draw: {report.refused_share('json-schema'):.1%}"
    )
    print(
        f"grammar compile: first {report.first_compile_s * 1e3:.1f} ms, cache hit {report.cache_hit_s * 1e3:.3f} ms"
    )
    print_extras(args.markdown, args.json_out, headers, rows, report.to_dict())
    return 0
