"""What rose-worker requires of its Redis server (rose.worker.server_checks), read from INFO as redis-py returns
it. The real process refusing an old server and warning of an evicting one: tests/worker/test_e2e.py."""

from __future__ import annotations

import pytest
import redis

from rose.worker import server_checks
from rose.worker.redis_guard import is_oom


@pytest.mark.parametrize("version", ["6.2.0", "6.2.14", "7.0.15", "7.2.4", "8.0.1", "10.1"])
def test_a_redis_of_6_2_or_newer_is_served(version):
    assert server_checks.version_problem({"redis_version": version}) is None


@pytest.mark.parametrize("version", ["6.0.16", "5.0.7", "4.0.9", "6"])
def test_an_older_redis_is_named_with_the_version_needed(version):
    assert server_checks.version_problem({"redis_version": version}) == (
        f"runs version {version}; rose-worker needs Redis 6.2 or newer (it moves jobs with LMOVE and BLMOVE, "
        "as RQ does from 6.2 on)"
    )


@pytest.mark.parametrize("info", [{}, {"redis_version": ""}, {"redis_version": "unknown"}])
def test_a_server_that_does_not_say_its_version_is_not_refused(info):
    assert server_checks.version_problem(info) is None


@pytest.mark.parametrize(
    "info",
    [
        {"maxmemory": 0, "maxmemory_policy": "allkeys-lru"},  # no limit: nothing is ever evicted
        {"maxmemory": 2**30, "maxmemory_policy": "noeviction"},
        {},
    ],
)
def test_a_server_that_never_evicts_is_not_warned_of(info):
    assert server_checks.eviction_warning(info) is None


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "volatile-ttl", "allkeys-random"])
def test_a_server_that_evicts_is_warned_of_with_its_limit_and_policy(policy):
    warning = server_checks.eviction_warning(
        {"maxmemory": 2**30, "maxmemory_human": "1.00G", "maxmemory_policy": policy}
    )
    assert warning is not None
    assert warning.startswith(f"evicts keys when full (maxmemory 1.00G, maxmemory-policy {policy}): ")
    assert "maxmemory-policy noeviction" in warning


class _Refusing:
    def info(self, *sections: str) -> dict:
        raise redis.ResponseError("NOPERM this user has no permissions to run the 'info' command")


def test_a_server_refusing_info_is_checked_for_nothing(redis_server):
    assert server_checks.server_info(_Refusing()) == {}
    info = server_checks.server_info(redis_server.client())  # a real one: its version and its memory policy
    assert info["redis_version"] and info["maxmemory_policy"] and "maxmemory" in info


def test_a_full_redis_is_named_at_start_and_one_with_room_is_not(redis_server):
    r = redis_server.client()
    assert server_checks.full_problem(r) is None
    assert r.exists("rose:oom-probe") == 0  # the probe writes nothing
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        problem = server_checks.full_problem(r)
    finally:
        r.config_set("maxmemory", 0)
    assert problem is not None and problem.startswith("is full (maxmemory) and refuses writes (")


def test_a_write_refused_for_memory_is_known_by_either_wording():
    assert is_oom(redis.exceptions.OutOfMemoryError("command not allowed when used memory > ..."))
    # Redis before 7.0: a script's refused write comes back as a script error
    wrapped = "Error running script (call to f_1): @user_script:5: -OOM command not allowed when used memory > 'maxmemory'"
    assert is_oom(redis.ResponseError(wrapped))
    assert not is_oom(redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"))
    assert not is_oom(redis.ConnectionError("Connection refused"))
