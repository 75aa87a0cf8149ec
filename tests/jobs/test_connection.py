"""rose.jobs.connection: Redis URLs (plain and Sentinel) to clients, and their redaction. Nothing here connects
to a Sentinel that answers (tests/harness/test_sentinel.py runs a real one)."""

from __future__ import annotations

import argparse
import asyncio
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from pydantic import ValidationError

import rose.config
from rose.cli import common
from rose.config import WorkerSettings
from rose.jobs.connection import (
    SentinelURL,
    connect,
    connect_async,
    parse_sentinel_url,
    redact_url,
    sentinel_url,
)
from rose.worker import cli as worker_cli

# ---- parsing ------------------------------------------------------------------------------------------------


def test_hosts_default_port_service_and_db():
    parsed = parse_sentinel_url("redis+sentinel://s1:26380,s2,[::1]:26381,[fe80::2]/mymaster/3")
    assert parsed == SentinelURL(
        hosts=(("s1", 26380), ("s2", 26379), ("::1", 26381), ("fe80::2", 26379)),
        service_name="mymaster",
        db=3,
    )
    assert parse_sentinel_url("redis+sentinel://s1/svc").db == 0
    assert parse_sentinel_url("redis+sentinel://s1/svc/").db == 0
    assert parse_sentinel_url("redis+sentinel://s1/svc/0/").db == 0
    assert parse_sentinel_url("REDIS+SENTINEL://s1/svc").service_name == "svc"  # schemes are case-insensitive
    assert parse_sentinel_url("redis+sentinel://s1/my%2Fsvc").service_name == "my/svc"


def test_credentials_and_sentinel_credentials():
    parsed = parse_sentinel_url(
        "redis+sentinel://rose-worker:p%40ss%3Aw%2Frd@s1,s2/svc/1"
        "?sentinel_username=watcher&sentinel_password=s%26cret"
    )
    assert (parsed.username, parsed.password) == ("rose-worker", "p@ss:w/rd")
    assert (parsed.sentinel_username, parsed.sentinel_password) == ("watcher", "s&cret")
    assert parsed.master_kwargs() == {"db": 1, "username": "rose-worker", "password": "p@ss:w/rd"}
    assert parsed.sentinel_kwargs() == {"username": "watcher", "password": "s&cret"}
    # requirepass style (no user), and a user with an empty password (as redis-py: no password)
    assert parse_sentinel_url("redis+sentinel://:pw@s1/svc").master_kwargs() == {"db": 0, "password": "pw"}
    assert parse_sentinel_url("redis+sentinel://u:@s1/svc").master_kwargs() == {"db": 0, "username": "u"}
    assert parse_sentinel_url("redis+sentinel://s1/svc").sentinel_kwargs() == {}


