"""Shared fixtures: a real redis-server on a free port (never the shared one on 6379), fakeredis for unit tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server process (no persistence) that tests can stop and restart on the same port."""

    def __init__(self, tmp_path, persistent: bool = False) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not shutil.which(binary):
            pytest.fail("redis-server is required for the integration tests (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.dir = tmp_path
        # persistent: an append-only file, so that a stop/start keeps the data (an outage, not a wipe)
        self.persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
        )
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *self.persistence,
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        pytest.fail(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def new_redis_server(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (for tests that must not share or flush the session one)."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture
def persistent_redis_server(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of the test's own that keeps its data across stop() / start() (to simulate outages)."""
    server = RedisServer(tmp_path, persistent=True)
    yield server
    server.stop()


@pytest.fixture
def unused_port() -> int:
    return free_port()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client on the real server, flushed before each test."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def fake_r():
    import fakeredis

    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    yield client
    client.close()


@pytest.fixture
def queue_name() -> str:
    return f"q{uuid.uuid4().hex[:8]}"
