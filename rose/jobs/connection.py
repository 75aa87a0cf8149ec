"""One place that turns a Redis URL into a client, for rose-worker, the `rose` CLI and the producers.

Plain URLs (`redis://`, `rediss://`, `unix://`) go to redis-py's `Redis.from_url` unchanged. A Sentinel URL

    redis+sentinel://[user:password@]host[:port][,host[:port]...]/service_name[/db][?sentinel_username=...&sentinel_password=...]

names the Sentinels (port 26379 by default) and the service they watch; the client asks them for the primary and
follows failovers. `rediss+sentinel://` speaks TLS to the Redis data nodes (the Sentinels themselves in plain TCP)
and takes redis-py's `ssl_*` options in the query string. The URL's user and password authenticate to the data
nodes, `sentinel_username` / `sentinel_password` to the Sentinels. Characters such as `@ / ? # , :` in a user
name or password are percent-encoded, as in any URL.

Importing this module does not import torch (nor redis.asyncio: `connect_async` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

if TYPE_CHECKING:
    import redis.asyncio

__all__ = [
    "DEFAULT_SENTINEL_PORT",
    "SCHEMES",
    "SentinelURL",
    "connect",
    "connect_async",
    "is_sentinel_url",
    "parse_sentinel_url",
    "redact_url",
    "sentinel_url",
]

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SCHEMES = PLAIN_SCHEMES + SENTINEL_SCHEMES
DEFAULT_SENTINEL_PORT = 26379

_SENTINEL_PARAMS = ("sentinel_username", "sentinel_password")
# redis-py's TLS options for the data nodes (SSLConnection's keyword arguments), rediss+sentinel:// only.
_SSL_PARAMS = (
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
)
_PASSWORD_PARAMS = ("password", "sentinel_password")
_SENTINEL_FORM = "redis+sentinel://[user:password@]host[:port][,host[:port]...]/service_name[/db]"


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` / `rediss+sentinel://` URL (see the module docstring)."""

    hosts: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    ssl_options: dict[str, Any] = field(default_factory=dict)

    def master_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `Sentinel.master_for` that the URL sets (credentials only where given)."""
        out: dict[str, Any] = {"db": self.db}
        if self.username is not None:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password
        if self.ssl:
            out["ssl"] = True
            out.update(self.ssl_options)
        return out

    def sentinel_kwargs(self) -> dict[str, Any]:
        """Credentials for the Sentinels themselves (redis-py's `sentinel_kwargs`)."""
        out: dict[str, Any] = {}
        if self.sentinel_username is not None:
            out["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            out["password"] = self.sentinel_password
        return out


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case ('' when it has none)."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else ""


def is_sentinel_url(url: str) -> bool:
    return scheme_of(url) in SENTINEL_SCHEMES


def check_scheme(url: str) -> str:
    """The URL's scheme; ValueError naming the accepted ones if rose does not know it."""
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        accepted = ", ".join(f"{s}://" for s in SCHEMES)
        got = f"scheme {scheme!r}" if scheme else "no scheme"
        raise ValueError(f"unknown Redis URL scheme in {redact_url(url)!r} ({got}): use one of {accepted}")
    return scheme


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a Sentinel URL. ValueError, naming the problem (the URL's passwords redacted), for: no host, a bad
    port, no service name, a bad db, an unknown scheme, an unknown query parameter."""
    scheme = check_scheme(url)
    shown = redact_url(url)
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL: {shown!r} (expected {_SENTINEL_FORM})")
    rest = url.partition("://")[2].partition("#")[0]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, _, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) or None  # as redis-py: `user:@host` means no password
    hosts = tuple(_parse_host(h, shown) for h in hostlist.split(",")) if hostlist.strip() else ()
    if not hosts:
        raise ValueError(f"no Sentinel host in {shown!r} (expected {_SENTINEL_FORM})")
    segments = path.split("/")
    service_name = unquote(segments[0])
    if not service_name:
        raise ValueError(
            f"missing service name in {shown!r}: the path names the service the Sentinels monitor "
            f"(expected {_SENTINEL_FORM})"
        )
    db = 0
    if len(segments) > 1 and segments[1]:
        if not segments[1].isdigit() or not segments[1].isascii():
            raise ValueError(f"bad db {segments[1]!r} in {shown!r}: the db is a number (service_name/0)")
        db = int(segments[1])
    if any(segments[2:]) or (len(segments) > 2 and not segments[1]):
        raise ValueError(f"unexpected path {'/' + path!r} in {shown!r} (expected /service_name[/db])")
    options = _parse_query(query, scheme, shown)
    return SentinelURL(
        hosts=hosts,
        service_name=service_name,
        db=db,
        username=username,
        password=password,
        sentinel_username=options.pop("sentinel_username", None),
        sentinel_password=options.pop("sentinel_password", None),
        ssl=scheme == "rediss+sentinel",
        ssl_options=options,
    )


def _parse_host(item: str, shown: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # an IPv6 address: [::1]:26379
        host, close, port = item[1:].partition("]")
        if not close or (port and not port.startswith(":")):
            raise ValueError(f"bad Sentinel host {item!r} in {shown!r}")
        port = port[1:]
    else:
        host, _, port = item.partition(":")
    host = unquote(host)
    if not host:
        raise ValueError(f"no host in Sentinel address {item!r} of {shown!r} (expected host[:port])")
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(
            f"bad port {port!r} for Sentinel host {host!r} in {shown!r}: a number from 1 to 65535"
        )
    return host, int(port)


def _parse_query(query: str, scheme: str, shown: str) -> dict[str, Any]:
    known = _SENTINEL_PARAMS + (_SSL_PARAMS if scheme == "rediss+sentinel" else ())
    out: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in known:
            hint = " (TLS options need rediss+sentinel://)" if key in _SSL_PARAMS else ""
            raise ValueError(
                f"unknown query parameter {key!r} in {shown!r}{hint}: a Sentinel URL takes {', '.join(known)}"
            )
        if key == "ssl_check_hostname":
            if value.lower() not in ("true", "false", "yes", "no", "1", "0"):
                raise ValueError(f"bad ssl_check_hostname {value!r} in {shown!r}: true or false")
            out[key] = value.lower() in ("true", "yes", "1")
        else:
            out[key] = value
    return out


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A client for `url`; `kwargs` go to redis-py's connections (socket timeouts, health_check_interval, ...).

    Plain URLs: `redis.Redis.from_url(url, **kwargs)`, exactly (so no retry policy unless `kwargs` give one).
    Sentinel URLs: `Sentinel(hosts).master_for(service_name, db=..., username=..., password=..., **kwargs)`. The
    URL's values win over `kwargs`, as in `from_url`; the `socket_*` options also apply to the Sentinels.
    The client connects lazily (nothing is sent here) and follows failovers:

    - every new connection asks the Sentinels for the primary (`SentinelConnectionPool.get_master_address`); when
      the answer changes, the pool disconnects its idle connections so that they reconnect to the new primary;
    - a pooled connection is checked when taken from the pool (redis-py reconnects one whose socket has data or
      EOF pending, e.g. the old primary died), and one that fails in use is disconnected: the command raises
      ConnectionError and the next one reconnects through the Sentinels;
    - a write to a demoted primary (still up, now a replica) answers READONLY, which redis-py's
      `SentinelManagedConnection.read_response` turns into `ConnectionError("The previous master is now a
      slave")` after disconnecting (redis-py 8.1, redis/sentinel.py).

    So a command that meets the failover raises ConnectionError (MasterNotFoundError while no Sentinel names a
    healthy primary); retrying it later reaches the new primary. No retries are added to the data nodes'
    connections. The Sentinels' own clients get none either (redis-py would otherwise retry each Sentinel 10
    times before trying the next one; `discover_master` already goes through all of them).
    """
    scheme = check_scheme(url)
    if scheme in PLAIN_SCHEMES:
        return redis.Redis.from_url(url, **kwargs)
    parsed = parse_sentinel_url(url)
    sentinel = Sentinel(
        list(parsed.hosts), sentinel_kwargs=_for_sentinels(parsed, kwargs, Retry(NoBackoff(), 0))
    )
    return sentinel.master_for(parsed.service_name, **{**kwargs, **parsed.master_kwargs()})


def connect_async(url: str, **kwargs: Any) -> redis.asyncio.Redis:
    """asyncio twin of `connect`: `redis.asyncio.Redis.from_url`, or `redis.asyncio.sentinel.Sentinel.master_for`
    (same failover behaviour: redis-py's asyncio `SentinelManagedConnection` turns READONLY into ConnectionError)."""
    scheme = check_scheme(url)
    if scheme in PLAIN_SCHEMES:
        import redis.asyncio

        return redis.asyncio.Redis.from_url(url, **kwargs)
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    parsed = parse_sentinel_url(url)
    sentinel = AsyncSentinel(
        list(parsed.hosts), sentinel_kwargs=_for_sentinels(parsed, kwargs, AsyncRetry(NoBackoff(), 0))
    )
    return sentinel.master_for(parsed.service_name, **{**kwargs, **parsed.master_kwargs()})


def _for_sentinels(parsed: SentinelURL, kwargs: dict[str, Any], retry: Any) -> dict[str, Any]:
    """The Sentinels' connection options: the caller's socket options, the URL's Sentinel credentials, no retry."""
    socket_options = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    return {**socket_options, **parsed.sentinel_kwargs(), "retry": retry}


def redact_url(url: str) -> str:
    """The URL with every password replaced by `***` (the user info's, and `password=` / `sentinel_password=` in
    the query string), for logs and error messages. Plain URLs keep the form `urlsplit` gives them."""
    scheme = scheme_of(url)
    if scheme in PLAIN_SCHEMES:
        try:
            return _redact_query(_redact_plain(url))
        except ValueError:  # not a URL urlsplit can read (a bad port, ...): still hide the password
            pass
    return _redact_query(_redact_netloc(url))


def _redact_plain(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _redact_netloc(url: str) -> str:
    """Hide the password of `scheme://user:password@hosts...` without parsing the hosts (several, or odd)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}{tail}"


def _redact_query(url: str) -> str:
    head, q, query = url.partition("?")
    if not q:
        return url
    query, hash_, fragment = query.partition("#")
    items = []
    for item in query.split("&"):
        key, eq, _ = item.partition("=")
        items.append(f"{key}=***" if eq and unquote(key) in _PASSWORD_PARAMS else item)
    return f"{head}?{'&'.join(items)}{hash_}{fragment}"


def sentinel_url(hosts: list[tuple[str, int]], service_name: str, db: int = 0) -> str:
    """The `redis+sentinel://` URL of these Sentinels and service (no credentials)."""
    netloc = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in hosts)
    return f"redis+sentinel://{netloc}/{quote(service_name, safe='')}/{db}"
