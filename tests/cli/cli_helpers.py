"""Helpers for the producer / operator command tests: the shared rose-worker process, running `rose ...`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rq import Worker

# Queues the shared worker serves; tests that need a queue nobody serves use any other name.
SERVED = ("rose", "cli-status")
WORKER_NAME = f"cli-{os.getpid()}"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class CliWorker:
    def __init__(self, server, log_path: Path) -> None:
        script = shutil.which("rose-worker")
        cmd = [script] if script else [sys.executable, "-m", "rose.worker.cli"]
        cmd += ["--redis-url", server.url, "--model", "tiny-llama", "--device", "cpu", "--name", WORKER_NAME]
        cmd += ["--max-model-len", "4096", "--max-num-seqs", "16", "--drain-timeout", "1"]
        for q in SERVED:
            cmd += ["--queue", q]
        self.name = WORKER_NAME
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        r = server.client()
        wait_for(
            lambda: (
                self.proc.poll() is not None or any(w.name == self.name for w in Worker.all(connection=r))
            ),
            180,
            "rose-worker registered",
            interval=0.2,
        )
        assert self.proc.poll() is None, log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def rose_cmd(*args: str) -> list[str]:
    script = shutil.which("rose")
    return [*([script] if script else [sys.executable, "-m", "rose"]), *args]
