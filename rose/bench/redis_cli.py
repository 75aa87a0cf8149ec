"""`rose bench redis` (what a token costs Redis) and `rose bench fleet` (how many workers one Redis serves): parsers
and entry points."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from rose.bench.cli_args import parse_ints, setup_logging
from rose.bench.redis_cost import NOT_STREAMED, STREAMED, TARGETS, RedisCostConfig, run_redis_cost
from rose.bench.report import print_extras, print_table

DEFAULT_REDIS_JSON = "benchmarks/results/bench_redis.json"


def _output_args(p: argparse.ArgumentParser, json_default: str) -> None:
    p.add_argument("--json-out", default=json_default, help="where to write the JSON report ('' for none)")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument("--plain", action="store_true", help="plain-text table instead of rich")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")


def _modes(text: str, allowed: Sequence[str]) -> tuple[str, ...] | None:
    """--modes as a tuple, or None after one line on stderr if it names none or one not in `allowed`."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or any(m not in allowed for m in modes):
        print(f"error: --modes takes {', '.join(allowed)}, got {text!r}", file=sys.stderr)
        return None
    return modes


def build_redis_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="What a generated token costs Redis: a real redis-server and rose-worker, N jobs x T tokens, "
        "Redis's own accounting (CPU net of idle, commands, round trips, memory left), streamed and not.",
    )
    d = RedisCostConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--num-jobs", type=int, default=d.num_jobs)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per job (EOS ignored)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument(
        "--modes",
        default=",".join(d.modes),
        help=f"comma-separated: {STREAMED}, {NOT_STREAMED} (default: both)",
    )
    p.add_argument("--worker-args", default="", help="more rose-worker flags, e.g. '--stream-interval 0.05'")
    p.add_argument(
        "--redis-args", default="", help="more redis-server options, e.g. '--stream-node-max-bytes 512'"
    )
    p.add_argument("--no-pin", action="store_true", help="do not give Redis a CPU of its own")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating; medians reported")
    _output_args(p, DEFAULT_REDIS_JSON)
    return p


