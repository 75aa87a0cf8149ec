"""How `rose demo` shows its jobs: live side-by-side columns on a terminal, parseable lines otherwise.

Plain lines (stdout not a TTY, or --plain), one event per line, `N` = the job's 1-based column:

    # <info>
    [N] job <job_id> <prompt as JSON> <sampling settings>
    [N] + <text delta as a JSON string>
    [N] end <finished | failed: ... | canceled: ...>
    [N] result <stored result as JSON>      (after every job has ended)

The concatenation of a job's `+` deltas equals the `text` of its `result`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass
class Column:
    prompt: str
    settings: str
    job_id: str = ""
    text: list[str] = field(default_factory=list)
    status: str = "queued"


def _fmt(value: Any, unit: str = "") -> str:
    if isinstance(value, float):
        return f"{value:.3f}{unit}" if value < 10 else f"{value:.1f}{unit}"
    return "-" if value is None else str(value)


class PlainView:
    """Line-prefixed output for pipes and logs."""

    def __init__(self, columns: list[Column], out: TextIO | None = None):
        self.columns = columns
        self.out = out or sys.stdout

    def _line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def info(self, text: str) -> None:
        self._line(f"# {text}")

    def submitted(self, i: int) -> None:
        col = self.columns[i]
        col.status = "streaming"
        self._line(f"[{i + 1}] job {col.job_id} {json.dumps(col.prompt)} {col.settings}")

    def delta(self, i: int, text: str) -> None:
        self.columns[i].text.append(text)
        self._line(f"[{i + 1}] + {json.dumps(text)}")

    def ended(self, i: int, status: str) -> None:
        self.columns[i].status = status
        self._line(f"[{i + 1}] end {status}")

    def results(self, results: list[dict[str, Any] | None]) -> None:
        self._line("# stored results")
        for i, res in enumerate(results):
            if res is not None:
                self._line(f"[{i + 1}] result {json.dumps(res, sort_keys=True)}")


class LiveView(PlainView):
    """rich Live: one column per job, text growing as tokens arrive."""

    def __init__(self, columns: list[Column], out: TextIO | None = None):
        super().__init__(columns, out)
        from rich.console import Console

        self.console = Console(file=self.out)
        self._live: Any = None

    def __rich__(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(expand=True, show_lines=False)
        for i, col in enumerate(self.columns):
            head = Text(f"[{i + 1}] ", style="bold")
            head.append(col.prompt, style="bold cyan")
            head.append(f"\n{col.settings}", style="dim")
            table.add_column(head, ratio=1, overflow="fold")
        cells = []
        for col in self.columns:
            cell = Text(col.prompt, style="dim")
            cell.append("".join(col.text))
            style = "green" if col.status == "finished" else "yellow" if col.status == "streaming" else "red"
            cell.append(f"\n\n{col.status}", style=f"italic {style}")
            cells.append(cell)
        table.add_row(*cells)
        return table

    def start(self) -> None:
        from rich.live import Live

        self._live = Live(self, console=self.console, refresh_per_second=12, vertical_overflow="visible")
        self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def info(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/dim]", highlight=False)

    def submitted(self, i: int) -> None:
        self.columns[i].status = "streaming"

    def delta(self, i: int, text: str) -> None:
        self.columns[i].text.append(text)

    def ended(self, i: int, status: str) -> None:
        self.columns[i].status = status

    def results(self, results: list[dict[str, Any] | None]) -> None:
        from rich.table import Table

        self.stop()
        table = Table(title="stored results (RQ job results)", expand=False)
        for name in ("job", "finish", "in tok", "out tok", "queue", "ttft", "gen", "tok/s"):
            table.add_column(name, justify="left" if name in ("job", "finish") else "right", no_wrap=True)
        for i, res in enumerate(results):
            col = self.columns[i]
            if res is None:
                table.add_row(f"[{i + 1}] {col.job_id[:8]}", col.status, *["-"] * 6)
                continue
            usage, metrics = res.get("usage") or {}, res.get("metrics") or {}
            table.add_row(
                f"[{i + 1}] {col.job_id[:8]}",
                str(res.get("finish_reason")),
                _fmt(usage.get("prompt_tokens")),
                _fmt(usage.get("completion_tokens")),
                _fmt(metrics.get("queue_s"), " s"),
                _fmt(metrics.get("ttft_s"), " s"),
                _fmt(metrics.get("generation_s"), " s"),
                _fmt(metrics.get("tokens_per_s")),
            )
        self.console.print(table)
        worker = next((r.get("worker") for r in results if r), None)
        if worker:
            self.console.print(f"[dim]served by worker {worker}[/dim]", highlight=False)


def make_view(columns: list[Column], plain: bool) -> PlainView:
    return PlainView(columns) if plain or not sys.stdout.isatty() else LiveView(columns)
