"""An embedded Redis for `rose demo`: a throwaway `redis-server` subprocess, or fakeredis's TCP server in-process.

Both listen on 127.0.0.1 on a free port, keep nothing on disk, and are stopped by `close()` (also on Ctrl-C).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import threading
from typing import Any, Literal

import redis

from rose.harness.redis_server import RedisServerError, RedisServerProcess

log = logging.getLogger(__name__)

RedisMode = Literal["auto", "server", "fake"]
# RQ asks the server its version with INFO, which fakeredis's TCP server does not implement (and the failed
# command drops the connection). RQ caches the answer in this attribute of the client: pre-seed it.
_RQ_VERSION_ATTR = "__rq_redis_server_version"
_FAKE_VERSION = (7, 4, 0)


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis could not be started (message says why and what to install)."""


def lua_available() -> bool:
    """fakeredis runs Lua scripts (rose's event publisher uses one) only with `lupa` installed."""
    return importlib.util.find_spec("lupa") is not None


class EmbeddedRedis:
    """A Redis reachable at `url` until `close()`. `kind` is "server" (redis-server) or "fake" (fakeredis)."""

    def __init__(self, kind: str, port: int):
        self.kind = kind
        self.port = port
        self.pid: int | None = None
        self._server: RedisServerProcess | None = None
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
        server = RedisServerProcess(binary=binary, detach=True)
        try:
            server.start(timeout)
        except RedisServerError as exc:
            server.close()
            raise EmbeddedRedisError(str(exc)) from None
        self = cls("server", server.port)
        self._server, self.pid = server, server.pid
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
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
        if self._fake is not None:
            server, self._fake = self._fake, None
            server.shutdown()  # stops serve_forever and tells the (non-daemon) handler threads to leave
            server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
