"""A real Sentinel deployment (rose.harness.sentinel): rose's clients find the primary through the Sentinels and,
after a failover, the same client objects reach the new one (a command retried once, as a worker would)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
from redis.sentinel import SentinelManagedConnection
from rq.job import Job as RQJob
from rq.serializers import JSONSerializer

from rose.harness.redis_server import RedisServerError
from rose.harness.sentinel import HOST, SentinelCluster
from rose.jobs.client import Client
from rose.jobs.connection import connect, connect_async

TIMEOUTS = {"socket_connect_timeout": 2, "socket_timeout": 5}


def start_cluster() -> SentinelCluster:
    try:
        return SentinelCluster().start()
    except RedisServerError as exc:
        pytest.fail(f"the Sentinel tests need a local redis-server: {exc}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SentinelCluster]:
    """One deployment for the tests that leave the primary alone."""
    with start_cluster() as c:
        yield c


@pytest.fixture
def own_cluster() -> Iterator[SentinelCluster]:
    """A deployment of the test's own (it will fail over)."""
    with start_cluster() as c:
        yield c


def direct(port: int) -> redis.Redis:
    return redis.Redis(host=HOST, port=port, socket_timeout=5, retry=None)


def once_more(command: Callable[[], Any]) -> Any:
    """Run `command`; on a ConnectionError (the failover met on a pooled connection) run it once more."""
    try:
        return command()
    except redis.ConnectionError:
        return command()


async def once_more_async(command: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await command()
    except redis.ConnectionError:
        return await command()


def test_the_cluster_is_ready(cluster):
    primary = cluster.primary_port()
    assert cluster.url.startswith("redis+sentinel://127.0.0.1:") and cluster.url.endswith("/rose/0")
    assert len(cluster.sentinel_ports) == 3
    assert direct(primary).info("replication")["role"] == "master"
    assert cluster.replica_ports() == [p for p in cluster.nodes if p != primary]


def test_client_enqueues_and_reads_back_through_the_sentinels(cluster):
    client = Client(cluster.url, queue="sentinel")
    job = client.submit("Hello", max_tokens=4, metadata={"via": "sentinel"})
    fetched = RQJob.fetch(job.id, connection=client.redis, serializer=JSONSerializer)
    assert fetched.kwargs == {"prompt": "Hello", "max_tokens": 4, "metadata": {"via": "sentinel"}}
    assert job.status() == "queued" and client.queue.count >= 1
    # written on the primary, and replicated
    assert direct(cluster.primary_port()).exists(fetched.key) == 1
    assert client.redis.wait(1, 5000) == 1
    (replica,) = cluster.replica_ports()
    assert direct(replica).exists(fetched.key) == 1
    client.redis.close()


def test_connect_and_connect_async_reach_the_primary(cluster):
    primary = cluster.primary_port()
    client = connect(cluster.url, **TIMEOUTS)
    assert client.info("replication")["role"] == "master"
    assert int(client.config_get("port")["port"]) == primary
    client.close()

    async def reach() -> tuple[str, int]:
        aclient = connect_async(cluster.url, **TIMEOUTS)
        try:
            role = (await aclient.info("replication"))["role"]
            return role, int((await aclient.config_get("port"))["port"])
        finally:
            await aclient.aclose()

    assert asyncio.run(reach()) == ("master", primary)


def test_after_a_failover_the_same_clients_write_to_the_new_primary(own_cluster):
    """SIGKILL the primary: once the Sentinels have promoted the replica, the clients made before the failover
    (sync, asyncio, rose's Client) write to the new primary, retrying a command once; the old primary, restarted,
    rejoins as a replica of the new one and gets what was written meanwhile."""
    cluster = own_cluster
    sync = connect(cluster.url, **TIMEOUTS)
    producer = Client(cluster.url, queue="failover")
    before = producer.submit("before", max_tokens=1)
    sync.set("before", "1")
    assert sync.wait(1, 5000) == 1  # replicated: a failover cannot lose it

    async def across_the_failover() -> tuple[int, int, float]:
        aclient = connect_async(cluster.url, **TIMEOUTS)
        try:
            await aclient.set("async-before", "1")
            start = time.monotonic()
            old = cluster.kill_primary()
            new = await asyncio.to_thread(cluster.wait_failover)
            took = time.monotonic() - start
            await once_more_async(lambda: aclient.set("async-after", "1"))
            assert int((await aclient.config_get("port"))["port"]) == new
            return old, new, took
        finally:
            await aclient.aclose()

    old, new, took = asyncio.run(across_the_failover())
    assert new != old and took < 15
    once_more(lambda: sync.set("after", "1"))
    assert int(sync.config_get("port")["port"]) == new
    after = once_more(lambda: producer.submit("after", max_tokens=1))
    new_primary = direct(new)
    assert new_primary.info("replication")["role"] == "master"
    assert new_primary.mget("before", "async-after", "after") == [b"1", b"1", b"1"]
    assert before.status() == "queued" and after.status() == "queued"

    rejoined = cluster.restart_old_primary()
    assert rejoined == old and cluster.primary_port() == new
    info = direct(old).info("replication")
    assert (info["role"], info["master_port"], info["master_link_status"]) == ("slave", new, "up")
    assert direct(old).mget("before", "after") == [b"1", b"1"]  # a full copy of the new primary
    with pytest.raises(redis.ReadOnlyError):
        direct(old).set("x", "1")
    sync.close()
    producer.redis.close()


def test_a_connection_left_on_a_demoted_primary_reports_a_connection_error(own_cluster):
    """A failover with the old primary alive (SENTINEL FAILOVER): Sentinel demotes it and kills its clients, so
    the pooled connection fails once and the retry reaches the new primary. A connection still on the demoted
    primary gets READONLY, which redis-py's SentinelManagedConnection turns into a ConnectionError (and drops
    the connection), so a client never keeps writing to a replica."""
    cluster = own_cluster
    client = connect(cluster.url, **TIMEOUTS)
    client.set("k", "1")
    old = cluster.primary_port()
    first_sentinel = direct(cluster.sentinel_ports[0])
    assert first_sentinel.execute_command("SENTINEL", "FAILOVER", cluster.service) in (b"OK", "OK", True)
    new = cluster.wait_failover(old_port=old)
    # the Sentinels reconfigure the old primary as a replica of the new one (it never went down)
    cluster.wait_replica_of(old, new)

    once_more(lambda: client.set("k", "2"))
    assert direct(new).get("k") == b"2"

    stale = client.connection_pool.make_connection()
    assert isinstance(stale, SentinelManagedConnection)
    stale.connect_to((HOST, old))  # as a connection made just before the switch would be
    stale.send_command("SET", "k", "3")
    with pytest.raises(redis.ConnectionError, match="previous master is now a slave"):
        stale.read_response()
    assert stale._sock is None  # disconnected: its next connect asks the Sentinels again
    with contextlib.suppress(redis.ConnectionError):
        stale.disconnect()
    client.close()