def test_tls_to_the_data_nodes():
    parsed = parse_sentinel_url(
        "rediss+sentinel://s1/svc?ssl_ca_certs=/certs/ca.crt&ssl_cert_reqs=required&ssl_check_hostname=false"
    )
    assert parsed.ssl
    assert parsed.master_kwargs() == {
        "db": 0,
        "ssl": True,
        "ssl_ca_certs": "/certs/ca.crt",
        "ssl_cert_reqs": "required",
        "ssl_check_hostname": False,
    }
    assert not parse_sentinel_url("redis+sentinel://s1/svc").ssl


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis+sentinel:///svc", "no Sentinel host in 'redis+sentinel:///svc'"),
        ("redis+sentinel://u:secret@/svc", "no Sentinel host in 'redis+sentinel://u:***@/svc'"),
        ("redis+sentinel://s1,,s2/svc", "no host in Sentinel address ''"),
        ("redis+sentinel://:26379/svc", "no host in Sentinel address ':26379'"),
        ("redis+sentinel://s1:http/svc", "bad port 'http' for Sentinel host 's1'"),
        ("redis+sentinel://s1:0/svc", "bad port '0' for Sentinel host 's1'"),
        ("redis+sentinel://s1:65536/svc", "bad port '65536'"),
        ("redis+sentinel://[::1/svc", "bad Sentinel host '[::1'"),
        ("redis+sentinel://[::1]x/svc", "bad Sentinel host '[::1]x'"),
        ("redis+sentinel://s1", "missing service name in 'redis+sentinel://s1'"),
        ("redis+sentinel://s1/", "missing service name"),
        ("redis+sentinel://s1//0", "missing service name"),
        ("redis+sentinel://s1/svc/first", "bad db 'first' in"),
        ("redis+sentinel://s1/svc/-1", "bad db '-1'"),
        ("redis+sentinel://s1/svc//0", "unexpected path '/svc//0'"),
        ("redis+sentinel://s1/svc/0/1", "unexpected path '/svc/0/1'"),
        ("redis+sentinel://s1/svc?db=2", "unknown query parameter 'db'"),
        ("redis+sentinel://s1/svc?ssl_ca_certs=/ca", "unknown query parameter 'ssl_ca_certs'"),
        ("rediss+sentinel://s1/svc?ssl_check_hostname=maybe", "bad ssl_check_hostname 'maybe'"),
        ("sentinel://s1/svc", "unknown Redis URL scheme in 'sentinel://s1/svc' (scheme 'sentinel')"),
        ("s1:26379/svc", "unknown Redis URL scheme in 's1:26379/svc' (no scheme)"),
        ("redis://s1:6379/0", "not a Sentinel URL"),
    ],
)
def test_each_error_names_the_problem(url, message):
    with pytest.raises(ValueError) as info:
        parse_sentinel_url(url)
    assert message in str(info.value)


def test_errors_never_show_passwords():
    for url in (
        "redis+sentinel://u:hunter2@s1:x/svc",
        "redis+sentinel://u:hunter2@s1/svc?sentinel_password=hunter3&x=1",
        "redis+sentinel://u:hunter2@s1/svc/x?sentinel_password=hunter3",
        "ftp://u:hunter2@s1/svc",
    ):
        with pytest.raises(ValueError) as info:
            parse_sentinel_url(url)
        assert "hunter" not in str(info.value) and "***" in str(info.value)


def test_the_ssl_hint_and_the_accepted_parameters():
    with pytest.raises(ValueError, match=r"TLS options need rediss\+sentinel://"):
        parse_sentinel_url("redis+sentinel://s1/svc?ssl_cert_reqs=none")
    with pytest.raises(ValueError, match="takes sentinel_username, sentinel_password, ssl_cert_reqs"):
        parse_sentinel_url("rediss+sentinel://s1/svc?socket_timeout=1")


def test_sentinel_url_round_trips():
    url = sentinel_url([("127.0.0.1", 26379), ("::1", 26380)], "my svc", db=2)
    assert url == "redis+sentinel://127.0.0.1:26379,[::1]:26380/my%20svc/2"
    parsed = parse_sentinel_url(url)
    assert parsed.hosts == (("127.0.0.1", 26379), ("::1", 26380))
    assert (parsed.service_name, parsed.db) == ("my svc", 2)


# ---- clients (built, not connected) ------------------------------------------------------------------------


def test_plain_urls_are_from_url_exactly():
    for url in ("redis://u:pw@h:1/2", "rediss://h:6380/0?ssl_cert_reqs=none", "unix:///tmp/r.sock?db=3"):
        kwargs = {"socket_connect_timeout": 5, "health_check_interval": 30}
        ours, theirs = connect(url, **kwargs), redis.Redis.from_url(url, **kwargs)
        pool, expected = ours.connection_pool, theirs.connection_pool
        assert type(pool) is type(expected) and pool.connection_class is expected.connection_class
        assert {
            k: v for k, v in pool.connection_kwargs.items() if isinstance(v, str | int | float | None)
        } == {k: v for k, v in expected.connection_kwargs.items() if isinstance(v, str | int | float | None)}
        # from_url pools have no retry policy: a failed command raises at once (the caller decides)
        assert pool.connection_kwargs.get("retry") is None
        assert pool.make_connection().retry.get_retries() == 0
    assert isinstance(connect_async("redis://h:1/0"), redis.asyncio.Redis)


