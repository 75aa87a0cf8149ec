"""A throwaway Redis Sentinel deployment on 127.0.0.1 (part of the harness, for tests): a primary, one replica and
three Sentinels, each on a free port, in a temporary directory; kill the primary, wait for the failover, restart
the old primary and watch it rejoin as a replica.

Timings are shortened so that a failover takes about 2 s, not half a minute. Per service: `down-after-milliseconds`
1000, `failover-timeout` 3000 (a failed election is tried again after twice that). Per Sentinel (`SENTINEL DEBUG`,
Redis >= 7.0; older ones keep their slower defaults): PING every 500 ms (not less: while the primary is down, a
replica may be promoted only if its last INFO is at most 5 PING periods old, and INFO comes every second), INFO
every second, hello messages and down-state questions every 250 ms (the Sentinels find each other, agree that the
primary is down and convert a restarted one within about a second), and a TILT that needs a 5 s stall, not 2 s,
and lasts 5 s, not 30, so that a loaded machine cannot freeze a failover for half a minute.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from rose.harness.redis_server import RedisServerError, RedisServerProcess, _die_with_parent, free_port
from rose.harness.worker_process import wait_for
from rose.jobs.connection import sentinel_url

HOST = "127.0.0.1"
QUORUM = 2
# SENTINEL DEBUG settings (milliseconds), global to each Sentinel process.
_DEBUG = {
    "ping-period": 500,
    "info-period": 1000,
    "publish-period": 250,
    "ask-period": 250,
    "tilt-trigger": 5000,
    "tilt-period": 5000,
}


class SentinelClusterError(RuntimeError):
    """The deployment did not start, or did not reach the state waited for (the message has the Sentinels' logs)."""


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports (free_port() alone may hand out the port it just released again)."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def _probe(port: int) -> redis.Redis:
    """A short-lived client that fails fast: no retries (redis-py's default retries a refused connection 10
    times), 1 s timeouts."""
    return redis.Redis(
        host=HOST, port=port, socket_timeout=1, socket_connect_timeout=1, retry=None, decode_responses=True
    )


class _Sentinel:
    """One `redis-server <conf> --sentinel` process; its config file is its own (Sentinel rewrites it)."""

    def __init__(
        self,
        binary: str,
        directory: Path,
        index: int,
        port: int,
        service: str,
        primary_port: int,
        down_after_ms: int,
        failover_timeout_ms: int,
    ) -> None:
        self.port = port
        self.conf = directory / f"sentinel-{index}.conf"
        self.log = directory / f"sentinel-{index}.log"
        self.conf.write_text(
            f"port {self.port}\nbind {HOST}\ndaemonize no\ndir {directory}\nlogfile {self.log}\n"
            "sentinel resolve-hostnames no\nsentinel announce-hostnames no\n"
            f"sentinel monitor {service} {HOST} {primary_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {service} 1\n"
        )
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.client = _probe(self.port)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, str(self.conf), "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def answers(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise SentinelClusterError(f"redis-server --sentinel on port {self.port} exited: {self.tail()}")
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def tune(self) -> None:
        """Shorter periods (SENTINEL DEBUG, Redis >= 7.0; older Sentinels keep their defaults)."""
        args = [str(x) for item in _DEBUG.items() for x in item]
        with contextlib.suppress(redis.ResponseError):
            self.client.execute_command("SENTINEL", "DEBUG", *args)

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        self.client.close()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


class SentinelCluster:
    """A primary (`redis-server`), one replica (`--replicaof` the primary) and three Sentinels (quorum 2) that
    monitor them as `service`, all on 127.0.0.1.

    `start()` returns once the replica is in sync and every Sentinel knows the primary, its replica and the two
    other Sentinels. `url` is the `redis+sentinel://` URL of the three Sentinels. `kill_primary()` SIGKILLs the
    primary; `wait_failover()` waits until every Sentinel names another primary and that one answers as
    `role:master`; `restart_old_primary()` starts the killed one again (empty, as a primary) and waits until the
    Sentinels have made it a replica of the new primary, in sync. `close()` stops everything and removes the
    directory; also a context manager (`with SentinelCluster().start() as cluster:`).

    Every process is killed by the kernel if the thread that started it dies (Linux PR_SET_PDEATHSIG), so call
    start() and restart_old_primary() from a thread that outlives the cluster (a test's main thread).
    """

    def __init__(
        self,
        service: str = "rose",
        *,
        binary: str | None = None,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
    ) -> None:
        self.service = service
        self._tmpdir: tempfile.TemporaryDirectory | None = tempfile.TemporaryDirectory(
            prefix="rose-sentinel-"
        )
        self.dir = Path(self._tmpdir.name)
        # Every node may become the primary: the default 5 s wait before a full sync would slow each one.
        self._replication = replication = ["--repl-diskless-sync-delay", "0"]
        ports = _free_ports(5)
        primary = RedisServerProcess(
            binary=binary, port=ports[0], directory=self._node_dir("a"), detach=True, args=replication
        )
        replica = RedisServerProcess(
            binary=binary,
            port=ports[1],
            directory=self._node_dir("b"),
            detach=True,
            args=[*replication, "--replicaof", HOST, str(primary.port)],
        )
        self.nodes: dict[int, RedisServerProcess] = {primary.port: primary, replica.port: replica}
        self.sentinels = [
            _Sentinel(
                primary.binary, self.dir, i, port, service, primary.port, down_after_ms, failover_timeout_ms
            )
            for i, port in enumerate(ports[2:])
        ]
        self.killed_port: int | None = None

    def _node_dir(self, name: str) -> Path:
        path = self.dir / name
        path.mkdir()
        return path

    @property
    def url(self) -> str:
        return sentinel_url([(HOST, s.port) for s in self.sentinels], self.service)

    @property
    def sentinel_ports(self) -> list[int]:
        return [s.port for s in self.sentinels]

    # ---- start / stop ---------------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> SentinelCluster:
        """Start the data nodes, then the Sentinels; SentinelClusterError if they are not all ready within
        `timeout` s (everything is stopped then)."""
        primary, replica = self.nodes.values()
        try:
            primary.start(timeout)
            replica.start(timeout)
            self._wait(lambda: self._in_sync(replica.port, primary.port), timeout, "the replica to sync")
            for sentinel in self.sentinels:
                sentinel.start()
            for sentinel in self.sentinels:
                self._wait(sentinel.answers, timeout, f"the Sentinel on port {sentinel.port} to answer PING")
                sentinel.tune()
            self._wait(
                self._sentinels_ready, timeout, "the Sentinels to know the primary, replica and each other"
            )
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process (idempotent) and remove the directory."""
        for sentinel in self.sentinels:
            sentinel.stop()
        for node in self.nodes.values():
            node.stop()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> SentinelCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state ----------------------------------------------------------------------------------------------

    def primary_port(self) -> int:
        """The primary's port as the Sentinels name it now (the answer of most of them); SentinelClusterError if
        none answers."""
        answers = Counter(p for s in self.sentinels if (p := self._named_by(s)) is not None)
        if not answers:
            raise SentinelClusterError(f"no Sentinel names a primary for {self.service!r}")
        return answers.most_common(1)[0][0]

    def replica_ports(self) -> list[int]:
        """The ports of the data nodes that are up and answer as replicas."""
        return [port for port in self.nodes if self._role(port) == "slave"]

    def kill_primary(self) -> int:
        """SIGKILL the primary the Sentinels name (a crash: no shutdown, no replica told); returns its port."""
        port = self.primary_port()
        self.nodes[port].kill()
        self.killed_port = port
        return port

    def wait_failover(self, timeout: float = 15.0, old_port: int | None = None) -> int:
        """Wait until every Sentinel names a primary other than `old_port` (default: the one kill_primary()
        killed) that they see up and that answers as `role:master`; returns its port."""
        old = old_port if old_port is not None else self.killed_port

        def switched() -> int | None:
            named = {self._named_by(s, healthy=True) for s in self.sentinels}
            if len(named) != 1:
                return None
            (port,) = named
            return port if port is not None and port != old and self._role(port) == "master" else None

        return self._wait(switched, timeout, f"a failover away from port {old}")

    def restart_old_primary(self, timeout: float = 20.0) -> int:
        """Start the primary that kill_primary() killed again, on its port, as it was when it died: a primary, and
        empty (no persistence). Wait until the Sentinels have made it a replica of the current primary (their
        `+convert-to-slave`, about a second) and it is in sync; returns its port."""
        if self.killed_port is None:
            raise SentinelClusterError("no primary was killed")
        port, self.killed_port = self.killed_port, None
        node = self.nodes[port]
        # A node that started as the replica was promoted since: it must not come back with its --replicaof.
        node.args = list(self._replication)
        node.start(timeout)
        self._wait(
            lambda: self._in_sync(port, self.primary_port()), timeout, f"port {port} to rejoin as a replica"
        )
        return port

    def wait_replica_of(self, port: int, primary_port: int, timeout: float = 15.0) -> None:
        """Wait until the node on `port` is an in-sync replica of `primary_port` (a demoted primary that never went
        down: the Sentinels reconfigure it and kill its clients, so a probe may meet a reset connection)."""
        self._wait(
            lambda: self._in_sync(port, primary_port), timeout, f"port {port} to follow port {primary_port}"
        )

    # ---- helpers --------------------------------------------------------------------------------------------

    def _named_by(self, sentinel: _Sentinel, healthy: bool = False) -> int | None:
        """The primary port `sentinel` names (with `healthy`: only if it sees it up, as redis-py's
        discover_master requires), or None."""
        try:
            if healthy:
                state = sentinel.client.sentinel_master(self.service)
                ok = state["is_master"] and not state["is_sdown"] and not state["is_odown"]
                return int(state["port"]) if ok else None
            addr = sentinel.client.sentinel_get_master_addr_by_name(self.service)
            return int(addr[1]) if addr else None
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return None

    def _info(self, port: int) -> dict[str, Any]:
        try:
            with contextlib.closing(_probe(port)) as client:
                return client.info("replication")
        except (redis.ConnectionError, redis.TimeoutError):
            return {}

    def _role(self, port: int) -> str | None:
        return self._info(port).get("role")

    def _in_sync(self, replica_port: int, primary_port: int) -> bool:
        """`replica_port` is a replica of `primary_port`, its link up, and the primary counts it online."""
        info = self._info(replica_port)
        if info.get("role") != "slave" or info.get("master_port") != primary_port:
            return False
        if info.get("master_link_status") != "up":
            return False
        replicas = [
            v for k, v in self._info(primary_port).items() if k.startswith("slave") and isinstance(v, dict)
        ]
        return any(r.get("port") == replica_port and r.get("state") == "online" for r in replicas)

    def _sentinels_ready(self) -> bool:
        primary = next(iter(self.nodes))
        for sentinel in self.sentinels:
            try:
                state = sentinel.client.sentinel_master(self.service)
                sentinel.client.execute_command("SENTINEL", "CKQUORUM", self.service)  # ResponseError if not
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                return False
            if int(state["port"]) != primary or state["flags"] != "master":
                return False
            if state["num-slaves"] != 1 or state["num-other-sentinels"] != len(self.sentinels) - 1:
                return False
        return True

    def _wait(self, predicate: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(predicate, timeout, what, 0.05, SentinelClusterError)
        except (SentinelClusterError, RedisServerError) as exc:
            logs = "\n".join(f"--- sentinel on port {s.port}:\n{s.tail()}" for s in self.sentinels)
            raise SentinelClusterError(f"{exc}\n{logs}") from None
