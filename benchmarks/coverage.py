#!/usr/bin/env python
"""rose's engine against transformers' `generate` on tiny models of many architectures.

Prints one row per architecture (exact / refused / wrong / crash / skipped, per engine mode) and a summary line,
and writes the table as JSON. Exit status 1 when any architecture is `wrong` or `crash`: rose must serve every model
exactly or refuse it at construction.

    python3 benchmarks/coverage.py                # every causal-LM type of the installed transformers (~1 min here)
    python3 benchmarks/coverage.py llama gemma2   # just these
    python3 benchmarks/coverage.py --markdown     # the table as markdown (docs/models.md's list comes from it)

The tiny models and the check are the tests' (tests/engine/architectures.py, tests/engine/coverage_check.py);
tests/engine/test_model_coverage.py runs the same sweep.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests" / "engine"))  # the tiny models and the check live with the tests

import torch  # noqa: E402
from coverage_check import (  # noqa: E402
    LOW_PRECISION_TIE_TOLERANCE,
    MODES,
    TIE_TOLERANCE,
    Target,
    Verdict,
    check_model,
)

from rose.bench.cli_args import parse_device, parse_dtype  # noqa: E402
from rose.bench.report import markdown_table, print_table, write_json  # noqa: E402
from rose.engine.loader import resolve_dtype  # noqa: E402

DEFAULT_JSON = "benchmarks/results/coverage.json"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("types", nargs="*", help="model types (default: every causal-LM type of transformers)")
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated engine modes ({', '.join(MODES)})"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--device", type=parse_device, default="cpu", help="cpu, cuda or cuda:N: the engine and generate"
    )
    p.add_argument(
        "--dtype", type=parse_dtype, default="float32", help="float32 (exact), bfloat16 or float16"
    )
    p.add_argument(
        "--tie-tolerance",
        type=float,
        default=None,
        help="a first difference whose logit gap is under this times the best logit is a tie "
        f"(default {TIE_TOLERANCE:g} in float32, {LOW_PRECISION_TIE_TOLERANCE:g} in bf16 / fp16)",
    )
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--json-out", default=DEFAULT_JSON)
    p.add_argument("--verbose", action="store_true", help="show transformers' warnings and rose's logs")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    from architectures import causal_lm_types, prompt_id_range, tiny_model

    args = build_parser(prog).parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; modes are {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    if not args.verbose:
        _quiet()
    types = args.types or causal_lm_types()
    tolerance = args.tie_tolerance
    if tolerance is None:
        low = resolve_dtype(args.dtype, torch.device("cpu")) != torch.float32
        tolerance = LOW_PRECISION_TIE_TOLERANCE if low else TIE_TOLERANCE
    target = Target(args.device, args.dtype, tolerance)
    verdicts = []
    for i, model_type in enumerate(types, 1):
        build = lambda t=model_type: tiny_model(t)  # noqa: E731
        verdict = check_model(model_type, build, modes, id_range=prompt_id_range(), target=target)
        verdicts.append(verdict)
        print(f"[{i}/{len(types)}] {_line(verdict, modes)}", file=sys.stderr, flush=True)
    headers = ["model type", "verdict", *modes, "s", "detail"]
    rows = [[v.name, v.status, *(_mode(v, m) for m in modes), f"{v.seconds:.1f}", v.detail] for v in verdicts]
    if args.markdown:
        print(markdown_table(headers, rows))
    else:
        print_table("rose vs transformers generate (greedy, tiny random-weight models)", headers, rows)
    counts = Counter(v.status for v in verdicts)
    print(", ".join(f"{counts[s]} {s}" for s in ("exact", "refused", "wrong", "crash", "skipped")))
    payload = {"modes": modes, "target": vars(args) | {"tie_tolerance": tolerance}, "counts": counts}
    write_json(args.json_out, payload | {"verdicts": [_json(v) for v in verdicts]})
    return 1 if counts["wrong"] or counts["crash"] else 0


def _mode(v: Verdict, mode: str) -> str:
    result = v.modes.get(mode)
    return str(result) if result is not None else "-"


def _line(v: Verdict, modes: tuple[str, ...]) -> str:
    per_mode = " ".join(f"{m}={_mode(v, m)}" for m in modes if m in v.modes)
    return f"{v.name}: {v.status} {per_mode} {v.detail} ({v.seconds:.1f} s)"


def _json(v: Verdict) -> dict:
    modes = {m: {"status": r.status, "ties": r.ties, "detail": r.detail} for m, r in v.modes.items()}
    return {
        "model_type": v.name,
        "status": v.status,
        "detail": v.detail,
        "seconds": v.seconds,
        "modes": modes,
    }


def _quiet() -> None:
    """Tiny random configs make transformers warn about every odd field; the table is what matters."""
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("rose").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


if __name__ == "__main__":
    sys.exit(main())
