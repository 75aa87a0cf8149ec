"""Throwaway processes for `rose bench worker`: a redis-server on a free port and a `rose-worker` serving it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from rose.redis_server import RedisServerError, RedisServerProcess


class BenchProcessError(RuntimeError):
    """redis-server or rose-worker could not be started (missing binary, crashed, never ready)."""


def _wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise BenchProcessError(f"timed out after {timeout:.0f} s waiting for {what}")


def _stop(proc: subprocess.Popen | None, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class RedisProcess(RedisServerProcess):
    """A throwaway redis-server for the benchmark (missing binary or failed start: BenchProcessError)."""

    def __init__(self, binary: str | None = None, start_timeout: float = 10.0) -> None:
        try:
            super().__init__(binary=binary)
            self.start(start_timeout)
        except RedisServerError as exc:
            raise BenchProcessError(f"`rose bench worker` needs a local Redis: {exc}") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and remove its directory (a benchmark never restarts it)."""
        super().stop(timeout)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None


def worker_command() -> list[str]:
    script = shutil.which("rose-worker")
    return [script] if script else [sys.executable, "-m", "rose.worker.cli"]


class WorkerProcess:
    """A `rose-worker` subprocess on one queue; ready once registered with RQ and its engine described in Redis
    (`rose:worker:<name>`). `num_threads` is passed as OMP_NUM_THREADS / MKL_NUM_THREADS (torch reads them)."""

    def __init__(
        self,
        redis_url: str,
        queue: str,
        name: str,
        *,
        model: str = "tiny-llama",
        max_num_seqs: int = 128,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        num_threads: int | None = None,
        start_timeout: float = 180.0,
    ) -> None:
        from rq import Worker

        from rose.jobs import keys

        self.name = name
        cmd = worker_command()
        cmd += ["--redis-url", redis_url, "--model", model, "--device", "cpu", "--dtype", "float32"]
        cmd += ["--max-num-seqs", str(max_num_seqs), "--queue", queue, "--name", name]
        cmd += ["--drain-timeout", "1", "--log-level", "WARNING"]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        env = dict(os.environ)
        if num_threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(num_threads)
        self.command = cmd
        self._log = tempfile.NamedTemporaryFile(prefix="rose-bench-worker-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)
        self.proc: subprocess.Popen | None = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        r = redis.Redis.from_url(redis_url)

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise BenchProcessError(f"rose-worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            registered = any(w.name == name for w in Worker.all(connection=r))
            return registered and bool(r.exists(keys.worker_info_key(name)))

        try:
            _wait_for(ready, start_timeout, "rose-worker to register", 0.2)
        except BaseException:
            self.stop()
            raise
        finally:
            r.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        _stop(self.proc, 30)
        self.proc = None
        self._log.close()
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
