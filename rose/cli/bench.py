"""`rose bench engine|step|worker|redis|fleet`: the benchmarks in `rose.bench`, as subcommands."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: rose vs transformers (engine), decode-step time (step), end to end (worker), what a "
        "token costs Redis (redis), how many workers one Redis serves (fleet)",
        description="Benchmarks that print a table and write JSON. `rose bench KIND --help` lists each one's flags.",
    )
    p.add_argument(
        "kind",
        choices=["engine", "step", "worker", "redis", "fleet"],
        help="engine: rose vs transformers; step: decode-step time; worker: redis + rose-worker vs engine alone; "
        "redis: Redis's CPU, commands and memory per generated token; fleet: simulated workers at a GPU's rate on "
        "one Redis",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rose.bench import redis_cli
    from rose.bench.cli import engine_main, step_main, worker_main

    main = {
        "engine": engine_main,
        "step": step_main,
        "worker": worker_main,
        "redis": redis_cli.redis_main,
        "fleet": redis_cli.fleet_main,
    }[args.kind]
    return main(args.args, prog=f"rose bench {args.kind}")
