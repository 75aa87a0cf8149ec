"""A throwaway local `redis-server` on a free port (part of the harness: for `rose demo`, `rose bench worker`
and the tests, never for rose-worker itself)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis

from rose.harness.worker_process import pinned, wait_for


class RedisServerError(RuntimeError):
    """redis-server is missing, or did not start (the message says why)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: have the kernel SIGTERM redis-server if its parent dies without cleaning up (kill -9)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisServerProcess:
    """`redis-server` bound to 127.0.0.1 with no snapshots; `start()` waits until it answers PING.

    persistent: an append-only file in `directory`, so that stop() / start() on the same port keeps the data (an
    outage, not a wipe). detach: its own session (Ctrl-C in a terminal reaches only the parent, which stops it
    last) and, on Linux, killed by the kernel if the parent dies. `args`: more redis-server options
    (e.g. ["--stream-node-max-bytes", "512"]); `cpus`: run it on these CPUs only (taskset's list, e.g. "1").
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        port: int | None = None,
        directory: str | Path | None = None,
        persistent: bool = False,
        detach: bool = False,
        args: list[str] | None = None,
        cpus: str | None = None,
    ) -> None:
        found = binary or shutil.which("redis-server")
        if not found or not (Path(found).is_file() or shutil.which(found)):
            raise RedisServerError("redis-server not found on PATH (apt-get install redis-server)")
        self.binary = found
        self.port = port or free_port()
        self._tmpdir = None if directory is not None else tempfile.TemporaryDirectory(prefix="rose-redis-")
        self.dir = str(directory if directory is not None else self._tmpdir.name)
        self.persistent = persistent
        self.detach = detach
        self.args = list(args or [])
        self.cpus = cpus
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)

    def start(self, timeout: float = 10.0) -> RedisServerProcess:
        """Run the server (rose's options, then `self.args`: more redis-server options, e.g. `--replicaof`, read at
        each start) and wait until it answers PING; RedisServerError (with its stderr) if it exits or is still
        silent after `timeout` s (it is stopped then)."""
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        )
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persistence]
        argv += ["--dir", self.dir, "--daemonize", "no", "--loglevel", "warning", *self.args]
        argv = pinned(argv, self.cpus)
        linux = sys.platform.startswith("linux")
        self.proc = proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=self.detach,
            preexec_fn=_die_with_parent if self.detach and linux else None,
        )

        def answers() -> bool:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace").strip()[-500:]
                raise RedisServerError(f"redis-server did not start on port {self.port}: {err}")
            try:
                return bool(probe.ping())
            except redis.ConnectionError:
                return False

        try:
            with contextlib.closing(redis.Redis(port=self.port, socket_connect_timeout=0.2)) as probe:
                wait_for(
                    answers,
                    timeout,
                    f"redis-server on port {self.port} to answer PING",
                    0.05,
                    RedisServerError,
                )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (idempotent); a later start() runs it again on the same port."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            if proc.stderr:
                proc.stderr.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, its clients' connections drop) and reap it; a later start()
        runs it again on the same port."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stop()

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        self.stop()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> RedisServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