def redis_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_redis_parser(prog).parse_args(argv)
    setup_logging(args.verbose)
    modes = _modes(args.modes, (STREAMED, NOT_STREAMED))
    if modes is None:
        return 2
    cfg = RedisCostConfig(
        model=args.model,
        num_jobs=args.num_jobs,
        max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs,
        modes=modes,
        worker_args=tuple(shlex.split(args.worker_args)),
        redis_args=tuple(shlex.split(args.redis_args)),
        pin=not args.no_pin,
        repeats=args.repeats,
    )
    report = run_redis_cost(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    pinned = f"Redis on CPU {report.cpus['redis']}" if report.cpus["redis"] else "Redis not pinned"
    title = (
        f"What a token costs Redis: {cfg.num_jobs} jobs x {cfg.max_tokens} tokens, {cfg.model}, max_num_seqs "
        f"{cfg.max_num_seqs}; {pinned}; worker {' '.join(cfg.worker_args) or 'defaults'}; medians of {cfg.repeats}"
        + (f"; redis {' '.join(cfg.redis_args)}" if cfg.redis_args else "")
    )
    headers, rows = report.rows()
    print_table(title, headers, rows, use_rich=not args.plain)
    for result in report.results:
        targets = TARGETS[result.mode]
        verdicts = ", ".join(
            f"{name} {result.per_token[name]:.2f} (target <= {limit:g}: {'meets' if ok else 'MISSES'})"
            for (name, limit), ok in zip(targets.items(), result.meets().values(), strict=True)
        )
        families = ", ".join(
            f"{family} {v['bytes'] / result.tokens:.1f}"
            for family, v in sorted(result.memory_by_family.items(), key=lambda kv: -kv[1]["bytes"])[:4]
        )
        print(f"{result.mode}: {verdicts}; bytes/token by key: {families}")
    print_extras(args.markdown, args.json_out, headers, rows, report.to_dict())
    return 0


DEFAULT_FLEET_JSON = "benchmarks/results/bench_fleet.json"


def build_fleet_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from rose.bench.fleet import MODES, FleetConfig

    d = FleetConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Simulated rose-workers (the real worker code, an engine stand-in at a GPU's pace) against one "
        "real redis-server: Redis CPU, commands/s and event latency per fleet size, and the fleet size at which "
        "one Redis thread would be busy all the time.",
    )
    p.add_argument("--workers", type=parse_ints, default=d.fleet_sizes, help="fleet sizes, e.g. 1,2,4,8")
    p.add_argument("--modes", default=",".join(d.modes), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences a simulated worker runs"
    )
    p.add_argument(
        "--steps-per-s", type=float, default=d.steps_per_s, help="a simulated worker's engine steps/s"
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per job")
    p.add_argument(
        "--mixed-share", type=float, default=d.mixed_share, help="streamed share of the jobs in mixed"
    )
    p.add_argument("--warmup", type=float, default=d.warmup_s, metavar="S")
    p.add_argument("--window", type=float, default=d.window_s, metavar="S", help="measured seconds per point")
    p.add_argument(
        "--latency", type=float, default=d.latency_s, metavar="S", help="seconds of latency probes per point"
    )
    p.add_argument("--worker-args", default="", help="more rose-worker flags, e.g. '--stream-interval 0.2'")
    p.add_argument("--no-pin", action="store_true", help="do not give Redis a CPU of its own")
    _output_args(p, DEFAULT_FLEET_JSON)
    return p


def fleet_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from rose.bench.fleet import MODES, FleetConfig, run_fleet

    args = build_fleet_parser(prog).parse_args(argv)
    setup_logging(args.verbose)
    modes = _modes(args.modes, MODES)
    if modes is None:
        return 2
    cfg = FleetConfig(
        fleet_sizes=args.workers,
        modes=modes,
        max_num_seqs=args.max_num_seqs,
        steps_per_s=args.steps_per_s,
        max_tokens=args.max_tokens,
        mixed_share=args.mixed_share,
        warmup_s=args.warmup,
        window_s=args.window,
        latency_s=args.latency,
        worker_args=tuple(shlex.split(args.worker_args)),
        pin=not args.no_pin,
    )
    report = run_fleet(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    pinned = f"Redis on CPU {report.cpus['redis']}" if report.cpus["redis"] else "Redis not pinned"
    headers = [
        "mode",
        "workers",
        "tok/s",
        "expected tok/s",
        "Redis CPU %",
        "CPU µs/token",
        "commands/s",
        "round trips/s",
        "latency p50 ms",
        "latency p99 ms",
        "gap p99 ms",
    ]
    rows = [
        [
            p.mode,
            p.workers,
            p.tokens_per_s,
            p.expected_tokens_per_s,
            p.redis_cpu * 100,
            p.cpu_us_per_token,
            p.commands_per_s,
            p.round_trips_per_s,
            p.event_latency_ms.get("p50", float("nan")),
            p.event_latency_ms.get("p99", float("nan")),
            p.event_gap_ms.get("p99", float("nan")),
        ]
        for p in report.points
    ]
    title = (
        f"Fleet on one Redis: simulated workers of {cfg.max_num_seqs} sequences x {cfg.steps_per_s:g} steps/s, "
        f"{cfg.max_tokens} tokens a job; {pinned}; window {cfg.window_s:g} s"
    )
    print_table(title, headers, rows, use_rich=not args.plain)
    for mode in modes:
        sat = report.saturation(mode)
        print(
            f"{mode}: {sat['cpu_per_worker'] * 100:.2f}% of a Redis core per worker "
            f"({sat['tokens_per_s_per_worker']:,.0f} tok/s each): one Redis thread saturates at "
            f"~{sat['workers']:,.0f} such workers, ~{sat['tokens_per_s']:,.0f} tok/s"
        )
    print_extras(args.markdown, args.json_out, headers, rows, report.to_dict())
    return 0
