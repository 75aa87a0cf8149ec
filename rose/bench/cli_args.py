"""Argument helpers shared by the benchmarks' parsers and entry points (`rose.bench.cli`)."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from rose.bench.common import resolve_target
from rose.engine.loader import resolve_dtype
from rose.engine.presets import PRESET_NAMES


def parse_range(text: str) -> tuple[int, int]:
    """'16,128' or '16:128' -> (16, 128), inclusive."""
    for sep in (",", ":", "-"):
        if sep in text:
            lo, hi = text.split(sep, 1)
            try:
                return int(lo), int(hi)
            except ValueError:
                break
    raise argparse.ArgumentTypeError(f"expected LO,HI (e.g. 16,128), got {text!r}")


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_device(text: str) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N'; whether CUDA is there is checked when the benchmark starts."""
    if text != "auto":
        try:
            torch.device(text)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    return text


def parse_dtype(text: str) -> str:
    try:
        resolve_dtype(text, torch.device("cpu"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """--device / --dtype: where every system of the benchmark runs, and in which precision."""
    parser.add_argument(
        "--device", type=parse_device, default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when available)"
    )
    parser.add_argument(
        "--dtype",
        type=parse_dtype,
        default="float32",
        help="float32, bfloat16, float16 or auto (bfloat16 on CUDA, float32 on CPU)",
    )


def add_common_args(parser: argparse.ArgumentParser, json_default: str) -> None:
    parser.add_argument(
        "--model",
        default="tiny-llama",
        help=f"a preset ({', '.join(PRESET_NAMES)}), the path of a config.json (random weights, seed 0), a "
        "checkpoint directory or a hub id",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)"
    )
    parser.add_argument(
        "--json-out", default=json_default, help="where to write the JSON report ('' for none)"
    )
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    parser.add_argument("--plain", action="store_true", help="plain-text table instead of rich")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")


def target_ok(device: str, dtype: str) -> bool:
    """Whether the device can be used here (CUDA asked for on a machine without it: a clear error, exit 2)."""
    try:
        resolve_target(device, dtype)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    return True


def where_ran(env: dict) -> str:
    """Where a benchmark ran, for table titles: the GPU, or the CPU threads."""
    where = f"torch threads {env['torch_num_threads']}, {env['cpu_count']} CPUs"
    if env.get("gpu_name"):
        where = f"{env['gpu_name']} ({env['device']}); " + where
    return f"{where}, {env.get('dtype', 'float32')}"


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # transformers' CB logs an error about psutil on CPU even when the cache is sized by hand.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
