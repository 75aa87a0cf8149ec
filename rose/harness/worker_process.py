"""A `rose-worker` process driven from outside (part of the harness), as benchmarks and end-to-end tests use it:
start it, wait until it has registered with RQ, read its log, stop it (SIGTERM, then SIGKILL). Also `wait_for`,
the polling wait every test and benchmark uses instead of a loop of its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "a condition",
    interval: float = 0.02,
    error: type[Exception] = TimeoutError,
) -> Any:
    """Poll `predicate` until it returns something truthy (returned); `error` names `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise error(f"timed out after {timeout:.0f} s waiting for {what}")


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """`argv` run on the CPUs `cpus` (taskset's list), or as it is when None or taskset is missing."""
    if cpus is None or shutil.which("taskset") is None:
        return argv
    return ["taskset", "-c", cpus, *argv]


def worker_command() -> list[str]:
    """`rose-worker` run by this interpreter (`python -m rose.worker.cli`): the same environment (its rq, its rose)
    as the caller, whatever `rose-worker` script is first on PATH."""
    return [sys.executable, "-m", "rose.worker.cli"]


class WorkerExited(RuntimeError):
    """The worker process ended while we waited for it to become ready."""


class WorkerProcess:
    """`rose-worker --redis-url URL --name NAME *args`, its output appended to `log_path` (a temporary file, removed
    on stop, when None); `cpus`: run it on these CPUs only (taskset's list); `program`: another command taking
    rose-worker's flags (default: `worker_command()`)."""

    def __init__(
        self,
        redis_url: str,
        name: str,
        args: Sequence[str] = (),
        *,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        cpus: str | None = None,
        program: Sequence[str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.name = name
        program = list(program) if program is not None else worker_command()
        self.command = pinned([*program, "--redis-url", redis_url, "--name", name, *args], cpus)
        self._own_log = log_path is None
        if log_path is None:
            fd, tmp = tempfile.mkstemp(prefix="rose-worker-", suffix=".log")
            os.close(fd)
            log_path = Path(tmp)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop() / wait()
        self.proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=dict(env) if env else None
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self, chars: int | None = None) -> str:
        """What the worker has logged so far (the last `chars` characters)."""
        if not self._log.closed:
            self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text if chars is None else text[-chars:]

    def wait_ready(self, timeout: float = 180, *, engine_info: bool = False) -> WorkerProcess:
        """Block until the worker is registered with RQ (and, with `engine_info`, has described its engine in
        `rose:worker:<name>`). Raises WorkerExited (with its log) if it ends first, TimeoutError after `timeout`."""
        from rq import Worker

        from rose.jobs import keys
        from rose.jobs.connection import connect

        r = connect(self.redis_url)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise WorkerExited(f"rose-worker exited with {self.proc.returncode}:\n{self.output(4000)}")
            try:
                if not any(w.name == self.name for w in Worker.all(connection=r)):
                    return False
                return not engine_info or bool(r.exists(keys.worker_info_key(self.name)))
            except redis.ConnectionError:  # Redis not reachable (yet): the worker's own exit tells us more
                return False

        try:
            wait_for(ready, timeout, f"rose-worker {self.name} to register", interval=0.2)
        finally:
            r.close()
        return self

    def wait(self, timeout: float = 60) -> int:
        """Wait for the process to exit on its own; its exit status."""
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        """SIGKILL (a crash, as far as Redis and RQ can tell)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a drain) and, if it is still there after `timeout` s, SIGKILL; then close (and remove) the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
