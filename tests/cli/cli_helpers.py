"""Helpers for the producer / operator command tests: the shared rose-worker process, running `rose ...`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from rose.harness.worker_process import WorkerProcess, wait_for

__all__ = ["SERVED", "WORKER_NAME", "CliWorker", "checkout_env", "interrupt_when", "rose_cmd", "wait_for"]

# The checkout these tests belong to: the `rose` / `rose-worker` scripts import `rose` from wherever the package
# was installed (another checkout, maybe), so the children get this one first on PYTHONPATH.
CHECKOUT = Path(__file__).resolve().parents[2]

# Queues the shared worker serves; tests that need a queue nobody serves use any other name.
SERVED = ("rose", "cli-status", "cli-routed")  # cli-routed: rose batch --queue-for
WORKER_NAME = f"cli-{os.getpid()}"


class CliWorker(WorkerProcess):
    """The rose-worker the CLI tests share, serving SERVED."""

    def __init__(self, server, log_path: Path) -> None:
        args = ["--model", "tiny-llama", "--device", "cpu", "--max-model-len", "4096", "--max-num-seqs", "16"]
        args += [
            "--drain-timeout",
            "1",
            "--disable-any-whitespace",
        ]  # constrained JSON of a random model ends
        for q in SERVED:
            args += ["--queue", q]
        super().__init__(server.url, WORKER_NAME, args, log_path=log_path, env=checkout_env())
        self.wait_ready(180)


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH (and `extra`), for the `rose` processes tests start."""
    path = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def rose_cmd(*args: str) -> list[str]:
    """`rose *args` run by this interpreter, as the tests' own environment has it."""
    return [sys.executable, "-m", "rose", *args]


def interrupt_when(
    args: tuple[str, ...], env: dict[str, str], ready: Callable[[], bool], what: str
) -> tuple[int, str]:
    """Run `rose *args`, press Ctrl-C (SIGINT) once `ready()` holds (or it ended on its own); (exit code, stderr)."""
    proc = subprocess.Popen(
        rose_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        wait_for(lambda: proc.poll() is not None or ready(), 180, what, interval=0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err
