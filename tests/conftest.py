"""Shared fixtures: a real redis-server on a free port (never the shared one on 6379), fakeredis for unit tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from rose.harness.redis_server import RedisServerError, RedisServerProcess, free_port


class RedisServer(RedisServerProcess):
    """A throwaway redis-server (no snapshots) in the test's directory that tests can stop and restart on the same
    port; persistent: keeps its data across stop() / start() (an outage, not a wipe)."""

    def __init__(self, tmp_path, persistent: bool = False) -> None:
        try:
            super().__init__(directory=tmp_path, persistent=persistent)
            self.start()
        except RedisServerError as exc:
            pytest.fail(f"the integration tests need a local redis-server: {exc}")


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