def test_sentinel_client_options():
    url = "redis+sentinel://u:pw@s1:1,s2/svc/4?sentinel_username=su&sentinel_password=spw"
    client = connect(url, socket_connect_timeout=5, socket_timeout=7, health_check_interval=30, db=9)
    pool = client.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
    assert (pool.service_name, pool.is_master) == ("svc", True)
    assert pool.connection_class is redis.sentinel.SentinelManagedConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (4, "u", "pw")  # the URL's db wins
    assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"], kwargs["health_check_interval"]) == (
        5,
        7,
        30,
    )
    assert pool.make_connection().retry.get_retries() == 0  # no retries added to the data nodes
    sentinels = pool.sentinel_manager.sentinels
    assert [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in sentinels
    ] == [
        ("s1", 1),
        ("s2", 26379),
    ]
    for s in sentinels:
        skw = s.connection_pool.connection_kwargs
        assert (skw["username"], skw["password"]) == ("su", "spw")
        assert (skw["socket_connect_timeout"], skw["socket_timeout"]) == (5, 7)
        assert not skw.get("health_check_interval")  # data-node options stay there
        assert skw["db"] == 0
        # no retries for the Sentinels either: discover_master already tries the next one
        assert s.get_retry().get_retries() == 0


def test_sentinel_tls_client():
    client = connect("rediss+sentinel://s1/svc?ssl_cert_reqs=none")
    assert client.connection_pool.connection_class is redis.sentinel.SentinelManagedSSLConnection
    assert client.connection_pool.connection_kwargs["ssl_cert_reqs"] == "none"


def test_async_sentinel_client_options():
    async def build() -> None:
        client = connect_async(
            "redis+sentinel://u:pw@s1/svc/2?sentinel_password=spw", socket_connect_timeout=5
        )
        pool = client.connection_pool
        assert isinstance(client, redis.asyncio.Redis)
        assert isinstance(pool, redis.asyncio.sentinel.SentinelConnectionPool)
        assert (pool.service_name, pool.is_master) == ("svc", True)
        assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (2, "pw")
        (sentinel,) = pool.sentinel_manager.sentinels
        skw = sentinel.connection_pool.connection_kwargs
        assert (skw["password"], skw["socket_connect_timeout"]) == ("spw", 5)
        assert sentinel.get_retry().get_retries() == 0
        await client.aclose()

    asyncio.run(build())


def test_connect_refuses_what_it_cannot_parse():
    with pytest.raises(ValueError, match="unknown Redis URL scheme"):
        connect("http://h:1/0")
    with pytest.raises(ValueError, match="missing service name"):
        connect("redis+sentinel://s1")
    with pytest.raises(ValueError, match="unknown Redis URL scheme"):
        connect_async("sentinel://s1/svc")


def test_no_sentinel_answers(unused_port):
    """An unreachable Sentinel is a ConnectionError (MasterNotFoundError) at the first command, not at connect()."""
    client = connect(f"redis+sentinel://127.0.0.1:{unused_port}/svc", socket_connect_timeout=1)
    with pytest.raises(redis.ConnectionError, match="No master found for 'svc'"):
        client.ping()


def test_the_clis_report_an_unreachable_sentinel_in_one_redacted_line(unused_port, capsys):
    url = f"redis+sentinel://u:hunter2@127.0.0.1:{unused_port}/svc?sentinel_password=hunter3"
    with pytest.raises(SystemExit) as info:
        worker_cli.connect(url)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "cannot reach Redis at redis+sentinel://u:***@" in err and "No master found" in err
    assert "hunter" not in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:
        common.connect(argparse.Namespace(redis_url=url, command="status"))
    assert "cannot reach Redis" in str(info.value) and "hunter" not in str(info.value)
    with pytest.raises(SystemExit) as info:
        common.connect(argparse.Namespace(redis_url="redis+sentinel://u:hunter2@s1", command="status"))
    assert "missing service name" in str(info.value) and "hunter" not in str(info.value)


# ---- redaction ----------------------------------------------------------------------------------------------


