"""Tables (rich when available and asked for, plain text otherwise) and JSON output for the benchmarks."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def plain_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], use_rich: bool = True
) -> None:
    """Print a table to stdout (scripts and CLIs only; library code logs)."""
    if use_rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:  # pragma: no cover - rich is a dependency, but stay usable without it
            use_rich = False
    if not use_rich:
        print(plain_table(title, headers, rows))
        return
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(_fmt(c) for c in row))
    console = Console()
    if not console.is_terminal:  # piped / captured: don't squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)


def print_extras(
    markdown: bool, json_out: str | None, headers: Sequence[str], rows: Sequence[Sequence[Any]], payload: Any
) -> None:
    """After a benchmark's table: the table again as Markdown (`--markdown`), the JSON report (`--json-out`)."""
    if markdown:
        print(markdown_table(headers, rows))
    if json_out:
        print(f"wrote {write_json(json_out, payload)}")


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    return path


def engine_rows(report: Any) -> tuple[list[str], list[list[Any]]]:
    """Rows of the engine comparison: one per system (median over repeats), with rose's ratio to it."""
    headers = [
        "system",
        "requests/s",
        "generated tok/s",
        "best tok/s",
        "wall s",
        "tokens credited",
        "counts ok",
        "rose ×",
    ]
    rows = []
    rose = report.systems.get("rose")
    for name, s in report.systems.items():
        ratio = rose.median_tokens_per_s / s.median_tokens_per_s if rose is not None else float("nan")
        rows.append(
            [
                name,
                s.median_requests_per_s,
                s.median_tokens_per_s,
                s.best_tokens_per_s,
                s.median_wall_s,
                s.runs[0].generated_tokens,
                "yes" if s.token_counts_ok else "NO",
                ratio,
            ]
        )
    return headers, rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def step_rows(points: Sequence[Any]) -> tuple[list[str], list[list[Any]]]:
    headers = [
        "sweep",
        "batch",
        "prompt len",
        "mean ctx",
        "step ms (median)",
        "step ms (min)",
        "min ms / seq",
        "B×ctx (k tokens)",
        "fit ms",
        "floor ms",
        "floor / median",
        "floor / min",
        "pure decode",
    ]
    rows = []
    for p in points:
        ctx = p.mean_context if p.mean_context is not None else float(p.context_len)
        floor = getattr(p, "floor_ms", None)
        rows.append(
            [
                p.sweep,
                p.batch_size,
                p.context_len,
                float(ctx),
                p.median_ms,
                p.min_ms,
                p.min_ms / p.batch_size,
                p.batch_size * ctx / 1000,
                p.fit_ms if p.fit_ms is not None else float("nan"),
                f"{floor:.3f}" if floor is not None else "-",
                _pct(getattr(p, "floor_fraction_median", None)),
                _pct(getattr(p, "floor_fraction_best", None)),
                "yes" if p.pure_decode else "NO",
            ]
        )
    return headers, rows


ROOFLINE_GOAL = 0.5  # the GPU goal: a batch-64 decode step at >= 50 % of the memory-bandwidth floor


def roofline_summary(roofline: dict[str, Any], points: Sequence[Any]) -> str:
    """What the floor counts, and the batch-64 fractions against the issue's GPU goal."""
    w, copy = roofline["weight_bytes"], roofline["copy"]
    lines = [
        f"memory-bandwidth floor = (weight bytes + KV bytes read) / {roofline['bandwidth_gb_s']:.1f} GB/s "
        f"(best of {copy['repeats']:.0f} copies of {copy['copy_bytes'] / 2**20:.0f} MiB, read + written); "
        f"weights {w['total'] / 1e6:.2f} MB per step (LM head {w['lm_head'] / 1e6:.2f} MB, "
        f"{'tied to the input embedding, ' if w['tied_embeddings'] else ''}counted once; "
        f"{w['embeddings_not_counted'] / 1e6:.2f} MB of embedding tables only gathered from, not counted), "
        f"KV {roofline['kv_bytes_per_token']} bytes per cached token"
    ]
    for p in points:
        if p.batch_size == 64 and getattr(p, "floor_ms", None) is not None:
            verdict = "meets" if p.floor_fraction_median >= ROOFLINE_GOAL else "below"
            lines.append(
                f"batch 64, ctx {p.kv_context:.0f}: floor {p.floor_ms:.3f} ms = {p.floor_fraction_median:.0%} of the "
                f"median step, {p.floor_fraction_best:.0%} of the fastest ({verdict} the GPU goal of "
                f"{ROOFLINE_GOAL:.0%})"
            )
    return "\n".join(lines)
