"""rose-worker's start-up checks of the Redis it is given (rose.worker.cli): the server's version. The real process
refusing an old server: tests/worker/test_e2e.py."""

from __future__ import annotations

import pytest
import redis

from rose.worker import cli as worker_cli


class _Info:
    """A connection whose INFO server reports `version` (or is refused, as an ACL without +info refuses it)."""

    def __init__(self, version: str | None):
        self.version = version

    def info(self, section: str) -> dict:
        assert section == "server"
        if self.version is None:
            raise redis.ResponseError("NOPERM this user has no permissions to run the 'info' command")
        return {"redis_version": self.version}


@pytest.mark.parametrize("version", ["6.2.0", "6.2.14", "7.0.15", "7.2.4", "8.0.1", "10.1"])
def test_a_redis_of_6_2_or_newer_is_served(version):
    assert worker_cli.server_version_problem(_Info(version)) is None


@pytest.mark.parametrize("version", ["6.0.16", "5.0.7", "4.0.9", "6"])
def test_an_older_redis_is_named_with_the_version_needed(version):
    problem = worker_cli.server_version_problem(_Info(version))
    assert problem == (
        f"runs version {version}; rose-worker needs Redis 6.2 or newer (it moves jobs with LMOVE and BLMOVE, "
        "as RQ does from 6.2 on)"
    )


@pytest.mark.parametrize("version", [None, "", "unknown"])
def test_a_server_that_does_not_say_is_not_refused(version):
    assert worker_cli.server_version_problem(_Info(version)) is None
