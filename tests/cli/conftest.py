"""Fixtures for the producer / operator command tests: a redis-server of their own and one real `rose-worker`
process (tiny-llama on CPU) shared by the whole session, and `rose(...)` running the command as a subprocess."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from cli_helpers import CliWorker, checkout_env, rose_cmd


@pytest.fixture(scope="session")
def cli_redis(redis_server, tmp_path_factory) -> Iterator:
    """Not the session's shared server (other tests flush that one, which would wipe the live worker's keys): one
    of the same kind (tests/conftest.py's RedisServer) of our own."""
    server = type(redis_server)(tmp_path_factory.mktemp("cli-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cli_worker(cli_redis, tmp_path_factory) -> Iterator[CliWorker]:
    worker = CliWorker(cli_redis, tmp_path_factory.mktemp("cli-worker") / "worker.log")
    yield worker
    worker.stop()


@pytest.fixture
def rose(cli_redis):
    """rose(*args) -> CompletedProcess, with ROSE_REDIS_URL pointing at the test Redis."""
    env = checkout_env(ROSE_REDIS_URL=cli_redis.url)

    def run(*args: str, timeout: float = 180, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            rose_cmd(*args), capture_output=True, text=True, timeout=timeout, check=False, env=env, **kwargs
        )

    run.env = env
    return run