def _previous_redact_url(url: str) -> str:
    """rose.config.redact_url before Sentinel URLs: plain URLs must keep this output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:secret@h:1/0",
        "redis://h:1/0",
        "redis://:secret@h:6379",
        "redis://user@h:6379/0",
        "rediss://rose-worker:s3cr%40t@Redis.Example:6380/0?ssl_ca_certs=/certs/ca.crt&ssl_cert_reqs=required",
        "redis://u:pw@[::1]:6379/0",
        "unix:///tmp/redis.sock?db=1",
        "unix://u:pw@/tmp/redis.sock",
        "redis://localhost",
    ],
)
def test_plain_urls_redact_as_before(url):
    assert redact_url(url) == _previous_redact_url(url)
    assert rose.config.redact_url is redact_url


@pytest.mark.parametrize(
    "url, redacted",
    [
        (
            "redis+sentinel://u:secret@s1:26379,s2,[::1]:26380/svc/0",
            "redis+sentinel://u:***@s1:26379,s2,[::1]:26380/svc/0",
        ),
        ("redis+sentinel://:secret@s1/svc", "redis+sentinel://:***@s1/svc"),
        ("redis+sentinel://user@s1/svc", "redis+sentinel://user@s1/svc"),
        ("redis+sentinel://s1,s2/svc", "redis+sentinel://s1,s2/svc"),
        (
            "redis+sentinel://u:a%40b@s1,s2/svc?sentinel_username=su&sentinel_password=spw",
            "redis+sentinel://u:***@s1,s2/svc?sentinel_username=su&sentinel_password=***",
        ),
        (
            "redis+sentinel://s1/svc?sentinel_password=spw#x",
            "redis+sentinel://s1/svc?sentinel_password=***#x",
        ),
        (
            "rediss+sentinel://u:pw@s1/svc?ssl_cert_reqs=none&sentinel_password=spw",
            "rediss+sentinel://u:***@s1/svc?ssl_cert_reqs=none&sentinel_password=***",
        ),
        # passwords in the query string of plain URLs too (redis-py reads ?password=)
        ("unix:///tmp/r.sock?db=0&password=pw", "unix:///tmp/r.sock?db=0&password=***"),
        # a URL urlsplit cannot read (a bad port) still loses its password
        ("redis://u:secret@h:port/0", "redis://u:***@h:port/0"),
        ("not a url", "not a url"),
    ],
)
def test_redaction_of_each_form(url, redacted):
    assert redact_url(url) == redacted


# ---- settings -----------------------------------------------------------------------------------------------


def test_worker_settings_take_sentinel_urls(monkeypatch):
    for url in ("redis+sentinel://s1:26379,s2:26379,s3:26379/rose/0", "rediss+sentinel://u:pw@s1/rose"):
        assert WorkerSettings(redis_url=url).redis_url == url
    monkeypatch.setenv("ROSE_REDIS_URL", "redis+sentinel://sentinel-1,sentinel-2,sentinel-3/rose")
    settings, _ = worker_cli.load_settings([])
    assert settings.redis_url == "redis+sentinel://sentinel-1,sentinel-2,sentinel-3/rose"
    settings, _ = worker_cli.load_settings(["--redis-url", "redis+sentinel://s9/other/1"])
    assert settings.redis_url == "redis+sentinel://s9/other/1"


def test_worker_settings_refuse_bad_sentinel_urls_before_starting():
    with pytest.raises(ValidationError, match="missing service name"):
        WorkerSettings(redis_url="redis+sentinel://s1:26379")
    with pytest.raises(ValidationError, match="unknown query parameter 'sentinel_pasword'"):
        WorkerSettings(redis_url="redis+sentinel://s1/rose?sentinel_pasword=x")
    with pytest.raises(ValidationError, match=r"use one of redis://, rediss://, unix://, redis\+sentinel://"):
        WorkerSettings(redis_url="sentinel://s1/rose")


def test_help_texts_show_the_sentinel_form():
    assert "redis+sentinel://" in worker_cli.build_parser().format_help()
    parser = argparse.ArgumentParser()
    common.add_redis_args(parser)
    assert "redis+sentinel://" in parser.format_help()
