"""The `rose` command line: one entry point, one subcommand per task."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rose.cli import batch, bench, demo, generate, jobs_cmd, status, submit
from rose.config.extras import missing_engine
from rose.config.parser import Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rose", description="rose: a queue-driven LLM batch-job worker.")
    parser.add_version()
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    submit.add_parser(sub)
    batch.add_parser(sub)
    status.add_parser(sub)
    jobs_cmd.add_parser(sub)
    generate.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`rose status --json | head`): stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, TypeError) as exc:
        print(f"rose {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an engine command in a producer's install
        message = missing_engine(exc)
        if message is None:
            raise
        print(f"rose {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
