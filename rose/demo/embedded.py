"""An embedded Redis for `rose demo`: a throwaway `redis-server` subprocess, or fakeredis's TCP server in-process.

Both listen on 127.0.0.1 on a free port, keep nothing on disk, and are stopped by `close()` (also on Ctrl-C).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Literal

import redis

log = logging.getLogger(__name__)

RedisMode = Literal["auto", "server", "fake"]
# RQ asks the server its version with INFO, which fakeredis's TCP server does not implement (and the failed
# command drops the connection). RQ caches the answer in this attribute of the client: pre-seed it.
_RQ_VERSION_ATTR = "__rq_redis_server_version"
_FAKE_VERSION = (7, 4, 0)


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis could not be started (message says why and what to install)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lua_available() -> bool:
    """fakeredis runs Lua scripts (rose's event publisher uses one) only with `lupa` installed."""
    return importlib.util.find_spec("lupa") is not None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: have the kernel SIGTERM redis-server if the demo dies without cleaning up (kill -9)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedis:
    """A Redis reachable at `url` until `close()`. `kind` is "server" (redis-server) or "fake" (fakeredis)."""

    def __init__(self, kind: str, port: int):
        self.kind = kind
        self.port = port
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._fake: Any = None
        self._thread: threading.Thread | None = None
        self._clients: list[redis.Redis] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def describe(self) -> str:
        if self.kind == "server":
            return f"redis-server pid {self.pid} on 127.0.0.1:{self.port}"
        return f"fakeredis TCP server (in-process) on 127.0.0.1:{self.port}"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client; closed by `close()`."""
        conn = redis.Redis.from_url(self.url, **kwargs)
        if self.kind == "fake":
            setattr(conn, _RQ_VERSION_ATTR, _FAKE_VERSION)
        self._clients.append(conn)
        return conn

    # ---- start / stop -----------------------------------------------------------------------------------------

    @classmethod
    def start(cls, mode: RedisMode = "auto", timeout: float = 15.0) -> EmbeddedRedis:
        binary = shutil.which("redis-server")
        if mode == "server" or (mode == "auto" and binary):
            if not binary:
                raise EmbeddedRedisError(
                    "no redis-server on PATH (apt-get install redis-server, or use --redis fake)"
                )
            return cls._start_server(binary, timeout)
        if not lua_available():
            raise EmbeddedRedisError(
                "no redis-server on PATH, and fakeredis cannot run rose's Lua script without lupa: "
                "pip install 'fakeredis[lua]' (or apt-get install redis-server)"
            )
        return cls._start_fake()

    @classmethod
    def _start_server(cls, binary: str, timeout: float) -> EmbeddedRedis:
        self = cls("server", _free_port())
        self._tmpdir = tempfile.TemporaryDirectory(prefix="rose-demo-redis-")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", self._tmpdir.name, "--daemonize", "no", "--loglevel", "warning"]
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C in the terminal reaches the demo only; it stops redis last
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self.pid = self._proc.pid
        deadline = time.monotonic() + timeout
        probe = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            while True:
                try:
                    probe.ping()
                    break
                except redis.ConnectionError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                        self.close()
                        raise EmbeddedRedisError(
                            f"redis-server did not start: {err.strip()[-500:]}"
                        ) from None
                    time.sleep(0.05)
        finally:
            probe.close()
        log.info("started %s", self.describe())
        return self

    @classmethod
    def _start_fake(cls) -> EmbeddedRedis:
        import fakeredis

        server = fakeredis.TcpFakeServer(("127.0.0.1", 0), server_type="redis")
        self = cls("fake", int(server.server_address[1]))
        self._fake = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="rose-demo-fakeredis",
            daemon=True,
        )
        self._thread.start()
        log.info("started %s", self.describe())
        return self

    def close(self) -> None:
        """Stop the server; idempotent. Close every client first so no handler thread waits on a socket."""
        for conn in self._clients:
            with contextlib.suppress(Exception):
                conn.close()
                conn.connection_pool.disconnect()
        self._clients.clear()
        if self._proc is not None:
            proc, self._proc = self._proc, None
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            if proc.stderr:
                proc.stderr.close()
        if self._fake is not None:
            server, self._fake = self._fake, None
            server.shutdown()  # stops serve_forever and tells the (non-daemon) handler threads to leave
            server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
