"""`rose demo`: one command, no Redis or GPU needed: an embedded Redis, a rose worker with a tiny preset and a few
producers streaming side by side, then the stored results."""

from __future__ import annotations

import argparse
import sys

from rose.demo.runner import DEFAULT_PROMPTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run an embedded Redis, a worker and producers, and watch the tokens stream",
        description="Start an embedded Redis (a local redis-server if one is on PATH, else fakeredis in-process), "
        "a rose worker with a small model, and one producer per prompt with different sampling settings; show "
        "their tokens streaming side by side, then the stored results; then stop everything. The tiny presets "
        "have random weights: their text is gibberish, by design (nothing is downloaded).",
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        metavar="PROMPT",
        default=None,
        help=f"prompts (default: {len(DEFAULT_PROMPTS)})",
    )
    p.add_argument(
        "--model", default="tiny-llama", help="preset or checkpoint directory (default: tiny-llama)"
    )
    p.add_argument("--device", default="cpu", help="torch device for the worker (default: cpu)")
    p.add_argument("--max-tokens", type=int, default=48, metavar="N", help="tokens per job (default: 48)")
    p.add_argument(
        "--redis",
        choices=("auto", "server", "fake"),
        default="auto",
        help="embedded Redis: a redis-server subprocess, fakeredis in-process, or auto (server when on PATH)",
    )
    p.add_argument(
        "--duration-limit",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="give up (exit 1) after this long (default: 120)",
    )
    p.add_argument(
        "--plain",
        action="store_true",
        help="line-per-event output (the default when stdout is not a terminal)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rose.demo.embedded import EmbeddedRedisError
    from rose.demo.runner import Demo, DemoOptions

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.duration_limit <= 0:
        raise ValueError("--duration-limit must be positive")
    opts = DemoOptions(
        prompts=list(args.prompts or DEFAULT_PROMPTS),
        model=args.model,
        device=args.device,
        max_tokens=args.max_tokens,
        redis=args.redis,
        duration_limit=args.duration_limit,
        plain=args.plain,
    )
    try:
        return Demo(opts).run()
    except EmbeddedRedisError as exc:
        print(f"rose demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rose demo: interrupted; stopped the worker and Redis", file=sys.stderr)
        return 130
