"""`rose bench engine|step`: the benchmarks in `rose.bench`, as subcommands."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: rose vs transformers (engine), decode-step time (step)",
        description="Benchmarks that print a table and write JSON. `rose bench KIND --help` lists each one's flags.",
    )
    p.add_argument(
        "kind", choices=["engine", "step"], help="engine: rose vs transformers; step: decode-step time"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rose.bench.cli import engine_main, step_main

    main = engine_main if args.kind == "engine" else step_main
    return main(args.args, prog=f"rose bench {args.kind}")
